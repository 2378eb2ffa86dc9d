"""The pipeline boundary codecs (--pipeline-codec): how an activation (s, b, h) and its gradient
are encoded into one flat uint8 message and decoded back. The wire formats, their byte counts and
the top-k rule live here; transport_codec.py applies them on the pipeline transport.

A message holds R = numel / h token rows of h values. The formats (every section a flat array,
sections ordered by item size, largest first, so that each starts aligned without padding):

    none      the tensor itself, R h x itemsize bytes (sent as is, not through a message)
    int8      R fp32 scales | R h int8                            4 R + R h bytes
    int4      R fp32 scales | R h / 2 bytes (two values a byte)   4 R + R h / 2 bytes
    adatopk   per row the k entries of largest magnitude:
              values (native: the activation's dtype) | R k int16 indices   R k (itemsize + 2)
              with --pipeline-codec-values int8, int4 (k' = k + k % 2: two values a byte):
              R fp32 scales | R k int16 indices | R k int8 values         4 R + 3 R k
              R fp32 scales | R k int16 indices | R k' / 2 bytes          4 R + 2 R k + R k' / 2

int8 and int4 are the ZeRO++ quantizer of megadomino.kernels (block_quantize / block_dequantize:
the Triton kernels on GPU, their torch references on CPU, bit-identical) with one block per token
row (block_size = h): per-token scales absmax / qmax, round half to even; |decoded - x| <=
scale / 2 per element. The gradient of a quantized boundary is sent quantized the same way (the
rounding's gradient taken as the identity: a straight-through estimate).

adatopk keeps a fixed k per token row (not per tensor): every message of a link has the same
size, known on both ends (NCCL matches messages by order and hangs on a size mismatch), the
indices fit int16 relative to their row (h <= 16384), and every token keeps the same share. The
select and the packing are megadomino.kernels' row_topk: on GPU its Triton kernel (exact radix
select per row, ties broken by lowest index, indices ascending), on CPU torch.topk per row; the
codec needs no order, only that the sender keeps the very indices it sends. The backward
sends the gradient only at the forward's kept indices (R k values, plus 4 R scales with
quantized values): the exact gradient of the masked function x -> mask(x) * x, the mask held as a
constant, as both ends hold the indices from the forward until that backward. With
--pipeline-codec-grad-topk the gradient instead goes as its own top-k (the forward's format):
an approximation. At k = h the decoded tensor is the input exactly (native values).

Quantized values (--pipeline-codec-values int8, int4) go through the same ZeRO++ quantizer,
one block per token row of kept values: block_size k (int4: k', an odd row padded with a zero,
which leaves the row's absmax, so its scale, unchanged and is dropped on decode). The gradient
at the kept indices is quantized the same way (as a quantized boundary's: straight-through).

Bytes: top-k costs (itemsize + 2) bytes a kept entry: with bf16 values 4 (6 with int32 indices,
which is why the indices are row-relative int16), so it sends fewer bytes than int8 (1 byte an
entry plus 4 a row) only below density 1/4 (1/6 with int32 indices); with int8 values 3 bytes an
entry, below 1/3 of int8's bytes, 1/6 of int4's; with int4 values 2.5, below 2/5 of int8's,
1/5 of int4's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megadomino.config.pipeline_codec import MAX_HIDDEN
from megadomino.kernels.block_dequantize import dequantize
from megadomino.kernels.block_quantize import quantize
from megadomino.kernels.row_topk import row_topk

CODECS = ("none", "int8", "int4", "adatopk")
BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class Setting:
    """One link's codec: `codec` one of CODECS; `k`: adatopk's kept entries per row."""

    codec: str = "none"
    k: int = 0

    def describe(self, hidden: int) -> str:
        return f"adatopk k={self.k} ({self.k / hidden:.3g})" if self.codec == "adatopk" \
            else self.codec


@dataclass(frozen=True)
class Format:
    """What both ends of every link know: the activation's rows (R) and width h (at most
    MAX_HIDDEN), its dtype, adatopk's value format ('native', 'int8' or 'int4') and whether
    its gradient goes as its own top-k."""

    rows: int
    hidden: int
    dtype: torch.dtype
    values: str = "native"
    grad_topk: bool = False

    def __post_init__(self):
        if self.hidden > MAX_HIDDEN:
            raise ValueError(f"rows of {self.hidden} values: a codec encodes at most "
                             f"{MAX_HIDDEN}")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def value_block(self, k: int) -> int:
        """Quantized values per row on the wire, one quantizer block: k, padded to even at
        int4 (two values a byte)."""
        return k + k % 2 if self.values == "int4" else k

    def k_of(self, density: float) -> int:
        """adatopk's entries per row at `density` (at least 1, at most h)."""
        return min(self.hidden, max(1, math.ceil(density * self.hidden)))


def sections(setting: Setting, fmt: Format, pass_: str) -> list[tuple[str, torch.dtype, int]]:
    """The message's sections (name, dtype, elements), in wire order (module docstring); pass_
    'F' (activation) or 'B' (gradient)."""
    rows, hidden = fmt.rows, fmt.hidden
    if setting.codec in BITS:
        return [("scales", torch.float32, rows), _quantized("q", rows * hidden, setting.codec)]
    if setting.codec != "adatopk":
        raise ValueError(f"codec {setting.codec!r} has no message format")
    entries = rows * setting.k
    parts = [("indices", torch.int16, entries)] if pass_ == "F" or fmt.grad_topk else []
    if fmt.values in BITS:
        return [("scales", torch.float32, rows)] + parts + [
            _quantized("values", rows * fmt.value_block(setting.k), fmt.values)]
    return sorted([("values", fmt.dtype, entries)] + parts,
                  key=lambda part: -torch.empty((), dtype=part[1]).element_size())


