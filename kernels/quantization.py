"""Block-wise symmetric int8 / int4 quantization for ZeRO++ (qwZ weights, qgZ gradients).

The scheme (fixed; every op here, kernel or reference, gives bit-identical results):
- The flat input is cut into blocks of `block_size` elements (default 2048; 1..16384, even for
  int4); a trailing partial block has its own scale.
- scale = absmax(block) / qmax in fp32 (IEEE division), qmax = 2^(bits-1) - 1 (127 or 7).
  A block whose scale is 0 (all zeros, or an absmax so small that absmax / qmax underflows fp32)
  gets scale 1, so its elements quantize to 0.
- q = round_half_to_even(x / scale), the division in fp32 (IEEE), clamped to [-qmax, qmax].
  dequantize gives q * scale (fp32, one rounding), cast to the requested dtype; so
  |dequantize(quantize(x)) - x| <= scale / 2 per element (plus the output dtype's rounding).
- `full_range=True` (opt-in; quantize, swizzled_quantize, dequantize_reduce_quantize): every
  two's-complement level, as DeepSpeed's symmetric quantizer: scale = absmax / (qmax + 1) and
  q clamped to [-qmax - 1, qmax] (so a block's positive maximum is clipped to qmax: error up to
  one scale there, a half elsewhere). A step 0.8% (int8) or 12.5% (int4) finer than the default
  scheme; dequantize is the same q * scale.
- Storage: int8 data as torch.int8, one per element. int4 data as torch.uint8, two per byte:
  element 2i in the low nibble, element 2i+1 in the high nibble, each a two's-complement nibble;
  an odd element count pads the last high nibble with 0. Scales: torch.float32, one per block.
- NaN / Inf: a block holding any NaN or +-Inf gets scale NaN and all-zero q; dequantize then
  makes that whole block NaN, so non-finite values propagate and are never silently clipped.
  Finding them costs no pass over the data: `torch.isnan(scales).any()` (scales are
  numel / block_size values). dequantize_reduce_quantize marks a block whose fp32 sum is not
  finite (a NaN input block, or overflow) the same way; dequantize_reduce returns such sums
  as they are (NaN, +-Inf).

Partitions. swizzled_quantize and the reduce ops work on `partition_numel`-element partitions,
each quantized on its own as above (its blocks restart at the partition start; for int4 it takes
ceil(partition_numel / 2) bytes). When partition_numel is a multiple of block_size (int4: and
even), a buffer of several partitions is exactly the quantization of their concatenation.
`quantized_size(numel, bits, block_size)` gives (q elements, scale elements) of one partition.

qgZ, the hierarchical reduce-scatter these ops serve (N = world * P gradient elements; rank
r = node * devices_per_node + local; `nodes` nodes of `devices_per_node` ranks):
1. q, s = swizzled_quantize(grad, bits, block_size, nodes, devices_per_node): partition p of
   grad (elements p*P .. p*P+P-1, the reduce-scatter partition of rank p) is written at output
   position (p % devices_per_node) * nodes + p // devices_per_node. So the output holds, for
   each local index d in order, the `nodes` partitions of the ranks (0, d), (1, d), ... .
   (DeepSpeed's swizzle: with 2 nodes x 4, partitions 0..7 come out as 0 4 1 5 2 6 3 7.)
2. Intra-node all_to_all_single of q (and s) in devices_per_node equal pieces: local rank d
   receives [devices_per_node sources][nodes][P], the partitions of ranks (*, d).
3. dequantize_reduce_quantize(q, s, devices_per_node, bits, bits, block_size, P): sums over the
   sources, giving `nodes` partitions, partition n = the node's sum for rank (n, d).
4. Inter-node all_to_all_single (ranks sharing local index d) in `nodes` pieces: rank (n, d)
   receives [nodes sources][P], each node's partial sum of its own partition.
5. dequantize_reduce(q, s, nodes, bits, block_size, P, multiplier=1 / world): the mean over all
   ranks of partition r, what reduce_scatter(grad, op=AVG) gives, up to quantization error.

Dispatch: a CUDA tensor runs the Triton kernel (one launch per op over the whole buffer); a CPU
tensor runs the torch reference (`*_reference`, in quantization_reference.py, bit-identical,
the tests' oracle), unless `force_triton=True`, which runs the same Triton kernel on CPU under
Triton's interpreter; that needs TRITON_INTERPRET=1 set before triton is first imported in the
process (tests: small inputs). No op records autograd history; all work on the current CUDA
stream. `variant` (`Variant`) picks between code paths that give the same bits; the default is
the fastest measured.

Row layouts (zero-copy collectives). Quantized inputs and `out=` buffers are flat and
contiguous, or [rows, ...] views whose rows are contiguous and any stride apart, each row
holding the same number of whole partitions, taken in row order. PayloadLayout describes one
collective's uint8 buffer [rows, row_bytes], row i = [q of its partitions | their fp32 scales],
each section padded to 16 bytes, and its views(): quantize / swizzled_quantize write into a
send buffer's rows and the reduce ops read a receive buffer's rows in place, in the same single
launch (the kernel finds partition k at (k // per row) * row stride + (k % per row) * its size).
"""

# No `from __future__ import annotations`: Triton reads the kernel's `tl.constexpr` annotations.
import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import Tensor

from megadomino.kernels.quantization_reference import (
    MAX_BLOCK_SIZE,
    check_scheme,
    dequantize_reduce_quantize_reference,
    dequantize_reduce_reference,
    dequantize_reference,
    quantize_reference,
    quantized_size,
    swizzled_quantize_reference,
)

__all__ = [
    "MAX_BLOCK_SIZE", "PayloadLayout", "dequantize", "dequantize_reduce",
    "dequantize_reduce_quantize", "dequantize_reduce_quantize_reference",
    "dequantize_reduce_reference", "dequantize_reference", "quantize", "quantize_reference",
    "quantized_size", "swizzled_quantize", "swizzled_quantize_reference",
]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references run, the kernel is never launched
    triton = SimpleNamespace(jit=lambda fn: fn)
    tl = SimpleNamespace(constexpr=lambda value: value)
    HAS_TRITON = False
