"""dequantize_reduce_quantize: block-wise int8 / int4 (q, scales) of several inputs -> their sum,
quantized again (the scheme of `quant_scheme`), in one fused kernel launch: no float
intermediate is written.

It is qgZ's step 3 (the steps: `megadomino.kernels`): the intra-node sum of the partitions a
rank received, read in place from the rows of the received payload and written into the rows
of the next all-to-all's send buffer (`quant_buffers`).

Three kernels, one per launch, the same sums and q: `_requantize_kernel` (int8 in or out)
dequantizes a tile per input (block_dequantize.sum_dequantized) and quantizes the sum;
int4 -> int4 keeps the even (low-nibble) and odd (high-nibble) elements apart,
`_requantize_int4_kernel` on bytes and `_requantize_int4_words_kernel` on int32 words of 8
nibbles where every partition and row is 4-byte aligned (Variant.words).
"""

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.
import torch
from torch import Tensor

from megadomino.kernels.block_dequantize import sum_dequantized, sum_dequantized_reference
from megadomino.kernels.quant_buffers import fill, quantized_outputs, reduce_shape
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
from megadomino.kernels.quant_scheme import (
    FAST_DIVISION_MIN_SCALE,
    abs_bits,
    check_scheme,
    quantize_partitions,
    quantize_tile,
    ratio_exact,
    ratio_fast,
    rounded_bits,
    scale_of,
    store_quantized,
)


@triton.jit
def _requantize_kernel(src_ptr, src_scale_ptr, dst_ptr, dst_scale_ptr, partition_numel,
                       partition_bytes, blocks_per_partition, src_row_parts, src_row_stride,
                       src_scale_row_stride, dst_row_parts, dst_row_stride, dst_scale_row_stride,
                       nodes, devices_per_node, NUM_INPUTS: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
                       BLOCKS_PER_PROGRAM: tl.constexpr,
                       BITS_IN: tl.constexpr, BITS_OUT: tl.constexpr,
                       NARROW_STORE: tl.constexpr, FULL_RANGE: tl.constexpr):
    """Program (i, p): BLOCKS_PER_PROGRAM consecutive blocks of partition p, the sum of the
    NUM_INPUTS inputs' partition p (sum_dequantized) quantized to partition
    (p % devices_per_node) * nodes + p // devices_per_node of the dst_* row layout (the
    launcher: partition p)."""
    partition = tl.program_id(1).to(tl.int64)
    num_partitions = tl.num_programs(1).to(tl.int64)
    first_block, rows, block_valid = program_blocks(blocks_per_partition, BLOCKS_PER_PROGRAM)
    elem_base, local, mask = tile(first_block, rows, partition_numel, BLOCK_SIZE, BLOCK_PAD,
                                  BLOCKS_PER_PROGRAM)
    byte_base, byte_local, byte_mask = tile(first_block, rows, partition_bytes, BLOCK_SIZE // 2,
                                            BLOCK_PAD // 2, BLOCKS_PER_PROGRAM)
    if BITS_IN == 4:
        src_ptrs, src_mask, src_size = src_ptr + byte_base + byte_local, byte_mask, partition_bytes
    else:
        src_ptrs, src_mask, src_size = src_ptr + elem_base + local, mask, partition_numel
    dst_part = (partition % devices_per_node) * nodes + partition // devices_per_node
    dst_scale_ptrs = dst_scale_ptr + first_block + rows + partition_offset(
        dst_part, dst_row_parts, dst_scale_row_stride, blocks_per_partition)
    values = sum_dequantized(src_ptrs, src_mask, src_size, src_scale_ptr + first_block + rows,
                             block_valid, partition, num_partitions, src_row_parts,
                             src_row_stride, src_scale_row_stride, blocks_per_partition,
                             NUM_INPUTS, BITS_IN)
    q, scale = quantize_tile(values, (1 << (BITS_OUT - 1)) - 1, False, FULL_RANGE)
    if BITS_OUT == 8:
        dst = dst_ptr + (partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                          partition_numel) + elem_base)
    else:
        dst = dst_ptr + (partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                          partition_bytes) + byte_base)
    store_quantized(q, scale, dst, dst_scale_ptrs, block_valid, local, mask, byte_local,
                    byte_mask, BITS_OUT, BLOCKS_PER_PROGRAM, BLOCK_PAD, NARROW_STORE)