def _quantized(name: str, count: int, quantizer: str) -> tuple[str, torch.dtype, int]:
    """The section of `count` values quantized by `quantizer` (a key of BITS): int8 one a
    byte, int4 two (count even)."""
    bits = BITS[quantizer]
    return name, torch.int8 if bits == 8 else torch.uint8, count * bits // 8


def message_bytes(setting: Setting, fmt: Format, pass_: str) -> int:
    """Bytes of one message of `pass_` ('F' or 'B') at `setting`: the module docstring's
    formulas (none: the tensor's own)."""
    if setting.codec == "none":
        return fmt.rows * fmt.hidden * fmt.itemsize
    return sum(count * torch.empty((), dtype=dtype).element_size()
               for _, dtype, count in sections(setting, fmt, pass_))


def _views(wire: torch.Tensor, parts: list[tuple[str, torch.dtype, int]]) -> dict:
    """Typed flat views of the sections of the uint8 `wire` (aligned by the sections' order)."""
    views, offset = {}, 0
    for name, dtype, count in parts:
        size = count * torch.empty((), dtype=dtype).element_size()
        views[name] = wire[offset:offset + size].view(dtype)
        offset += size
    return views


def top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (R, k), int64, of the k entries of largest magnitude of each row of x (R h,
    contiguous) that adatopk keeps (row_topk; at k = h every index)."""
    return row_topk(x, k)[0]


def _select(rows: torch.Tensor, k: int, views: dict, fmt: Format) -> torch.Tensor:
    """Select and pack the top-k of `rows` (R, h): the indices into their section and the
    values into theirs (quantized values: from the kept ones); returns the kept indices
    (R, k) as int64, the very array on the wire (the gradient is taken and put back at it)."""
    indices = views["indices"].view(fmt.rows, k)
    if fmt.values in BITS:
        _put_values(views, row_topk(rows, k, indices=indices)[1], fmt)
    else:
        row_topk(rows, k, indices=indices, values=views["values"].view(fmt.rows, k))
    return indices.long()


def _put_values(views: dict, values: torch.Tensor, fmt: Format) -> None:
    """Write the (R, k) kept values into their section (quantized: per-row scales)."""
    if fmt.values in BITS:
        block = fmt.value_block(values.shape[1])
        if block > values.shape[1]:  # int4, odd k: a zero column
            values = torch.nn.functional.pad(values, (0, 1))
        quantize(values, BITS[fmt.values], block, out=(views["values"], views["scales"]))
    else:
        views["values"].view(values.shape).copy_(values)


def _get_values(views: dict, shape: tuple[int, int], fmt: Format) -> torch.Tensor:
    """The (R, k) kept values of their section (quantized: dequantized, the pad dropped)."""
    if fmt.values in BITS:
        block = fmt.value_block(shape[1])
        return dequantize(views["values"], views["scales"], shape[0] * block, BITS[fmt.values],
                          block, fmt.dtype).view(shape[0], block)[:, :shape[1]]
    return views["values"].view(shape)


def encode(x: torch.Tensor, setting: Setting, fmt: Format, pass_: str,
           kept: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the message, uint8 flat; the kept indices (R, k) of an adatopk activation, else None).
    x: the tensor, R x h values. A gradient ('B') of adatopk is taken at the forward's `kept`
    indices (unless fmt.grad_topk)."""
    parts = sections(setting, fmt, pass_)
    wire = torch.empty(message_bytes(setting, fmt, pass_), dtype=torch.uint8, device=x.device)
    views = _views(wire, parts)
    rows = x.reshape(fmt.rows, fmt.hidden)
    if setting.codec in BITS:
        quantize(rows, BITS[setting.codec], fmt.hidden, out=(views["q"], views["scales"]))
        return wire, None
    if "indices" in views:
        kept = _select(rows.contiguous(), setting.k, views, fmt)
    else:
        _put_values(views, rows.gather(1, kept), fmt)
    return wire, (kept if pass_ == "F" else None)


def decode(wire: torch.Tensor, setting: Setting, fmt: Format, pass_: str, out: torch.Tensor,
           kept: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode `wire` into `out` (contiguous, R x h of fmt.dtype); returns an adatopk
    activation's kept indices (R, k) (what its receiver sends the gradient at), else None. A
    gradient of adatopk is scattered at the forward's `kept` indices (unless fmt.grad_topk):
    zero elsewhere."""
    views = _views(wire, sections(setting, fmt, pass_))
    flat = out.view(-1)
    if setting.codec in BITS:
        dequantize(views["q"], views["scales"], flat.numel(), BITS[setting.codec], fmt.hidden,
                   fmt.dtype, out=flat)
        return None
    if "indices" in views:
        kept = views["indices"].view(fmt.rows, setting.k).long()
    rows = out.view(fmt.rows, fmt.hidden)
    rows.zero_()
    rows.scatter_(1, kept, _get_values(views, (fmt.rows, setting.k), fmt))
    return kept if pass_ == "F" else None