else:
    HAS_TRITON = True

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLT_MAX_BITS = tl.constexpr(0x7F7FFFFF)
# Adding 1.5 * 2^23 to |y| < 2^22 leaves round_half_to_even(y) in the low mantissa bits.
_ROUND_MAGIC = tl.constexpr(12582912.0)
# Below this scale the kernel's fma residual may underflow; it divides instead (rare tiles).
_FAST_DIVISION_MIN_SCALE = tl.constexpr(2.0**-96)
_TINY_SCALE_FACTOR = tl.constexpr(2.0**64)  # brings every positive fp32 scale above 2^-96


@triton.jit
def _dequantize_tile(q_ptrs, q_mask, scale_ptrs, scale_mask, BITS: tl.constexpr):
    """fp32 (blocks, BLOCK_PAD): q * scale; q_ptrs address bytes, two elements each, at int4."""
    scale = tl.load(scale_ptrs, mask=scale_mask, other=0.0)
    if BITS == 8:
        q = tl.load(q_ptrs, mask=q_mask, other=0).to(tl.float32)
    else:
        packed = tl.load(q_ptrs, mask=q_mask, other=0).to(tl.int32)
        low = ((packed & 15) ^ 8) - 8  # sign-extend the nibbles
        high = ((packed >> 4) ^ 8) - 8
        q = tl.interleave(low, high).to(tl.float32)
    return q * scale[:, None]


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
def _abs_bits(values):
    """|values| as int32 bits (integer order is float order there, NaN above Inf)."""
    return values.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _absmax_bits(values):
    """Per row, max over |values| as int32 bits: integer order is float order there, with NaN
    above Inf above every finite value, so one integer max also finds NaN / Inf."""
    return tl.max(_abs_bits(values), axis=1)


@triton.jit
def _scale_of(absmax_bits, QMAX: tl.constexpr, FULL_RANGE: tl.constexpr = False):
    """(scale, nonfinite) per block from _absmax_bits: absmax / qmax (FULL_RANGE: absmax /
    (qmax + 1), DeepSpeed's step), 1 for a zero scale."""
    nonfinite = absmax_bits > _FLT_MAX_BITS
    absmax = absmax_bits.to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(absmax, (QMAX + FULL_RANGE) * 1.0)
    return tl.where(scale == 0.0, 1.0, scale), nonfinite


@triton.jit
def _clamp(ratio, QMAX: tl.constexpr, FULL_RANGE: tl.constexpr):
    """ratio clamped to [-qmax, qmax] (FULL_RANGE: [-qmax - 1, qmax])."""
    return tl.minimum(tl.maximum(ratio, -(QMAX + FULL_RANGE) * 1.0), QMAX * 1.0)


@triton.jit
def _ratio_exact(values, scale, QMAX: tl.constexpr, FULL_RANGE: tl.constexpr = False):
    """values / scale, IEEE division, clamped (tiny scales; _clamp)."""
    ratio = tl.math.div_rn(values, scale[:, None])
    return _clamp(ratio, QMAX, FULL_RANGE)


@triton.jit
def _ratio_fast(values, scale, inverse):
    """values / scale from the block's reciprocal and one fma residual, 3 ops per element
    instead of a division; equal to the IEEE quotient (checked on 8e7 pairs, near-ties
    included, for scales >= 2^-96; the tests compare with the reference's division). With a
    normal scale |ratio| <= qmax (+ an ulp), so no clamp."""
    ratio = values * inverse
    return tl.fma(tl.fma(-scale[:, None], ratio, values), inverse, ratio)


@triton.jit
def _ratio_branchless(values, scale, QMAX: tl.constexpr, FULL_RANGE: tl.constexpr = False):
    """values / scale (the IEEE quotient) as _quantize_values gives it, without its branch on
    tiny scales: a block whose scale is below 2^-96 (where _ratio_fast's residual could
    underflow) has its values and scale multiplied by 2^64 first (exact: its values are below
    7 * 2^-96; the quotient is unchanged), and every ratio is clamped to +-qmax (a subnormal
    scale is absmax / qmax rounded to few bits, so the quotient may pass qmax). 3 more ops an
    element, but no elementwise IEEE division in the code: 64 registers instead of 90 in the
    looping quantize, so that 3 of its programs fit on an SM (BENCHMARKS.md)."""
    factor = tl.where(scale < _FAST_DIVISION_MIN_SCALE, _TINY_SCALE_FACTOR, 1.0)
    scaled = scale * factor
    ratio = _ratio_fast(values * factor[:, None], scaled, tl.math.div_rn(1.0, scaled)[:, None])
    return _clamp(ratio, QMAX, FULL_RANGE)


@triton.jit
def _rounded_bits(ratio, nonfinite):
    """round_half_to_even(ratio) in the low bits of an int32 (two's complement); 0 where the
    block is non-finite."""
    bits = (ratio + _ROUND_MAGIC).to(tl.int32, bitcast=True)
    return tl.where(nonfinite[:, None], 0, bits)


@triton.jit
def _quantize_values(values, scale, nonfinite, QMAX: tl.constexpr,
                     BRANCHLESS: tl.constexpr = False, FULL_RANGE: tl.constexpr = False):
    """fp32 (blocks, n) with per-block scale -> int32 whose low byte / nibble is q.
    BRANCHLESS: _ratio_branchless (fewer registers, more instructions). FULL_RANGE: the scale
    is absmax / (qmax + 1), so the block's positive maximum is clamped to qmax."""
    if BRANCHLESS:
        ratio = _ratio_branchless(values, scale, QMAX, FULL_RANGE)
    elif tl.min(scale) < _FAST_DIVISION_MIN_SCALE:  # rare: the fast residual could underflow
        ratio = _ratio_exact(values, scale, QMAX, FULL_RANGE)
    else:
        ratio = _ratio_fast(values, scale, tl.math.div_rn(1.0, scale)[:, None])
        if FULL_RANGE:
            ratio = tl.minimum(ratio, QMAX * 1.0)
    return _rounded_bits(ratio, nonfinite)