@triton.jit
def _quantize_pair(low, high, scale, nonfinite, QMAX: tl.constexpr,
                   FULL_RANGE: tl.constexpr = False):
    """quant_scheme's quantization of two tiles sharing the blocks' scales (the even and the
    odd elements of int4 -> int4), with one fast-path decision and one reciprocal for both."""
    if tl.min(scale) < FAST_DIVISION_MIN_SCALE:
        ratio_low = ratio_exact(low, scale, QMAX, FULL_RANGE)
        ratio_high = ratio_exact(high, scale, QMAX, FULL_RANGE)
    else:
        inverse = tl.math.div_rn(1.0, scale)[:, None]
        ratio_low = ratio_fast(low, scale, inverse)
        ratio_high = ratio_fast(high, scale, inverse)
        if FULL_RANGE:
            ratio_low = tl.minimum(ratio_low, QMAX * 1.0)
            ratio_high = tl.minimum(ratio_high, QMAX * 1.0)
    return rounded_bits(ratio_low, nonfinite), rounded_bits(ratio_high, nonfinite)


@triton.jit
def _dequantize_nibbles(q_ptrs, q_mask, scale_ptrs, scale_mask):
    """int4 bytes -> fp32 (low nibbles, high nibbles), each (blocks, BLOCK_PAD / 2), times the
    block scales: the even and the odd elements, kept apart (no interleave)."""
    scale = tl.load(scale_ptrs, mask=scale_mask, other=0.0)[:, None]
    packed = tl.load(q_ptrs, mask=q_mask, other=0).to(tl.int32)
    low = ((packed & 15) ^ 8) - 8  # sign-extend the nibbles
    high = ((packed >> 4) ^ 8) - 8
    return low.to(tl.float32) * scale, high.to(tl.float32) * scale


