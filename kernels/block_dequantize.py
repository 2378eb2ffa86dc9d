"""dequantize and dequantize_reduce: block-wise int8 / int4 (q, scales) of one or more inputs ->
floats (q * scale in fp32, the scheme of `quant_scheme`, summed over the inputs in input order,
cast to the requested dtype); one kernel launch per op.

dequantize_reduce is qgZ's step 5 (the steps: `megadomino.kernels`) and qwZ's dequantize of
the gathered rows; dequantize is its case of one input of one partition. Inputs are flat or
the rows of a received payload, read in place (`quant_buffers`); results are flat.
`sum_dequantized` (and its reference) is the reduce that block_requantize shares.
"""

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.
import math

import torch
from torch import Tensor

from megadomino.kernels.quant_buffers import FLOAT_DTYPES, output, quantized_rows, reduce_shape
from megadomino.kernels.quant_launch import (
    BEST,
    Rows,
    Variant,
    launch_shape,
    on_device,
    partition_offset,
    program_blocks,
    tile,
    tl,
    triton,
    use_triton,
)
from megadomino.kernels.quant_scheme import check_scheme, dequantize_partitions, dequantize_tile


@triton.jit
def sum_dequantized(src_ptrs, src_mask, src_size, scale_ptrs, block_valid, partition,
                    num_partitions, src_row_parts, src_row_stride, src_scale_row_stride,
                    blocks_per_partition, NUM_INPUTS: tl.constexpr, BITS: tl.constexpr):
    """fp32 (blocks, BLOCK_PAD): the sum of NUM_INPUTS dequantized inputs in order, input j's
    partition being source partition j * num_partitions + partition (unrolled: loads of several
    inputs can be in flight together). src_ptrs / scale_ptrs: the tile's q (bytes at int4,
    `src_size` of them a partition) and scales in partition 0, which partition_offset moves
    to each source partition of the src_* row layout."""
    for j in tl.static_range(NUM_INPUTS):
        index = j * num_partitions + partition
        values_j = dequantize_tile(
            src_ptrs + partition_offset(index, src_row_parts, src_row_stride, src_size),
            src_mask,
            scale_ptrs + partition_offset(index, src_row_parts, src_scale_row_stride,
                                          blocks_per_partition),
            block_valid, BITS)
        if j == 0:
            values = values_j
        else:
            values += values_j
    return values


@triton.jit
def _dequantize_reduce_kernel(src_ptr, src_scale_ptr, dst_ptr, partition_numel, partition_bytes,
                              blocks_per_partition, src_row_parts, src_row_stride,
                              src_scale_row_stride, dst_row_parts, dst_row_stride, nodes,
                              devices_per_node, multiplier, NUM_INPUTS: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
                              BLOCKS_PER_PROGRAM: tl.constexpr, BITS: tl.constexpr,
                              SCALE_OUTPUT: tl.constexpr):
    """Program (i, p): BLOCKS_PER_PROGRAM consecutive blocks of partition p, the sum of the
    NUM_INPUTS inputs' partition p (sum_dequantized), times `multiplier` if SCALE_OUTPUT,
    written in dst_ptr's dtype to partition (p % devices_per_node) * nodes + p //
    devices_per_node of the dst_* rows (the launcher: flat, partition p)."""
    partition = tl.program_id(1).to(tl.int64)
    num_partitions = tl.num_programs(1).to(tl.int64)
    first_block, rows, block_valid = program_blocks(blocks_per_partition, BLOCKS_PER_PROGRAM)
    elem_base, local, mask = tile(first_block, rows, partition_numel, BLOCK_SIZE, BLOCK_PAD,
                                  BLOCKS_PER_PROGRAM)
    if BITS == 4:  # partition_bytes: an argument, so that Triton sees its divisibility
        byte_base, byte_local, byte_mask = tile(first_block, rows, partition_bytes,
                                                BLOCK_SIZE // 2, BLOCK_PAD // 2,
                                                BLOCKS_PER_PROGRAM)
        src_ptrs, src_mask, src_size = src_ptr + byte_base + byte_local, byte_mask, partition_bytes
    else:
        src_ptrs, src_mask, src_size = src_ptr + elem_base + local, mask, partition_numel
    dst_part = (partition % devices_per_node) * nodes + partition // devices_per_node
    values = sum_dequantized(src_ptrs, src_mask, src_size, src_scale_ptr + first_block + rows,
                             block_valid, partition, num_partitions, src_row_parts,
                             src_row_stride, src_scale_row_stride, blocks_per_partition,
                             NUM_INPUTS, BITS)
    if SCALE_OUTPUT:
        values = values * multiplier
    dst = dst_ptr + (partition_offset(dst_part, dst_row_parts, dst_row_stride, partition_numel)
                     + elem_base)
    tl.store(dst + local, values.to(dst_ptr.dtype.element_ty), mask=mask)