@triton.jit
def _quantize_pair(low, high, scale, nonfinite, QMAX: tl.constexpr,
                   FULL_RANGE: tl.constexpr = False):
    """_quantize_values of two tiles sharing the blocks' scales (the even and the odd elements
    of int4 -> int4), with one fast-path decision and one reciprocal for both."""
    if tl.min(scale) < _FAST_DIVISION_MIN_SCALE:
        ratio_low = _ratio_exact(low, scale, QMAX, FULL_RANGE)
        ratio_high = _ratio_exact(high, scale, QMAX, FULL_RANGE)
    else:
        inverse = tl.math.div_rn(1.0, scale)[:, None]
        ratio_low = _ratio_fast(low, scale, inverse)
        ratio_high = _ratio_fast(high, scale, inverse)
        if FULL_RANGE:
            ratio_low = tl.minimum(ratio_low, QMAX * 1.0)
            ratio_high = tl.minimum(ratio_high, QMAX * 1.0)
    return _rounded_bits(ratio_low, nonfinite), _rounded_bits(ratio_high, nonfinite)


@triton.jit
def _quantize_tile(values, QMAX: tl.constexpr, BRANCHLESS: tl.constexpr = False,
                   FULL_RANGE: tl.constexpr = False):
    """(blocks, BLOCK_PAD) floats -> (int32 whose low byte / nibble is q, the blocks' scales).
    16-bit inputs stay in their dtype for the absmax, taken over their bit patterns (|x| as
    int16: integer order is float order there, NaN above Inf), and become fp32 only to be
    quantized: bf16 quantize at g256 measured 6% faster so (BENCHMARKS.md)."""
    if values.dtype.primitive_bitwidth == 16:
        bits = values.to(tl.int16, bitcast=True) & 0x7FFF
        absmax = tl.max(bits, axis=1).to(tl.int16).to(values.dtype, bitcast=True)
        absmax_bits = absmax.to(tl.float32).to(tl.int32, bitcast=True)
    else:
        absmax_bits = _absmax_bits(values)
    scale, nonfinite = _scale_of(absmax_bits, QMAX, FULL_RANGE)
    return (_quantize_values(values.to(tl.float32), scale, nonfinite, QMAX, BRANCHLESS,
                             FULL_RANGE),
            tl.where(nonfinite, float("nan"), scale))


