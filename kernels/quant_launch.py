"""How the quantization ops launch: the Triton kernel or the torch reference (`use_triton`), the
grid every kernel shares (`program_blocks`, `tile`, `partition_offset`), and which code path and
tile a launch takes (`Variant`, `default_tile`), chosen by benchmarks/bench_quant.py.

Grid: (program blocks, partitions). Program (i, p) takes BLOCKS_PER_PROGRAM consecutive blocks of
partition p, blocks i * BLOCKS_PER_PROGRAM onwards, as a (blocks, BLOCK_PAD) tile (a block of
BLOCK_SIZE elements padded to a power of two); the looping quantize (`Variant.stream`) instead
runs a few programs per partition, each looping over the blocks. A buffer's partitions lie in
rows (`Rows`): a launch passes a layout as three ints and a kernel finds partition k by
`partition_offset`.
"""

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.
import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references run, the kernels are never launched
    triton = SimpleNamespace(jit=lambda fn: fn)
    tl = SimpleNamespace(constexpr=lambda value: value)
    HAS_TRITON = False
else:
    HAS_TRITON = True


@triton.jit
def partition_offset(index, row_parts, row_stride, partition_size):
    """Offset of partition `index` in a buffer of rows of `row_parts` partitions each, rows
    `row_stride` apart, partitions `partition_size` apart inside a row (see Rows)."""
    return (index // row_parts) * row_stride + (index % row_parts) * partition_size


@triton.jit
def program_blocks(blocks_per_partition, BLOCKS_PER_PROGRAM: tl.constexpr):
    """(first block, rows = arange(BLOCKS_PER_PROGRAM), which rows are blocks of the partition)
    of this program: blocks first + rows of partition program_id(1)."""
    rows = tl.arange(0, BLOCKS_PER_PROGRAM)
    first_block = tl.program_id(0) * BLOCKS_PER_PROGRAM
    return first_block, rows, first_block + rows < blocks_per_partition


@triton.jit
def tile(first_block, rows, numel, SIZE: tl.constexpr, PAD: tl.constexpr,
         BLOCKS_PER_PROGRAM: tl.constexpr):
    """The program's blocks of a partition of `numel` items, SIZE items a block (elements; or
    bytes, int32 words of int4 data): (64-bit base of its first block, 32-bit offsets from it
    (blocks, PAD), the mask of those inside a block and the partition)."""
    base = first_block.to(tl.int64) * SIZE  # 64-bit per program; offsets from it stay 32-bit
    left = tl.minimum(numel - base, BLOCKS_PER_PROGRAM * SIZE)
    cols = tl.arange(0, PAD)
    local = rows[:, None] * SIZE + cols[None, :]  # (blocks, PAD)
    return base, local, (cols[None, :] < SIZE) & (local < left.to(tl.int32))


# Triton picks its interpreter when it is first imported (its library functions too), so CPU
# tensors can run the kernels only in a process started with TRITON_INTERPRET=1.
INTERPRETING = HAS_TRITON and not isinstance(partition_offset, triton.runtime.JITFunction)


class Rows(NamedTuple):
    """Where a buffer's partitions lie: in rows of `parts` partitions each, contiguous inside a
    row; a row starts `stride` elements (of q, or of the floats) after the previous one, and its
    scales `scale_stride` fp32 values after the previous row's."""
    parts: int
    stride: int
    scale_stride: int


def use_triton(t: Tensor, force_triton: bool, op: str = "ZeRO++ quantization") -> bool:
    """Whether `op` on `t` launches its kernel (CUDA; CPU with force_triton, interpreted) or
    runs its torch reference; a CUDA tensor without triton says so, once per op. Every kernel's
    dispatch goes through here."""
    if t.is_cuda:
        if HAS_TRITON:
            return True
        _warn_no_triton(op)
        return False
    if force_triton:
        if not INTERPRETING:
            raise RuntimeError("Triton kernels on CPU tensors need triton installed and "
                               "TRITON_INTERPRET=1 set before triton is first imported")
        return True
    return False


@functools.cache
def _warn_no_triton(op: str) -> None:
    """Once per op a process: the fallback gives the same bits, slowly, and would otherwise be
    indistinguishable from the kernel running."""
    warnings.warn(f"triton is not installed: {op} on CUDA tensors runs its slow torch "
                  "reference", stacklevel=3)


def on_device(t: Tensor) -> contextlib.AbstractContextManager:
    """Launch on `t`'s GPU whatever the current device (the interpreter: nothing to set)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


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
    """Quantize in blocks >= 8192 by the looping programs (block_quantize._quantize_loop_kernel):
    8 warps, as many programs as fit at once (STREAM_PROGRAMS_PER_SM); int8 0.94x -> 0.97x
    DeepSpeed's rate, int4 0.90x -> 0.945x."""
    stream_int4_branchless: bool = True
    """int4 in the looping programs without the tiny-scale branch (ratio_branchless: 64
    registers), 3 programs per SM: 3.93 -> 4.01 TB/s at g8192, 0.957x DeepSpeed's rate."""
    tile: tuple[int, int] | None = None
    """(elements per program, num_warps) instead of default_tile's: for
    `benchmarks/bench_quant.py --sweep`, which times other tiles through the public ops."""


BEST = Variant()
STREAM_PROGRAMS_PER_SM = 2
"""Looping programs per SM (at the looping quantize's 90 registers a third program queues behind
the other two: 15% slower)."""


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: a few programs, so that they loop
    return torch.cuda.get_device_properties(device).multi_processor_count


def looping(block_pad: int, bits_in: int, bits_out: int, stream: bool = True) -> bool:
    """Whether a launch quantizes floats by the looping programs (Variant.stream)."""
    return stream and bits_in == 0 and bits_out != 0 and block_pad >= 8192


def default_tile(block_pad: int, bits_in: int, bits_out: int,
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
    if looping(block_pad, bits_in, bits_out, stream):
        return block_pad, 8  # the looping quantize's programs
    if bits_in == 0:
        if bits_out == 4 and block_pad == 2048:
            return 2048, 2
        two_warps = block_pad > 4096 or (bits_out == 4 and block_pad >= 2048)
    else:
        if bits_out != 0 and block_pad == 2048:
            return 2048, 1
        two_warps = bits_out != 0 and block_pad <= 2048
    return elements, 2 if two_warps else 4


def launch_shape(block_size: int, partition_numel: int, partitions: int, bits_in: int,
                 bits_out: int, variant: Variant) -> tuple[int, int, int, tuple[int, int], int]:
    """(BLOCK_PAD, BLOCKS_PER_PROGRAM, blocks per partition, grid, num_warps) of a launch over
    `partitions` partitions (bits 0: floats), one program per BLOCKS_PER_PROGRAM blocks."""
    block_pad = 1 << (block_size - 1).bit_length()  # next power of two (plain Python: cheaper)
    elements, num_warps = variant.tile or default_tile(block_pad, bits_in, bits_out,
                                                       variant.stream)
    blocks_per_program = max(1, elements // block_pad)
    blocks_per_partition = math.ceil(partition_numel / block_size)
    grid = (-(-blocks_per_partition // blocks_per_program), partitions)
    return block_pad, blocks_per_program, blocks_per_partition, grid, num_warps
