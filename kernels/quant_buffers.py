"""The quantization ops' buffers: inputs and `out=` buffers checked, outputs made, and the
payload layout of a collective's buffer.

Row layouts (zero-copy collectives). Quantized inputs and `out=` buffers are flat and
contiguous, or [rows, ...] views whose rows are contiguous and any stride apart, each row
holding the same number of whole partitions, taken in row order. PayloadLayout describes one
collective's uint8 buffer [rows, row_bytes], row i = [q of its partitions | their fp32 scales],
each section padded to 16 bytes, and its views(): quantize / swizzled_quantize write into a
send buffer's rows and the reduce ops read a receive buffer's rows in place, in the same single
launch (the kernel finds partition k at (k // per row) * row stride + (k % per row) * its size).
The torch references read such rows as the kernels do; their results are flat.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from megadomino.kernels.quant_launch import Rows
from megadomino.kernels.quant_scheme import check_scheme, quantized_size

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
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


def contiguous_rows(partition_numel: int, bits: int, block_size: int) -> Rows:
    """A flat buffer (bits 0: floats): one partition per row, rows back to back."""
    q_numel, s_numel = quantized_size(partition_numel, bits or 8, block_size)
    return Rows(1, q_numel, s_numel)


def check_float(x: Tensor) -> Tensor:
    """`x` flattened (copied only if not contiguous), refused unless fp32 / bf16 / fp16."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"expected a float32/bfloat16/float16 tensor, got {x.dtype}")
    return x.reshape(-1)


def quantized_rows(q: Tensor, scales: Tensor, parts: int, partition_numel: int, bits: int,
                   block_size: int, what: str = "") -> Rows:
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
        return Rows(1, q_numel, s_numel)
    if q.dim() == 2 and scales.dim() == 2 and q.shape[0] == scales.shape[0] and q_numel:
        per_row = q.shape[1] // q_numel
        rows_ok = q.shape[0] == 1 or (q.stride(0) >= q.shape[1]
                                      and scales.stride(0) >= scales.shape[1])
        if (q.shape[1] == per_row * q_numel and scales.shape[1] == per_row * s_numel
                and q.stride(1) == 1 and scales.stride(1) == 1 and rows_ok):
            return Rows(per_row, q.stride(0), scales.stride(0))
    raise ValueError(f"{what}q and scales must be flat and contiguous, or [rows, ...] views with "
                     f"contiguous non-overlapping rows of whole partitions (PayloadLayout.views),"
                     f" got q {list(q.shape)} stride {q.stride()}, scales {list(scales.shape)} "
                     f"stride {scales.stride()}")


def reduce_shape(q: Tensor, scales: Tensor, num_inputs: int, partition_numel: int, bits: int,
                 block_size: int) -> tuple[int, Rows]:
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
    rows = quantized_rows(q, scales, parts, partition_numel, bits, block_size)
    return parts // num_inputs, rows


def output(out: Tensor | None, numel: int, dtype: torch.dtype, like: Tensor) -> Tensor:
    """A flat float result: `out` checked (contiguous), or a new buffer on like's device."""
    if out is None:
        return torch.empty(numel, dtype=dtype, device=like.device)
    if out.dtype != dtype or out.numel() != numel or out.device != like.device:
        raise ValueError(f"out must be {numel} {dtype} values on {like.device}, got "
                         f"{out.numel()} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out.view(-1)


def quantized_outputs(out: tuple[Tensor, Tensor] | None, parts: int, numel: int, bits: int,
                      block_size: int, like: Tensor) -> tuple[Tensor, Tensor, Rows]:
    """(q, scales, their layout): `out` checked, or new flat buffers."""
    if out is None:
        q_numel, s_numel = quantized_size(numel, bits, block_size)
        q_dtype = torch.int8 if bits == 8 else torch.uint8
        return (torch.empty(parts * q_numel, dtype=q_dtype, device=like.device),
                torch.empty(parts * s_numel, dtype=torch.float32, device=like.device),
                Rows(1, q_numel, s_numel))
    q, scales = out
    if q.device != like.device:
        raise ValueError(f"out must be on {like.device}, got {q.device}")
    return q, scales, quantized_rows(q, scales, parts, numel, bits, block_size, "out ")


def fill(out: Tensor, values: Tensor) -> Tensor:
    """A reference's flat result copied into `out` (flat or a [rows, ...] view)."""
    return out.copy_(values.view(out.shape))
