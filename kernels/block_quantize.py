"""quantize and swizzled_quantize: floats (fp32 / bf16 / fp16, read in their dtype) -> block-wise
int8 / int4 q and fp32 scales, the scheme of `quant_scheme`; one kernel launch per op.

swizzled_quantize is qgZ's step 1 (the steps: `megadomino.kernels`): the world = num_nodes *
devices_per_node partitions of its input, each quantized on its own, partition p written at
output position (p % devices_per_node) * num_nodes + p // devices_per_node; quantize is its
case of one partition. Both write flat buffers or a PayloadLayout's rows (`quant_buffers`).

Two kernels, one per launch: `_quantize_kernel` quantizes a tile of whole blocks per program;
`_quantize_loop_kernel` (blocks of 8192 elements and more, Variant.stream) runs a few programs
per SM, each looping over blocks with the next block's load in flight.
"""

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.
import torch
from torch import Tensor

from megadomino.kernels.quant_buffers import check_float, fill, quantized_outputs
from megadomino.kernels.quant_launch import (
    BEST,
    STREAM_PROGRAMS_PER_SM,
    Rows,
    Variant,
    launch_shape,
    looping,
    on_device,
    partition_offset,
    program_blocks,
    sm_count,
    tile,
    tl,
    triton,
    use_triton,
)
from megadomino.kernels.quant_scheme import (
    check_scheme,
    quantize_partitions,
    quantize_tile,
    store_quantized,
)


@triton.jit
def _quantize_kernel(src_ptr, dst_ptr, dst_scale_ptr, partition_numel, partition_bytes,
                     blocks_per_partition, dst_row_parts, dst_row_stride, dst_scale_row_stride,
                     nodes, devices_per_node, BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
                     BLOCKS_PER_PROGRAM: tl.constexpr, BITS: tl.constexpr,
                     NARROW_STORE: tl.constexpr, FULL_RANGE: tl.constexpr):
    """Program (i, p): BLOCKS_PER_PROGRAM consecutive blocks of partition p of the flat floats
    at src_ptr, quantized to partition (p % devices_per_node) * nodes + p // devices_per_node
    of the dst_* row layout (quant_launch.partition_offset)."""
    partition = tl.program_id(1).to(tl.int64)
    first_block, rows, block_valid = program_blocks(blocks_per_partition, BLOCKS_PER_PROGRAM)
    elem_base, local, mask = tile(first_block, rows, partition_numel, BLOCK_SIZE, BLOCK_PAD,
                                  BLOCKS_PER_PROGRAM)
    # int4: partition_bytes = ceil(partition_numel / 2), an argument so that Triton sees its
    # divisibility and vectorizes the masked byte accesses.
    byte_base, byte_local, byte_mask = tile(first_block, rows, partition_bytes, BLOCK_SIZE // 2,
                                            BLOCK_PAD // 2, BLOCKS_PER_PROGRAM)
    dst_part = (partition % devices_per_node) * nodes + partition // devices_per_node
    dst_scale_ptrs = dst_scale_ptr + first_block + rows + partition_offset(
        dst_part, dst_row_parts, dst_scale_row_stride, blocks_per_partition)
    values = tl.load(src_ptr + elem_base + local + partition * partition_numel, mask=mask,
                     other=0.0)  # quantized from its own dtype
    q, scale = quantize_tile(values, (1 << (BITS - 1)) - 1, False, FULL_RANGE)
    if BITS == 8:
        dst = dst_ptr + (partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                          partition_numel) + elem_base)
    else:
        dst = dst_ptr + (partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                          partition_bytes) + byte_base)
    store_quantized(q, scale, dst, dst_scale_ptrs, block_valid, local, mask, byte_local,
                    byte_mask, BITS, BLOCKS_PER_PROGRAM, BLOCK_PAD, NARROW_STORE)


