"""Block-wise symmetric int8 / int4 quantization for ZeRO++ (qwZ weights, qgZ gradients): the
scheme, and its math that every op shares, as Triton device functions and as torch (references).

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

The torch functions below (the references' math) do the kernels' fp32 operations in the kernels'
order, so that results are bit-identical; the kernels compile with enable_fp_fusion=False, so
that no multiply and add the reference rounds apart are fused.
"""

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.
import math

import torch
from torch import Tensor

from megadomino.kernels.quant_launch import tl, triton

MAX_BLOCK_SIZE = 16384
FLT_MAX = torch.finfo(torch.float32).max
_FLT_MAX_BITS = tl.constexpr(0x7F7FFFFF)
# Adding 1.5 * 2^23 to |y| < 2^22 leaves round_half_to_even(y) in the low mantissa bits.
_ROUND_MAGIC = tl.constexpr(12582912.0)
# Below this scale the kernel's fma residual may underflow; it divides instead (rare tiles).
FAST_DIVISION_MIN_SCALE = tl.constexpr(2.0**-96)
_TINY_SCALE_FACTOR = tl.constexpr(2.0**64)  # brings every positive fp32 scale above 2^-96


def check_scheme(bits: int, block_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    if bits == 4 and block_size % 2:
        raise ValueError(f"int4 needs an even block_size (two elements per byte), got {block_size}")


def quantized_size(numel: int, bits: int, block_size: int) -> tuple[int, int]:
    """(elements of q, elements of scales) for one `numel`-element partition."""
    return (numel if bits == 8 else (numel + 1) // 2), math.ceil(numel / block_size)


# --- Triton device functions ------------------------------------------------------------------

@triton.jit
def dequantize_tile(q_ptrs, q_mask, scale_ptrs, scale_mask, BITS: tl.constexpr):
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
def abs_bits(values):
    """|values| as int32 bits (integer order is float order there, NaN above Inf)."""
    return values.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _absmax_bits(values):
    """Per row, max over |values| as int32 bits: integer order is float order there, with NaN
    above Inf above every finite value, so one integer max also finds NaN / Inf."""
    return tl.max(abs_bits(values), axis=1)


@triton.jit
def scale_of(absmax_bits, QMAX: tl.constexpr, FULL_RANGE: tl.constexpr = False):
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
def ratio_exact(values, scale, QMAX: tl.constexpr, FULL_RANGE: tl.constexpr = False):
    """values / scale, IEEE division, clamped (tiny scales; _clamp)."""
    ratio = tl.math.div_rn(values, scale[:, None])
    return _clamp(ratio, QMAX, FULL_RANGE)


@triton.jit
def ratio_fast(values, scale, inverse):
    """values / scale from the block's reciprocal and one fma residual, 3 ops per element
    instead of a division; equal to the IEEE quotient (checked on 8e7 pairs, near-ties
    included, for scales >= 2^-96; the tests compare with the reference's division). With a
    normal scale |ratio| <= qmax (+ an ulp), so no clamp."""
    ratio = values * inverse
    return tl.fma(tl.fma(-scale[:, None], ratio, values), inverse, ratio)


@triton.jit
def _ratio_branchless(values, scale, QMAX: tl.constexpr, FULL_RANGE: tl.constexpr = False):
    """values / scale (the IEEE quotient) as _quantize_values gives it, without its branch on
    tiny scales: a block whose scale is below 2^-96 (where ratio_fast's residual could
    underflow) has its values and scale multiplied by 2^64 first (exact: its values are below
    7 * 2^-96; the quotient is unchanged), and every ratio is clamped to +-qmax (a subnormal
    scale is absmax / qmax rounded to few bits, so the quotient may pass qmax). 3 more ops an
    element, but no elementwise IEEE division in the code: 64 registers instead of 90 in the
    looping quantize, so that 3 of its programs fit on an SM (BENCHMARKS.md)."""
    factor = tl.where(scale < FAST_DIVISION_MIN_SCALE, _TINY_SCALE_FACTOR, 1.0)
    scaled = scale * factor
    ratio = ratio_fast(values * factor[:, None], scaled, tl.math.div_rn(1.0, scaled)[:, None])
    return _clamp(ratio, QMAX, FULL_RANGE)


@triton.jit
def rounded_bits(ratio, nonfinite):
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
    elif tl.min(scale) < FAST_DIVISION_MIN_SCALE:  # rare: the fast residual could underflow
        ratio = ratio_exact(values, scale, QMAX, FULL_RANGE)
    else:
        ratio = ratio_fast(values, scale, tl.math.div_rn(1.0, scale)[:, None])
        if FULL_RANGE:
            ratio = tl.minimum(ratio, QMAX * 1.0)
    return rounded_bits(ratio, nonfinite)


@triton.jit
def quantize_tile(values, QMAX: tl.constexpr, BRANCHLESS: tl.constexpr = False,
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
    scale, nonfinite = scale_of(absmax_bits, QMAX, FULL_RANGE)
    return (_quantize_values(values.to(tl.float32), scale, nonfinite, QMAX, BRANCHLESS,
                             FULL_RANGE),
            tl.where(nonfinite, float("nan"), scale))


@triton.jit
def store_quantized(q, scale, dst, dst_scale_ptrs, block_valid, local, mask, byte_local,
                    byte_mask, BITS_OUT: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
                    BLOCK_PAD: tl.constexpr, NARROW_STORE: tl.constexpr):
    """Store quantize_tile's (q, scale) of (BLOCKS_PER_PROGRAM, BLOCK_PAD) elements: scales
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


# --- torch (the references' math) ---------------------------------------------------------------

def _pack_int4(q: Tensor) -> Tensor:
    """int8 (parts, n) in [-7, 7] -> uint8 (parts, ceil(n / 2)), element 2i in the low nibble."""
    q = torch.nn.functional.pad(q.to(torch.int16), (0, q.shape[1] % 2)) & 15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def _unpack_int4(packed: Tensor) -> Tensor:
    """uint8 (parts, nbytes) -> int8 (parts, 2 * nbytes), sign-extending each nibble."""
    packed = packed.to(torch.int16)
    low, high = ((packed & 15) ^ 8) - 8, ((packed >> 4) ^ 8) - 8
    return torch.stack((low, high), dim=-1).flatten(1).to(torch.int8)


def quantize_partitions(values: Tensor, bits: int, block_size: int,
                        full_range: bool = False) -> tuple[Tensor, Tensor]:
    """fp32 (parts, n) -> q (parts, q_numel), scales (parts, blocks), each row on its own.
    full_range: scale absmax / 2^(bits-1), q in [-2^(bits-1), 2^(bits-1) - 1]."""
    parts, numel = values.shape
    qmax = 2 ** (bits - 1) - 1
    qmin = -qmax - 1 if full_range else -qmax
    blocks = math.ceil(numel / block_size)
    padded = torch.nn.functional.pad(values, (0, blocks * block_size - numel))
    padded = padded.view(parts, blocks, block_size)
    magnitude = padded.abs()
    finite = magnitude <= FLT_MAX
    absmax = torch.where(finite, magnitude, math.inf).amax(dim=-1)
    scale = absmax / (qmax + 1 if full_range else qmax)
    scale = torch.where(scale == 0, 1.0, scale)
    ratio = torch.where(finite, padded, 0.0) / scale[..., None]
    q = torch.round(ratio.clamp(qmin, qmax)).to(torch.int8).view(parts, -1)[:, :numel]
    scales = torch.where(torch.isinf(absmax), math.nan, scale)
    return (q if bits == 8 else _pack_int4(q)), scales


def dequantize_partitions(q: Tensor, scales: Tensor, numel: int, bits: int,
                          block_size: int) -> Tensor:
    """q (parts, q_numel), scales (parts, blocks) -> fp32 (parts, numel)."""
    parts, blocks = scales.shape
    values = (q if bits == 8 else _unpack_int4(q))[:, :numel]
    values = torch.nn.functional.pad(values, (0, blocks * block_size - numel))
    values = values.view(parts, blocks, block_size).float() * scales[..., None]
    return values.view(parts, -1)[:, :numel]