@triton.jit
def _partition_offset(index, row_parts, row_stride, partition_size):
    """Offset of partition `index` in a buffer of rows of `row_parts` partitions each, rows
    `row_stride` apart, partitions `partition_size` apart inside a row (see _Rows)."""
    return (index // row_parts) * row_stride + (index % row_parts) * partition_size


@triton.jit
def _store_quantized(q, scale, dst, dst_scale_ptrs, block_valid, local, mask, byte_local,
                     byte_mask, BITS_OUT: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
                     BLOCK_PAD: tl.constexpr, NARROW_STORE: tl.constexpr):
    """Store _quantize_tile's (q, scale) of (BLOCKS_PER_PROGRAM, BLOCK_PAD) elements: scales
    at dst_scale_ptrs, q at `dst` (the program's first element, int8; or byte, int4) plus
    `local` (int8) / `byte_local` (int4, two elements a byte)."""
    tl.store(dst_scale_ptrs, scale, mask=block_valid)
    if BITS_OUT == 8:
        if NARROW_STORE:  # offsets provably contiguous in runs of 8 only: 8-byte stores
            local = (local // 8) * 8 + local % 8
        tl.store(dst + local, q.to(tl.int8), mask=mask)  # keeps the low byte
    else:
        low, high = tl.split(tl.reshape(q, [BLOCKS_PER_PROGRAM, BLOCK_PAD // 2, 2]))
        packed = (low & 15) | ((high & 15) << 4)
        if NARROW_STORE:
            byte_local = (byte_local // 4) * 4 + byte_local % 4
        tl.store(dst + byte_local, packed.to(tl.uint8), mask=byte_mask)


@triton.jit
def _quantize_stream(src, dst, dst_scale_ptr, partition_numel, partition_bytes,
                     BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr, BITS_OUT: tl.constexpr,
                     NARROW_STORE: tl.constexpr, BRANCHLESS: tl.constexpr,
                     FULL_RANGE: tl.constexpr):
    """Quantize blocks program_id(0), + num_programs(0), ... of one partition (src, dst and
    dst_scale_ptr at its start), one block per iteration, loading the next block before
    quantizing this one: large blocks fit few programs on an SM, and this keeps their loads in
    flight across each block's absmax."""
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
        q, scale = _quantize_tile(x, (1 << (BITS_OUT - 1)) - 1, BRANCHLESS, FULL_RANGE)
        mask = (cols < BLOCK_SIZE) & (cols < partition_numel - base)
        byte_mask = (byte_cols < BLOCK_SIZE // 2) & (byte_cols < partition_bytes - base // 2)
        _store_quantized(q, scale, dst + (base if BITS_OUT == 8 else base // 2),
                         dst_scale_ptr + block + tl.arange(0, 1), tl.arange(0, 1) < 1, cols,
                         mask, byte_cols, byte_mask, BITS_OUT, 1, BLOCK_PAD, NARROW_STORE)
        x = x_next


@triton.jit
def _block_quant_kernel(src_ptr, src_scale_ptr, dst_ptr, dst_scale_ptr,
                        partition_numel, partition_bytes, blocks_per_partition,
                        src_row_parts, src_row_stride, src_scale_row_stride,
                        dst_row_parts, dst_row_stride, dst_scale_row_stride,
                        nodes, devices_per_node, multiplier, NUM_INPUTS: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
                        BLOCKS_PER_PROGRAM: tl.constexpr, BITS_IN: tl.constexpr,
                        BITS_OUT: tl.constexpr, SCALE_OUTPUT: tl.constexpr,
                        WORDS: tl.constexpr, STREAM: tl.constexpr,
                        NARROW_STORE: tl.constexpr, BRANCHLESS: tl.constexpr,
                        FULL_RANGE: tl.constexpr):
    """One program: BLOCKS_PER_PROGRAM consecutive blocks of partition p = program_id(1).

    Input: BITS_IN == 0 reads floats (partition p); otherwise it sums NUM_INPUTS quantized inputs
    in order, input j's partition p being source partition j * partitions + p (unrolled: loads of
    several inputs can be in flight together). Output: BITS_OUT == 0 writes floats (times
    `multiplier` if SCALE_OUTPUT) to partition p; otherwise it quantizes, to partition
    (p % devices_per_node) * nodes + p // devices_per_node. Source and destination partitions
    (and their scales) are found by _partition_offset from the src_* / dst_* row layouts.
    """
    pid_block = tl.program_id(0)
    partition = tl.program_id(1).to(tl.int64)
    num_partitions = tl.num_programs(1).to(tl.int64)
    if STREAM:  # floats in blocks of BLOCK_PAD >= 8192, one block per program
        dst_part = (partition % devices_per_node) * nodes + partition // devices_per_node
        _quantize_stream(
            src_ptr + _partition_offset(partition, src_row_parts, src_row_stride,
                                        partition_numel),
            dst_ptr + _partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                        partition_numel if BITS_OUT == 8 else partition_bytes),
            dst_scale_ptr + _partition_offset(dst_part, dst_row_parts, dst_scale_row_stride,
                                              blocks_per_partition),
            partition_numel, partition_bytes, BLOCK_SIZE, BLOCK_PAD, BITS_OUT, NARROW_STORE,
            BRANCHLESS, FULL_RANGE)
        return
    rows = tl.arange(0, BLOCKS_PER_PROGRAM)
    first_block = pid_block * BLOCKS_PER_PROGRAM
    block_valid = first_block + rows < blocks_per_partition
    # 64-bit bases per program; per-element offsets from them stay 32-bit.
    elem_base = first_block.to(tl.int64) * BLOCK_SIZE
    elems_left = tl.minimum(partition_numel - elem_base, BLOCKS_PER_PROGRAM * BLOCK_SIZE)
    cols = tl.arange(0, BLOCK_PAD)
    local = rows[:, None] * BLOCK_SIZE + cols[None, :]  # (blocks, BLOCK_PAD) elements
    mask = (cols[None, :] < BLOCK_SIZE) & (local < elems_left.to(tl.int32))
    # int4: partition_bytes = ceil(partition_numel / 2), an argument so that Triton sees its
    # divisibility and vectorizes the masked byte accesses.
    byte_base = first_block.to(tl.int64) * (BLOCK_SIZE // 2)
    byte_cols = tl.arange(0, BLOCK_PAD // 2)
    byte_local = rows[:, None] * (BLOCK_SIZE // 2) + byte_cols[None, :]  # (blocks, BLOCK_PAD/2)
    bytes_left = tl.minimum(partition_bytes - byte_base, BLOCKS_PER_PROGRAM * (BLOCK_SIZE // 2))
    byte_mask = (byte_cols[None, :] < BLOCK_SIZE // 2) & (byte_local < bytes_left.to(tl.int32))
    # Pointers into partition 0; each input adds its partition's offset (a scalar).
    if BITS_IN == 4:
        src_ptrs = src_ptr + byte_base + byte_local
        src_mask = byte_mask
        src_size = partition_bytes
    else:
        src_ptrs = src_ptr + elem_base + local
        src_mask = mask
        src_size = partition_numel
    scale_ptrs = src_scale_ptr + first_block + rows

    dst_part = (partition % devices_per_node) * nodes + partition // devices_per_node
    dst_scale_ptrs = dst_scale_ptr + first_block + rows + _partition_offset(
        dst_part, dst_row_parts, dst_scale_row_stride, blocks_per_partition)
    if BITS_IN == 4 and BITS_OUT == 4 and WORDS:
        # int4 -> int4 on int32 words (8 elements each; every partition and row 4-byte
        # aligned): 8 sums per word, element 8i + k in sums[k], decoded without conversion
        # instructions (_nibble_value) and packed back into words. Same sums and q as below.
        word_cols = tl.arange(0, BLOCK_PAD // 8)
        word_local = rows[:, None] * (BLOCK_SIZE // 8) + word_cols[None, :]
        word_base = first_block.to(tl.int64) * (BLOCK_SIZE // 8)
        words_left = tl.minimum(partition_bytes // 4 - word_base,
                                BLOCKS_PER_PROGRAM * (BLOCK_SIZE // 8))
        word_mask = (word_cols[None, :] < BLOCK_SIZE // 8) & (word_local < words_left.to(tl.int32))
        src_words = src_ptr.to(tl.pointer_type(tl.int32)) + word_base + word_local
        for j in tl.static_range(NUM_INPUTS):
            index = j * num_partitions + partition
            words = tl.load(src_words + _partition_offset(index, src_row_parts, src_row_stride,
                                                          partition_bytes) // 4,
                            mask=word_mask, other=0)
            scale = tl.load(scale_ptrs + _partition_offset(index, src_row_parts,
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
        both = tl.maximum(tl.maximum(tl.maximum(_abs_bits(s0), _abs_bits(s1)),
                                     tl.maximum(_abs_bits(s2), _abs_bits(s3))),
                          tl.maximum(tl.maximum(_abs_bits(s4), _abs_bits(s5)),
                                     tl.maximum(_abs_bits(s6), _abs_bits(s7))))
        scale, nonfinite = _scale_of(tl.max(both, axis=1), 7, FULL_RANGE)
        q0, q1 = _quantize_pair(s0, s1, scale, nonfinite, 7, FULL_RANGE)
        q2, q3 = _quantize_pair(s2, s3, scale, nonfinite, 7, FULL_RANGE)
        q4, q5 = _quantize_pair(s4, s5, scale, nonfinite, 7, FULL_RANGE)
        q6, q7 = _quantize_pair(s6, s7, scale, nonfinite, 7, FULL_RANGE)
        tl.store(dst_scale_ptrs, tl.where(nonfinite, float("nan"), scale), mask=block_valid)
        packed = ((q0 & 15) | ((q1 & 15) << 4) | ((q2 & 15) << 8) | ((q3 & 15) << 12)
                  | ((q4 & 15) << 16) | ((q5 & 15) << 20) | ((q6 & 15) << 24) | (q7 << 28))
        dst = dst_ptr.to(tl.pointer_type(tl.int32)) + (
            _partition_offset(dst_part, dst_row_parts, dst_row_stride, partition_bytes)
            + byte_base) // 4
        tl.store(dst + word_local, packed, mask=word_mask)
        return

    if BITS_IN == 4 and BITS_OUT == 4:
        # int4 -> int4 (qgZ's intra-node reduce): the even (low-nibble) and odd (high-nibble)
        # elements are summed and quantized apart, sharing each block's absmax, and packed
        # back; no interleave / split shuffles. The same sums and q as the general path.
        for j in tl.static_range(NUM_INPUTS):
            index = j * num_partitions + partition
            low_j, high_j = _dequantize_nibbles(
                src_ptrs + _partition_offset(index, src_row_parts, src_row_stride, src_size),
                src_mask,
                scale_ptrs + _partition_offset(index, src_row_parts, src_scale_row_stride,
                                               blocks_per_partition),
                block_valid)
            if j == 0:
                low, high = low_j, high_j
            else:
                low += low_j
                high += high_j
        # One absmax reduction over both halves (|x| as int32 bits: integer max = float max).
        both = tl.maximum(_abs_bits(low), _abs_bits(high))
        scale, nonfinite = _scale_of(tl.max(both, axis=1), 7, FULL_RANGE)
        q_low, q_high = _quantize_pair(low, high, scale, nonfinite, 7, FULL_RANGE)
        tl.store(dst_scale_ptrs, tl.where(nonfinite, float("nan"), scale), mask=block_valid)
        packed = (q_low & 15) | ((q_high & 15) << 4)
        dst = dst_ptr + (_partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                           partition_bytes) + byte_base)
        tl.store(dst + byte_local, packed.to(tl.uint8), mask=byte_mask)
        return

    if BITS_IN == 0:
        values = tl.load(src_ptrs + _partition_offset(partition, src_row_parts, src_row_stride,
                                                      src_size),
                         mask=mask, other=0.0)  # quantized from its own dtype below
    else:
        for j in tl.static_range(NUM_INPUTS):
            index = j * num_partitions + partition
            values_j = _dequantize_tile(
                src_ptrs + _partition_offset(index, src_row_parts, src_row_stride, src_size),
                src_mask,
                scale_ptrs + _partition_offset(index, src_row_parts, src_scale_row_stride,
                                               blocks_per_partition),
                block_valid, BITS_IN)
            if j == 0:
                values = values_j
            else:
                values += values_j

    if BITS_OUT == 0:
        if SCALE_OUTPUT:
            values = values * multiplier
        dst = dst_ptr + (_partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                           partition_numel) + elem_base)
        tl.store(dst + local, values.to(dst_ptr.dtype.element_ty), mask=mask)
    else:
        q, scale = _quantize_tile(values, (1 << (BITS_OUT - 1)) - 1, False, FULL_RANGE)
        if BITS_OUT == 8:
            dst = dst_ptr + (_partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                               partition_numel) + elem_base)
        else:
            dst = dst_ptr + (_partition_offset(dst_part, dst_row_parts, dst_row_stride,
                                               partition_bytes) + byte_base)
        _store_quantized(q, scale, dst, dst_scale_ptrs, block_valid, local, mask, byte_local,
                         byte_mask, BITS_OUT, BLOCKS_PER_PROGRAM, BLOCK_PAD, NARROW_STORE)


# --- launcher -----------------------------------------------------------------------------------

# Triton picks its interpreter when it is first imported (its library functions too), so CPU
# tensors can run the kernel only in a process started with TRITON_INTERPRET=1.
INTERPRETING = HAS_TRITON and not isinstance(_block_quant_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class Variant:
    """Which code path a launch takes where more than one computes the same bits. The defaults
    are the measured winners (BENCHMARKS.md, H200); the others stay because other shapes need
    them, and tests pass them to check every path against the reference on the same input."""

    words: bool = True
    """int4 -> int4 dequantize-reduce-quantize decodes int32 words where every partition and row
    is 4-byte aligned: 12% faster than the byte decode."""
    narrow_store: bool = True
    """int4 output in blocks >= 2048 is stored in 4-byte runs, the layout it is computed in,
    instead of 16-byte runs after a shared-memory layout conversion: +2% at 2048, +0.5% at
    8192 (but -4% at 256 and -0.5% for int8, so only there)."""
    stream: bool = True
    """Quantize in blocks >= 8192 by _quantize_stream: 8 warps, as many programs as fit at once
    (STREAM_PROGRAMS_PER_SM); int8 0.94x -> 0.97x DeepSpeed's rate, int4 0.90x -> 0.945x."""
    stream_int4_branchless: bool = True
    """int4 in the looping programs without the tiny-scale branch (_ratio_branchless: 64
    registers), 3 programs per SM: 3.93 -> 4.01 TB/s at g8192, 0.957x DeepSpeed's rate."""


BEST = Variant()
STREAM_PROGRAMS_PER_SM = 2
"""Looping programs per SM (at _quantize_stream's 90 registers a third program queues behind
the other two: 15% slower)."""


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: a few programs, so that they loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def _looping(block_pad: int, bits_in: int, bits_out: int, stream: bool = True) -> bool:
    """Whether a launch quantizes floats by _quantize_stream's looping programs."""
    return stream and bits_in == 0 and bits_out != 0 and block_pad >= 8192


def _default_tile(block_pad: int, bits_in: int, bits_out: int,
                  stream: bool = True) -> tuple[int, int]:
    """(elements per program, num_warps), chosen from `benchmarks/bench_quant.py --sweep`
    (fp16 and bf16) on an H200 (BENCHMARKS.md): 4096 elements (several small blocks, or one
    large block) over 4 warps, except
    - quantize floats in blocks of 8192 and more: 8 warps, looping (Variant.stream);
    - quantize floats in blocks above 4096 elements (without the loop), or to int4 in blocks of
      2048 and more: 2 warps (to int4 at 2048: one block per program, 2% over two);
    - dequantize-reduce-quantize in blocks up to 2048: a warp holds a whole block, so its
      absmax needs no cross-warp reduction; 2 warps, but 1 warp and one block per program at
      2048 (int4 +3%).
    Fewer warps with more elements each kept winning: 8 warps per 2048-element block were
    25-30% slower than 2."""
    elements = max(block_pad, 4096)
    if _looping(block_pad, bits_in, bits_out, stream):
        return block_pad, 8  # _quantize_stream's programs
    if bits_in == 0:
        if bits_out == 4 and block_pad == 2048:
            return 2048, 2
        two_warps = block_pad > 4096 or (bits_out == 4 and block_pad >= 2048)
    else:
        if bits_out != 0 and block_pad == 2048:
            return 2048, 1
        two_warps = bits_out != 0 and block_pad <= 2048
    return elements, 2 if two_warps else 4


class _Rows(NamedTuple):
    """Where a buffer's partitions lie: in rows of `parts` partitions each, contiguous inside a
    row; a row starts `stride` elements (of q, or of the floats) after the previous one, and its
    scales `scale_stride` fp32 values after the previous row's."""
    parts: int
    stride: int
    scale_stride: int


def _contiguous_rows(partition_numel: int, bits: int, block_size: int) -> _Rows:
    """A flat buffer (bits 0: floats): one partition per row, rows back to back."""
    q_numel, s_numel = quantized_size(partition_numel, bits or 8, block_size)
    return _Rows(1, q_numel, s_numel)


def _launch(src: Tensor, src_scales: Tensor | None, dst: Tensor, dst_scales: Tensor | None, *,
            num_inputs: int, num_partitions: int, partition_numel: int, block_size: int,
            bits_in: int, bits_out: int, src_rows: _Rows | None = None,
            dst_rows: _Rows | None = None, nodes: int = 1, devices_per_node: int | None = None,
            multiplier: float = 1.0, tile: tuple[int, int] | None = None,
            full_range: bool = False, variant: Variant = BEST) -> None:
    """One launch over all partitions; grid (program blocks, partitions). src / dst (and their
    scales) point at their first partition; `src_rows` / `dst_rows` give their layout (default:
    flat). `tile` overrides (elements per program, num_warps), for benchmarks."""
    block_pad = 1 << (block_size - 1).bit_length()  # next power of two (plain Python: cheaper)
    elements, num_warps = tile or _default_tile(block_pad, bits_in, bits_out, variant.stream)
    blocks_per_program = max(1, elements // block_pad)
    blocks_per_partition = math.ceil(partition_numel / block_size)
    src_rows = src_rows or _contiguous_rows(partition_numel, bits_in, block_size)
    dst_rows = dst_rows or _contiguous_rows(partition_numel, bits_out, block_size)
    grid = (-(-blocks_per_partition // blocks_per_program), num_partitions)
    stream = _looping(block_pad, bits_in, bits_out, variant.stream)
    branchless = stream and bits_out == 4 and variant.stream_int4_branchless
    if stream:  # a few programs per SM, each looping over the blocks
        per_sm = 3 if branchless else STREAM_PROGRAMS_PER_SM
        grid = (min(grid[0], max(1, per_sm * _sm_count(src.device) // num_partitions)),
                num_partitions)
    words = (variant.words and bits_in == 4 and bits_out == 4 and block_size % 8 == 0
             and partition_numel % 8 == 0 and src_rows.stride % 4 == 0
             and dst_rows.stride % 4 == 0 and src.data_ptr() % 4 == 0
             and dst.data_ptr() % 4 == 0)
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        _block_quant_kernel[grid](src, src if src_scales is None else src_scales,
                                  dst, dst if dst_scales is None else dst_scales,
                                  partition_numel, (partition_numel + 1) // 2,
                                  blocks_per_partition, *src_rows, *dst_rows,
                                  nodes, devices_per_node or num_partitions, multiplier,
                                  NUM_INPUTS=num_inputs, BLOCK_SIZE=block_size,
                                  BLOCK_PAD=block_pad,
                                  BLOCKS_PER_PROGRAM=blocks_per_program, BITS_IN=bits_in,
                                  BITS_OUT=bits_out, SCALE_OUTPUT=multiplier != 1.0,
                                  WORDS=words, STREAM=stream,
                                  NARROW_STORE=variant.narrow_store and bits_out == 4
                                  and block_pad >= 2048,
                                  BRANCHLESS=branchless, FULL_RANGE=full_range,
                                  num_warps=num_warps,
                                  enable_fp_fusion=False)  # no FMA: bit-identical to the reference


# --- payloads: quantized partitions as the rows of one collective's buffer --------------------

PAYLOAD_ALIGNMENT = 16  # bytes: q, scales and rows start 16-byte aligned (vector accesses)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


@dataclass(frozen=True)
class PayloadLayout:
    """One collective's uint8 buffer [rows, row_bytes] of quantized partitions. Row i (what a
    rank sends to, or receives from, group rank i) holds `parts` partitions of
    `partition_numel` elements: [their q | padding | their fp32 scales | padding], each section
    padded to 16 bytes. The padding is never written nor read.

    views(payload) gives (q, scales) as [rows, ...] views that every op here takes as input or
    `out=` in place, so that quantized data goes into a collective's send buffer and is reduced
    from its receive buffer without packing copies."""
    parts: int
    partition_numel: int
    bits: int
    block_size: int

    def __post_init__(self) -> None:
        check_scheme(self.bits, self.block_size)
        if self.parts < 1 or self.partition_numel < 1:
            raise ValueError(f"a payload row needs parts >= 1 and partition_numel >= 1, got "
                             f"{self.parts}, {self.partition_numel}")

    @functools.cached_property  # layouts are made per collective: compute once
    def q_numel(self) -> int:
        """q elements (= bytes) of a row's partitions."""
        return self.parts * quantized_size(self.partition_numel, self.bits, self.block_size)[0]

    @functools.cached_property
    def scales_numel(self) -> int:
        """fp32 scales of a row's partitions."""
        return self.parts * quantized_size(self.partition_numel, self.bits, self.block_size)[1]

    @functools.cached_property
    def scales_offset(self) -> int:
        """Byte offset of the scales in a row."""
        return _round_up(self.q_numel)

    @functools.cached_property
    def row_bytes(self) -> int:
        return self.scales_offset + _round_up(4 * self.scales_numel)

    def empty(self, rows: int, device: torch.device | str) -> Tensor:
        """An uninitialized payload, uint8 [rows, row_bytes]."""
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def views(self, payload: Tensor) -> tuple[Tensor, Tensor]:
        """(q [rows, q_numel] int8 (bits 8) / uint8 (bits 4), scales [rows, scales_numel] fp32),
        views into `payload` [rows, row_bytes] (contiguous uint8)."""
        if (payload.dtype != torch.uint8 or payload.dim() != 2
                or payload.shape[1] != self.row_bytes or not payload.is_contiguous()):
            raise ValueError(f"payload must be contiguous uint8 [rows, {self.row_bytes}], got "
                             f"{payload.dtype} {list(payload.shape)}")
        q = payload[:, :self.q_numel]
        start = self.scales_offset // 4
        scales = payload.view(torch.float32)[:, start:start + self.scales_numel]
        return (q.view(torch.int8) if self.bits == 8 else q), scales


# --- functional wrappers ------------------------------------------------------------------------

def _use_triton(t: Tensor, force_triton: bool) -> bool:
    if t.is_cuda:
        if HAS_TRITON:
            return True
        _warn_no_triton()
        return False
    if force_triton:
        if not INTERPRETING:
            raise RuntimeError("Triton kernels on CPU tensors need triton installed and "
                               "TRITON_INTERPRET=1 set before triton is first imported")
        return True
    return False


@functools.cache
def _warn_no_triton() -> None:
    warnings.warn("triton is not installed: CUDA tensors are quantized by the slow torch "
                  "reference", stacklevel=3)


def _check_float(x: Tensor) -> Tensor:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"expected a float32/bfloat16/float16 tensor, got {x.dtype}")
    return x.reshape(-1)


def _quantized_rows(q: Tensor, scales: Tensor, parts: int, partition_numel: int, bits: int,
                    block_size: int, what: str = "") -> _Rows:
    """Check that (q, scales) hold `parts` quantized partitions, either flat and contiguous or
    as [rows, ...] views with contiguous, non-overlapping rows (PayloadLayout.views), the same
    number of partitions in each row; returns their layout. `what` prefixes the messages."""
    q_numel, s_numel = quantized_size(partition_numel, bits, block_size)
    want = torch.int8 if bits == 8 else torch.uint8
    if q.dtype != want or q.numel() != parts * q_numel:
        raise ValueError(f"{what}q must be {parts * q_numel} {want} values for {parts} "
                         f"partition(s) of {partition_numel} at {bits} bits, got {q.numel()} "
                         f"{q.dtype}")
    if scales.dtype != torch.float32 or scales.numel() != parts * s_numel:
        raise ValueError(f"{what}scales must be {parts * s_numel} float32 values, got "
                         f"{scales.numel()} {scales.dtype}")
    if q.device != scales.device:
        raise ValueError(f"{what}q on {q.device} but scales on {scales.device}")
    if q.dim() == 1 and scales.dim() == 1 and q.is_contiguous() and scales.is_contiguous():
        return _Rows(1, q_numel, s_numel)
    if q.dim() == 2 and scales.dim() == 2 and q.shape[0] == scales.shape[0] and q_numel:
        per_row = q.shape[1] // q_numel
        rows_ok = q.shape[0] == 1 or (q.stride(0) >= q.shape[1]
                                      and scales.stride(0) >= scales.shape[1])
        if (q.shape[1] == per_row * q_numel and scales.shape[1] == per_row * s_numel
                and q.stride(1) == 1 and scales.stride(1) == 1 and rows_ok):
            return _Rows(per_row, q.stride(0), scales.stride(0))
    raise ValueError(f"{what}q and scales must be flat and contiguous, or [rows, ...] views with "
                     f"contiguous non-overlapping rows of whole partitions (PayloadLayout.views),"
                     f" got q {list(q.shape)} stride {q.stride()}, scales {list(scales.shape)} "
                     f"stride {scales.stride()}")


def _output(out: Tensor | None, numel: int, dtype: torch.dtype, like: Tensor) -> Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=like.device)
    if out.dtype != dtype or out.numel() != numel or out.device != like.device:
        raise ValueError(f"out must be {numel} {dtype} values on {like.device}, got "
                         f"{out.numel()} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out.view(-1)


def _outputs(out: tuple[Tensor, Tensor] | None, parts: int, numel: int, bits: int,
             block_size: int, like: Tensor) -> tuple[Tensor, Tensor, _Rows]:
    """(q, scales, their layout): `out` checked, or new flat buffers."""
    if out is None:
        q_numel, s_numel = quantized_size(numel, bits, block_size)
        q_dtype = torch.int8 if bits == 8 else torch.uint8
        return (torch.empty(parts * q_numel, dtype=q_dtype, device=like.device),
                torch.empty(parts * s_numel, dtype=torch.float32, device=like.device),
                _Rows(1, q_numel, s_numel))
    q, scales = out
    if q.device != like.device:
        raise ValueError(f"out must be on {like.device}, got {q.device}")
    return q, scales, _quantized_rows(q, scales, parts, numel, bits, block_size, "out ")


def _fill(out: Tensor, values: Tensor) -> Tensor:
    """The reference's flat result copied into `out` (flat or a [rows, ...] view)."""
    return out.copy_(values.view(out.shape))


@torch.no_grad()
def quantize(x: Tensor, bits: int = 8, block_size: int = 2048, *,
             out: tuple[Tensor, Tensor] | None = None, force_triton: bool = False,
             full_range: bool = False, variant: Variant = BEST) -> tuple[Tensor, Tensor]:
    """Quantize the flattened `x` (float32/bfloat16/float16, read as is; copied only if not
    contiguous) block-wise (`full_range`: see the module docstring).

    Returns (q, scales): q is int8 [numel] (bits=8) or uint8 [ceil(numel / 2)] (bits=4),
    scales float32 [ceil(numel / block_size)]. `out` = (q, scales) buffers to fill instead
    (flat, or a PayloadLayout's views of a one-row payload).
    """
    check_scheme(bits, block_size)
    x = _check_float(x)
    q, scales, rows = _outputs(out, 1, x.numel(), bits, block_size, x)
    if x.numel() == 0:
        return q, scales
    if not _use_triton(x, force_triton):
        q_ref, s_ref = quantize_reference(x, bits, block_size, full_range)
        return _fill(q, q_ref), _fill(scales, s_ref)
    _launch(x, None, q, scales, num_inputs=1, num_partitions=1, partition_numel=x.numel(),
            block_size=block_size, bits_in=0, bits_out=bits, dst_rows=rows,
            full_range=full_range, variant=variant)
    return q, scales


@torch.no_grad()
def dequantize(q: Tensor, scales: Tensor, numel: int, bits: int = 8, block_size: int = 2048,
               dtype: torch.dtype = torch.float32, *, out: Tensor | None = None,
               force_triton: bool = False) -> Tensor:
    """The `numel` values that quantize() encoded as (q, scales), as a flat `dtype` tensor."""
    check_scheme(bits, block_size)
    _quantized_rows(q, scales, 1, numel, bits, block_size)
    if numel == 0:
        return _output(out, 0, dtype, q)
    return dequantize_reduce(q, scales, 1, bits, block_size, numel, dtype, out=out,
                             force_triton=force_triton)


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
    x = _check_float(x)
    world = num_nodes * devices_per_node
    if num_nodes < 1 or devices_per_node < 1 or x.numel() % world:
        raise ValueError(f"{x.numel()} elements do not split into {num_nodes} x "
                         f"{devices_per_node} equal partitions")
    partition_numel = x.numel() // world
    q, scales, rows = _outputs(out, world, partition_numel, bits, block_size, x)
    if x.numel() == 0:
        return q, scales
    if not _use_triton(x, force_triton):
        q_ref, s_ref = swizzled_quantize_reference(x, bits, block_size, num_nodes,
                                                   devices_per_node, full_range)
        return _fill(q, q_ref), _fill(scales, s_ref)
    _launch(x, None, q, scales, num_inputs=1, num_partitions=world,
            partition_numel=partition_numel, block_size=block_size, bits_in=0, bits_out=bits,
            dst_rows=rows, nodes=num_nodes, devices_per_node=devices_per_node,
            full_range=full_range, variant=variant)
    return q, scales


def _reduce_shape(q: Tensor, scales: Tensor, num_inputs: int, partition_numel: int, bits: int,
                  block_size: int) -> tuple[int, _Rows]:
    """Validate num_inputs stacked inputs of equal partition count; returns (partitions per
    input, the inputs' layout)."""
    if num_inputs < 1 or partition_numel < 1:
        raise ValueError(f"need num_inputs >= 1 and partition_numel >= 1, got {num_inputs}, "
                         f"{partition_numel}")
    q_numel = quantized_size(partition_numel, bits, block_size)[0]
    parts = q.numel() // q_numel
    if parts % num_inputs or parts == 0:
        raise ValueError(f"{q.numel()} values of q are not {num_inputs} inputs of whole "
                         f"{partition_numel}-element partitions at {bits} bits")
    rows = _quantized_rows(q, scales, parts, partition_numel, bits, block_size)
    return parts // num_inputs, rows


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
    per_input, src_rows = _reduce_shape(q, scales, num_inputs, partition_numel, bits_in,
                                        block_size)
    q_out, s_out, dst_rows = _outputs(out, per_input, partition_numel, bits_out, block_size, q)
    if not _use_triton(q, force_triton):
        q_ref, s_ref = dequantize_reduce_quantize_reference(q, scales, num_inputs, bits_in,
                                                            bits_out, block_size, partition_numel,
                                                            full_range)
        return _fill(q_out, q_ref), _fill(s_out, s_ref)
    _launch(q, scales, q_out, s_out, num_inputs=num_inputs, num_partitions=per_input,
            partition_numel=partition_numel, block_size=block_size, bits_in=bits_in,
            bits_out=bits_out, src_rows=src_rows, dst_rows=dst_rows, full_range=full_range,
            variant=variant)
    return q_out, s_out


@torch.no_grad()
def dequantize_reduce(q: Tensor, scales: Tensor, num_inputs: int, bits: int, block_size: int,
                      partition_numel: int, dtype: torch.dtype = torch.float32,
                      multiplier: float = 1.0, *, out: Tensor | None = None,
                      force_triton: bool = False) -> Tensor:
    """qgZ step 5 (and qwZ's dequantize of the gathered rows), one launch: like
    dequantize_reduce_quantize but the fp32 sum, times `multiplier` (fp32), is returned as
    `dtype` [S * partition_numel] (`out`: flat, contiguous)."""
    check_scheme(bits, block_size)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32/bfloat16/float16, got {dtype}")
    per_input, src_rows = _reduce_shape(q, scales, num_inputs, partition_numel, bits,
                                        block_size)
    result = _output(out, per_input * partition_numel, dtype, q)
    if not _use_triton(q, force_triton):
        return result.copy_(dequantize_reduce_reference(q, scales, num_inputs, bits, block_size,
                                                        partition_numel, dtype, multiplier))
    _launch(q, scales, result, None, num_inputs=num_inputs, num_partitions=per_input,
            partition_numel=partition_numel, block_size=block_size, bits_in=bits, bits_out=0,
            src_rows=src_rows, multiplier=multiplier)
    return result