@triton.jit
def _quantize_loop_kernel(src_ptr, dst_ptr, dst_scale_ptr, partition_numel, partition_bytes,
                          blocks_per_partition, dst_row_parts, dst_row_stride,
                          dst_scale_row_stride, nodes, devices_per_node,
                          BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr, BITS: tl.constexpr,
                          NARROW_STORE: tl.constexpr, BRANCHLESS: tl.constexpr,
                          FULL_RANGE: tl.constexpr):
    """Blocks program_id(0), + num_programs(0), ... (BLOCK_PAD >= 8192) of partition
    p = program_id(1), written where _quantize_kernel writes them, one block per iteration,
    loading the next block before quantizing this one: large blocks fit few programs on an SM,
    and this keeps their loads in flight across each block's absmax."""
    partition = tl.program_id(1).to(tl.int64)
    dst_part = (partition % devices_per_node) * nodes + partition // devices_per_node
    src = src_ptr + partition * partition_numel
    dst = dst_ptr + partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                     partition_numel if BITS == 8 else partition_bytes)
    scales = dst_scale_ptr + partition_offset(dst_part, dst_row_parts, dst_scale_row_stride,
                                              blocks_per_partition)
    step = tl.num_programs(0).to(tl.int64) * BLOCK_SIZE
    cols = tl.arange(0, BLOCK_PAD)[None, :]
    byte_cols = tl.arange(0, BLOCK_PAD // 2)[None, :]
    first = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    x = tl.load(src + first + cols, mask=(cols < BLOCK_SIZE) & (cols < partition_numel - first),
                other=0.0)
    for base in range(first, partition_numel.to(tl.int64), step):  # 64-bit element offsets
        block = base // BLOCK_SIZE
        ahead = base + step
        x_next = tl.load(src + ahead + cols,
                         mask=(cols < BLOCK_SIZE) & (cols < partition_numel - ahead), other=0.0)
        q, scale = quantize_tile(x, (1 << (BITS - 1)) - 1, BRANCHLESS, FULL_RANGE)
        mask = (cols < BLOCK_SIZE) & (cols < partition_numel - base)
        byte_mask = (byte_cols < BLOCK_SIZE // 2) & (byte_cols < partition_bytes - base // 2)
        store_quantized(q, scale, dst + (base if BITS == 8 else base // 2),
                        scales + block + tl.arange(0, 1), tl.arange(0, 1) < 1, cols, mask,
                        byte_cols, byte_mask, BITS, 1, BLOCK_PAD, NARROW_STORE)
        x = x_next


def _launch(x: Tensor, q: Tensor, scales: Tensor, dst_rows: Rows, *, partitions: int,
            partition_numel: int, block_size: int, bits: int, nodes: int = 1,
            devices_per_node: int = 1, full_range: bool, variant: Variant) -> None:
    """One launch over the `partitions` partitions of the flat `x`, into (q, scales) laid out
    as `dst_rows`; grid (program blocks, partitions), fewer program blocks when looping."""
    block_pad, blocks_per_program, blocks_per_partition, grid, num_warps = launch_shape(
        block_size, partition_numel, partitions, 0, bits, variant)
    args = (x, q, scales, partition_numel, (partition_numel + 1) // 2, blocks_per_partition,
            *dst_rows, nodes, devices_per_node)
    narrow_store = variant.narrow_store and bits == 4 and block_pad >= 2048
    with on_device(x):
        if looping(block_pad, 0, bits, variant.stream):  # a few programs per SM, each looping
            branchless = bits == 4 and variant.stream_int4_branchless
            per_sm = 3 if branchless else STREAM_PROGRAMS_PER_SM
            grid = (min(grid[0], max(1, per_sm * sm_count(x.device) // partitions)), partitions)
            _quantize_loop_kernel[grid](*args, BLOCK_SIZE=block_size, BLOCK_PAD=block_pad,
                                        BITS=bits, NARROW_STORE=narrow_store,
                                        BRANCHLESS=branchless, FULL_RANGE=full_range,
                                        num_warps=num_warps,
                                        enable_fp_fusion=False)  # bit-identical to the reference
        else:
            _quantize_kernel[grid](*args, BLOCK_SIZE=block_size, BLOCK_PAD=block_pad,
                                   BLOCKS_PER_PROGRAM=blocks_per_program, BITS=bits,
                                   NARROW_STORE=narrow_store, FULL_RANGE=full_range,
                                   num_warps=num_warps, enable_fp_fusion=False)


@torch.no_grad()
def quantize(x: Tensor, bits: int = 8, block_size: int = 2048, *,
             out: tuple[Tensor, Tensor] | None = None, force_triton: bool = False,
             full_range: bool = False, variant: Variant = BEST) -> tuple[Tensor, Tensor]:
    """Quantize the flattened `x` (float32/bfloat16/float16, read as is; copied only if not
    contiguous) block-wise (`full_range`: see quant_scheme's docstring).

    Returns (q, scales): q is int8 [numel] (bits=8) or uint8 [ceil(numel / 2)] (bits=4),
    scales float32 [ceil(numel / block_size)]. `out` = (q, scales) buffers to fill instead
    (flat, or a PayloadLayout's views of a one-row payload).
    """
    check_scheme(bits, block_size)
    x = check_float(x)
    q, scales, rows = quantized_outputs(out, 1, x.numel(), bits, block_size, x)
    if x.numel() == 0:
        return q, scales
    if not use_triton(x, force_triton):
        q_ref, s_ref = quantize_reference(x, bits, block_size, full_range)
        return fill(q, q_ref), fill(scales, s_ref)
    _launch(x, q, scales, rows, partitions=1, partition_numel=x.numel(), block_size=block_size,
            bits=bits, full_range=full_range, variant=variant)
    return q, scales


@torch.no_grad()
def swizzled_quantize(x: Tensor, bits: int, block_size: int, num_nodes: int,
                      devices_per_node: int, *, out: tuple[Tensor, Tensor] | None = None,
                      force_triton: bool = False, full_range: bool = False,
                      variant: Variant = BEST) -> tuple[Tensor, Tensor]:
    """qgZ step 1: quantize the world = num_nodes * devices_per_node partitions of the flat `x`
    (x.numel() % world == 0, P = numel / world), partition p written at position
    (p % devices_per_node) * num_nodes + p // devices_per_node (see the module docstring).

    Returns (q, scales): world * quantized_size(P, bits, block_size) elements, in output order;
    `out` may be a PayloadLayout's views, positions filling its rows in order (rows of
    num_nodes partitions: row d is what goes to local rank d).
    """
    check_scheme(bits, block_size)
    x = check_float(x)
    world = num_nodes * devices_per_node
    if num_nodes < 1 or devices_per_node < 1 or x.numel() % world:
        raise ValueError(f"{x.numel()} elements do not split into {num_nodes} x "
                         f"{devices_per_node} equal partitions")
    partition_numel = x.numel() // world
    q, scales, rows = quantized_outputs(out, world, partition_numel, bits, block_size, x)
    if x.numel() == 0:
        return q, scales
    if not use_triton(x, force_triton):
        q_ref, s_ref = swizzled_quantize_reference(x, bits, block_size, num_nodes,
                                                   devices_per_node, full_range)
        return fill(q, q_ref), fill(scales, s_ref)
    _launch(x, q, scales, rows, partitions=world, partition_numel=partition_numel,
            block_size=block_size, bits=bits, nodes=num_nodes,
            devices_per_node=devices_per_node, full_range=full_range, variant=variant)
    return q, scales


# --- torch references (CPU tensors run these; the tests' oracle) -------------------------------

def quantize_reference(x: Tensor, bits: int = 8, block_size: int = 2048,
                       full_range: bool = False) -> tuple[Tensor, Tensor]:
    """quantize() in torch ops."""
    check_scheme(bits, block_size)
    q, scales = quantize_partitions(x.reshape(1, -1).float(), bits, block_size, full_range)
    return q.view(-1), scales.view(-1)


def swizzled_quantize_reference(x: Tensor, bits: int, block_size: int, num_nodes: int,
                                devices_per_node: int,
                                full_range: bool = False) -> tuple[Tensor, Tensor]:
    """swizzled_quantize() in torch ops: output position o holds partition
    (o % num_nodes) * devices_per_node + o // num_nodes."""
    check_scheme(bits, block_size)
    world = num_nodes * devices_per_node
    order = [(o % num_nodes) * devices_per_node + o // num_nodes for o in range(world)]
    parts = x.reshape(world, -1).float()[order]
    q, scales = quantize_partitions(parts, bits, block_size, full_range)
    return q.reshape(-1), scales.reshape(-1)