@triton.jit
def _requantize_int4_kernel(src_ptr, src_scale_ptr, dst_ptr, dst_scale_ptr, partition_numel,
                            partition_bytes, blocks_per_partition, src_row_parts,
                            src_row_stride, src_scale_row_stride, dst_row_parts,
                            dst_row_stride, dst_scale_row_stride, nodes, devices_per_node,
                            NUM_INPUTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            BLOCK_PAD: tl.constexpr,
                            BLOCKS_PER_PROGRAM: tl.constexpr, FULL_RANGE: tl.constexpr):
    """_requantize_kernel for int4 -> int4 (qgZ's intra-node reduce): the even (low-nibble) and
    odd (high-nibble) elements are summed and quantized apart, sharing each block's absmax, and
    packed back; no interleave / split shuffles. The same sums and q."""
    partition = tl.program_id(1).to(tl.int64)
    num_partitions = tl.num_programs(1).to(tl.int64)
    first_block, rows, block_valid = program_blocks(blocks_per_partition, BLOCKS_PER_PROGRAM)
    byte_base, byte_local, byte_mask = tile(first_block, rows, partition_bytes, BLOCK_SIZE // 2,
                                            BLOCK_PAD // 2, BLOCKS_PER_PROGRAM)
    src_ptrs = src_ptr + byte_base + byte_local
    scale_ptrs = src_scale_ptr + first_block + rows
    dst_part = (partition % devices_per_node) * nodes + partition // devices_per_node
    dst_scale_ptrs = dst_scale_ptr + first_block + rows + partition_offset(
        dst_part, dst_row_parts, dst_scale_row_stride, blocks_per_partition)
    for j in tl.static_range(NUM_INPUTS):
        index = j * num_partitions + partition
        low_j, high_j = _dequantize_nibbles(
            src_ptrs + partition_offset(index, src_row_parts, src_row_stride, partition_bytes),
            byte_mask,
            scale_ptrs + partition_offset(index, src_row_parts, src_scale_row_stride,
                                          blocks_per_partition),
            block_valid)
        if j == 0:
            low, high = low_j, high_j
        else:
            low += low_j
            high += high_j
    # One absmax reduction over both halves (|x| as int32 bits: integer max = float max).
    both = tl.maximum(abs_bits(low), abs_bits(high))
    scale, nonfinite = scale_of(tl.max(both, axis=1), 7, FULL_RANGE)
    q_low, q_high = _quantize_pair(low, high, scale, nonfinite, 7, FULL_RANGE)
    tl.store(dst_scale_ptrs, tl.where(nonfinite, float("nan"), scale), mask=block_valid)
    packed = (q_low & 15) | ((q_high & 15) << 4)
    dst = dst_ptr + (partition_offset(dst_part, dst_row_parts, dst_row_stride, partition_bytes)
                     + byte_base)
    tl.store(dst + byte_local, packed.to(tl.uint8), mask=byte_mask)


@triton.jit
def _nibble_value(half, K: tl.constexpr):
    """fp32 q of nibble K (< 4) of a _dequantize_words half, without a conversion instruction:
    the half holds 2^23's exponent bits above its 4 nibbles, each nibble as q + 8, so one AND
    leaves the fp32 2^23 + 16^K (q + 8), and one exact fma takes it back to q."""
    bits = half & (0x4B000000 | (15 << (4 * K)))
    return tl.fma(bits.to(tl.float32, bitcast=True), 0.0625 ** K,
                  -(8388608.0 * 0.0625 ** K + 8.0))


@triton.jit
def _dequantize_words(words, scale):
    """int4 words (8 nibbles, elements 8i .. 8i+7 of the block, element 8i in the low nibble)
    -> those 8 elements as fp32 q * scale, 8 tensors shaped like `words`. Per word: one XOR
    turns every two's-complement nibble q into q + 8, and each 16-bit half gets 2^23's exponent
    bits; then each element costs an AND, an fma and the scale's multiply."""
    offset = words ^ -2004318072  # 0x88888888
    low = (offset & 0xFFFF) | 0x4B000000
    high = ((offset >> 16) & 0xFFFF) | 0x4B000000
    return (_nibble_value(low, 0) * scale, _nibble_value(low, 1) * scale,
            _nibble_value(low, 2) * scale, _nibble_value(low, 3) * scale,
            _nibble_value(high, 0) * scale, _nibble_value(high, 1) * scale,
            _nibble_value(high, 2) * scale, _nibble_value(high, 3) * scale)


@triton.jit
def _requantize_int4_words_kernel(src_ptr, src_scale_ptr, dst_ptr, dst_scale_ptr,
                                  partition_numel, partition_bytes, blocks_per_partition,
                                  src_row_parts, src_row_stride, src_scale_row_stride,
                                  dst_row_parts, dst_row_stride, dst_scale_row_stride,
                                  nodes, devices_per_node, NUM_INPUTS: tl.constexpr,
                                  BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
                                  BLOCKS_PER_PROGRAM: tl.constexpr, FULL_RANGE: tl.constexpr):
    """_requantize_int4_kernel on int32 words (8 elements each; every partition and row 4-byte
    aligned): 8 sums per word, element 8i + k in sums[k], decoded without conversion
    instructions (_nibble_value) and packed back into words. The same sums and q."""
    partition = tl.program_id(1).to(tl.int64)
    num_partitions = tl.num_programs(1).to(tl.int64)
    first_block, rows, block_valid = program_blocks(blocks_per_partition, BLOCKS_PER_PROGRAM)
    byte_base = first_block.to(tl.int64) * (BLOCK_SIZE // 2)
    scale_ptrs = src_scale_ptr + first_block + rows
    dst_part = (partition % devices_per_node) * nodes + partition // devices_per_node
    dst_scale_ptrs = dst_scale_ptr + first_block + rows + partition_offset(
        dst_part, dst_row_parts, dst_scale_row_stride, blocks_per_partition)
    word_base, word_local, word_mask = tile(first_block, rows, partition_bytes // 4,
                                            BLOCK_SIZE // 8, BLOCK_PAD // 8, BLOCKS_PER_PROGRAM)
    src_words = src_ptr.to(tl.pointer_type(tl.int32)) + word_base + word_local
    for j in tl.static_range(NUM_INPUTS):
        index = j * num_partitions + partition
        words = tl.load(src_words + partition_offset(index, src_row_parts, src_row_stride,
                                                     partition_bytes) // 4,
                        mask=word_mask, other=0)
        scale = tl.load(scale_ptrs + partition_offset(index, src_row_parts,
                                                      src_scale_row_stride,
                                                      blocks_per_partition),
                        mask=block_valid, other=0.0)[:, None]
        v0, v1, v2, v3, v4, v5, v6, v7 = _dequantize_words(words, scale)
        if j == 0:
            s0, s1, s2, s3, s4, s5, s6, s7 = v0, v1, v2, v3, v4, v5, v6, v7
        else:
            s0 += v0
            s1 += v1
            s2 += v2
            s3 += v3
            s4 += v4
            s5 += v5
            s6 += v6
            s7 += v7
    both = tl.maximum(tl.maximum(tl.maximum(abs_bits(s0), abs_bits(s1)),
                                 tl.maximum(abs_bits(s2), abs_bits(s3))),
                      tl.maximum(tl.maximum(abs_bits(s4), abs_bits(s5)),
                                 tl.maximum(abs_bits(s6), abs_bits(s7))))
    scale, nonfinite = scale_of(tl.max(both, axis=1), 7, FULL_RANGE)
    q0, q1 = _quantize_pair(s0, s1, scale, nonfinite, 7, FULL_RANGE)
    q2, q3 = _quantize_pair(s2, s3, scale, nonfinite, 7, FULL_RANGE)
    q4, q5 = _quantize_pair(s4, s5, scale, nonfinite, 7, FULL_RANGE)
    q6, q7 = _quantize_pair(s6, s7, scale, nonfinite, 7, FULL_RANGE)
    tl.store(dst_scale_ptrs, tl.where(nonfinite, float("nan"), scale), mask=block_valid)
    packed = ((q0 & 15) | ((q1 & 15) << 4) | ((q2 & 15) << 8) | ((q3 & 15) << 12)
              | ((q4 & 15) << 16) | ((q5 & 15) << 20) | ((q6 & 15) << 24) | (q7 << 28))
    dst = dst_ptr.to(tl.pointer_type(tl.int32)) + (
        partition_offset(dst_part, dst_row_parts, dst_row_stride, partition_bytes)
        + byte_base) // 4
    tl.store(dst + word_local, packed, mask=word_mask)


def _launch(q: Tensor, scales: Tensor, src_rows: Rows, q_out: Tensor, s_out: Tensor,
            dst_rows: Rows, *, num_inputs: int, partitions: int, partition_numel: int,
            block_size: int, bits_in: int, bits_out: int, full_range: bool,
            variant: Variant) -> None:
    """One launch over `partitions` partitions of each of the num_inputs inputs (q, scales)
    laid out as `src_rows`, into (q_out, s_out) laid out as `dst_rows`; grid (program blocks,
    partitions)."""
    block_pad, blocks_per_program, blocks_per_partition, grid, num_warps = launch_shape(
        block_size, partition_numel, partitions, bits_in, bits_out, variant)
    args = (q, scales, q_out, s_out, partition_numel, (partition_numel + 1) // 2,
            blocks_per_partition, *src_rows, *dst_rows, 1, partitions)  # output partition p
    meta = dict(NUM_INPUTS=num_inputs, BLOCK_SIZE=block_size, BLOCK_PAD=block_pad,
                BLOCKS_PER_PROGRAM=blocks_per_program, FULL_RANGE=full_range,
                num_warps=num_warps, enable_fp_fusion=False)  # no FMA: bit-identical
    with on_device(q):
        if bits_in != 4 or bits_out != 4:
            _requantize_kernel[grid](*args, BITS_IN=bits_in, BITS_OUT=bits_out,
                                     NARROW_STORE=variant.narrow_store and bits_out == 4
                                     and block_pad >= 2048, **meta)
        elif (variant.words and block_size % 8 == 0 and partition_numel % 8 == 0
              and src_rows.stride % 4 == 0 and dst_rows.stride % 4 == 0
              and q.data_ptr() % 4 == 0 and q_out.data_ptr() % 4 == 0):
            _requantize_int4_words_kernel[grid](*args, **meta)
        else:
            _requantize_int4_kernel[grid](*args, **meta)


@torch.no_grad()
def dequantize_reduce_quantize(q: Tensor, scales: Tensor, num_inputs: int, bits_in: int,
                               bits_out: int, block_size: int, partition_numel: int, *,
                               out: tuple[Tensor, Tensor] | None = None,
                               force_triton: bool = False, full_range: bool = False,
                               variant: Variant = BEST) -> tuple[Tensor, Tensor]:
    """qgZ step 3, one fused launch: q holds num_inputs stacked inputs, each of the same number
    S of quantized `partition_numel`-element partitions. Partition s of the result is
    quantize(sum over inputs j of dequantize(input j, partition s)), the sum in fp32 in input
    order. Returns (q, scales) of S partitions at bits_out.

    (q, scales) and `out` are flat, or PayloadLayout views (partitions in row order; e.g. the
    rows of a received payload, one input per row, read in place).
    """
    check_scheme(bits_in, block_size)
    check_scheme(bits_out, block_size)
    per_input, src_rows = reduce_shape(q, scales, num_inputs, partition_numel, bits_in,
                                       block_size)
    q_out, s_out, dst_rows = quantized_outputs(out, per_input, partition_numel, bits_out,
                                               block_size, q)
    if not use_triton(q, force_triton):
        q_ref, s_ref = dequantize_reduce_quantize_reference(q, scales, num_inputs, bits_in,
                                                            bits_out, block_size, partition_numel,
                                                            full_range)
        return fill(q_out, q_ref), fill(s_out, s_ref)
    _launch(q, scales, src_rows, q_out, s_out, dst_rows, num_inputs=num_inputs,
            partitions=per_input, partition_numel=partition_numel, block_size=block_size,
            bits_in=bits_in, bits_out=bits_out, full_range=full_range, variant=variant)
    return q_out, s_out


# --- torch reference (CPU tensors run it; the tests' oracle) -----------------------------------

def dequantize_reduce_quantize_reference(q: Tensor, scales: Tensor, num_inputs: int,
                                         bits_in: int, bits_out: int, block_size: int,
                                         partition_numel: int,
                                         full_range: bool = False) -> tuple[Tensor, Tensor]:
    """dequantize_reduce_quantize() in torch ops."""
    check_scheme(bits_in, block_size)
    check_scheme(bits_out, block_size)
    total = sum_dequantized_reference(q, scales, num_inputs, bits_in, block_size,
                                      partition_numel)
    q_out, s_out = quantize_partitions(total, bits_out, block_size, full_range)
    return q_out.reshape(-1), s_out.reshape(-1)