def _launch(q: Tensor, scales: Tensor, src_rows: Rows, result: Tensor, *, num_inputs: int,
            partitions: int, partition_numel: int, block_size: int, bits: int,
            multiplier: float, variant: Variant) -> None:
    """One launch over `partitions` partitions of each of the num_inputs inputs (q, scales)
    laid out as `src_rows`, into the flat `result`; grid (program blocks, partitions)."""
    block_pad, blocks_per_program, blocks_per_partition, grid, num_warps = launch_shape(
        block_size, partition_numel, partitions, bits, 0, variant)
    with on_device(q):
        _dequantize_reduce_kernel[grid](
            q, scales, result, partition_numel, (partition_numel + 1) // 2, blocks_per_partition,
            *src_rows, 1, partition_numel, 1, partitions, multiplier, NUM_INPUTS=num_inputs,
            BLOCK_SIZE=block_size, BLOCK_PAD=block_pad, BLOCKS_PER_PROGRAM=blocks_per_program,
            BITS=bits,
            SCALE_OUTPUT=multiplier != 1.0, num_warps=num_warps,
            enable_fp_fusion=False)  # no FMA: bit-identical to the reference


@torch.no_grad()
def dequantize(q: Tensor, scales: Tensor, numel: int, bits: int = 8, block_size: int = 2048,
               dtype: torch.dtype = torch.float32, *, out: Tensor | None = None,
               force_triton: bool = False, variant: Variant = BEST) -> Tensor:
    """The `numel` values that quantize() encoded as (q, scales), as a flat `dtype` tensor."""
    check_scheme(bits, block_size)
    quantized_rows(q, scales, 1, numel, bits, block_size)
    if numel == 0:
        return output(out, 0, dtype, q)
    return dequantize_reduce(q, scales, 1, bits, block_size, numel, dtype, out=out,
                             force_triton=force_triton, variant=variant)


@torch.no_grad()
def dequantize_reduce(q: Tensor, scales: Tensor, num_inputs: int, bits: int, block_size: int,
                      partition_numel: int, dtype: torch.dtype = torch.float32,
                      multiplier: float = 1.0, *, out: Tensor | None = None,
                      force_triton: bool = False, variant: Variant = BEST) -> Tensor:
    """qgZ step 5 (and qwZ's dequantize of the gathered rows), one launch: q holds num_inputs
    stacked inputs, each of the same number S of quantized `partition_numel`-element
    partitions; the fp32 sum over the inputs (in input order) of each partition, times
    `multiplier` (fp32), is returned as `dtype` [S * partition_numel] (`out`: flat,
    contiguous). (q, scales) are flat, or PayloadLayout views (partitions in row order)."""
    check_scheme(bits, block_size)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32/bfloat16/float16, got {dtype}")
    per_input, src_rows = reduce_shape(q, scales, num_inputs, partition_numel, bits, block_size)
    result = output(out, per_input * partition_numel, dtype, q)
    if not use_triton(q, force_triton):
        return result.copy_(dequantize_reduce_reference(q, scales, num_inputs, bits, block_size,
                                                        partition_numel, dtype, multiplier))
    _launch(q, scales, src_rows, result, num_inputs=num_inputs, partitions=per_input,
            partition_numel=partition_numel, block_size=block_size, bits=bits,
            multiplier=multiplier, variant=variant)
    return result


# --- torch references (CPU tensors run these; the tests' oracle) -------------------------------

def sum_dequantized_reference(q: Tensor, scales: Tensor, num_inputs: int, bits: int,
                              block_size: int, partition_numel: int) -> Tensor:
    """fp32 (S, partition_numel): the dequantized inputs summed in input order (q, scales:
    flat or [rows, ...] views, partitions in row order)."""
    parts = scales.numel() // math.ceil(partition_numel / block_size)
    values = dequantize_partitions(q.reshape(parts, -1), scales.reshape(parts, -1),
                                   partition_numel, bits, block_size)
    values = values.view(num_inputs, parts // num_inputs, -1)
    total = torch.zeros_like(values[0])
    for value in values:
        total = total + value
    return total


def dequantize_reference(q: Tensor, scales: Tensor, numel: int, bits: int = 8,
                         block_size: int = 2048, dtype: torch.dtype = torch.float32) -> Tensor:
    """dequantize() in torch ops."""
    check_scheme(bits, block_size)
    return dequantize_partitions(q.reshape(1, -1), scales.reshape(1, -1), numel, bits,
                                 block_size).view(-1).to(dtype)


def dequantize_reduce_reference(q: Tensor, scales: Tensor, num_inputs: int, bits: int,
                                block_size: int, partition_numel: int,
                                dtype: torch.dtype = torch.float32,
                                multiplier: float = 1.0) -> Tensor:
    """dequantize_reduce() in torch ops."""
    check_scheme(bits, block_size)
    total = sum_dequantized_reference(q, scales, num_inputs, bits, block_size, partition_numel)
    return (total * torch.tensor(multiplier, dtype=torch.float32)).view(-1).to(dtype)
