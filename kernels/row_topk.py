"""Per-row top-k by magnitude, selected and packed in one pass a row: the pipeline codec adatopk's
select (megadomino/pipeline/codec.py).

    indices, values = row_topk(x, k)
        x: (R, h) contiguous fp32 / bf16 / fp16, h <= MAX_ROW; 1 <= k <= h.
        indices (R, k): the column of each kept entry (int64, or the int16 / int32 `indices`
        given); values (R, k): x at those columns, in x's dtype, bit for bit.

The algorithm: exact radix select per row, ties broken by lowest index. One program holds a row
in registers as integer magnitude keys, the float's bits without the sign (for non-negative
floats the integer order is the magnitude order; NaN ranks above inf, as in torch.topk). The k-th
largest key T is found bit by bit from the top: T is the largest value with at least k keys
>= T, so a bit stays set when the count of keys >= (T with that bit) is still >= k (one tl.sum
a bit: 15 passes for bf16 / fp16, 31 for fp32). The row then keeps every key > T and the first
k - #(keys > T) keys equal to T, in column order, and writes them compacted at their prefix-sum
slots (one tl.cumsum): exactly k entries a row, in ascending column order.

So the kept set is torch.topk's whenever the row has no tie at the k-th magnitude; at a tie it
is the valid top-k that keeps the lowest columns (torch.topk leaves the choice unspecified).
The codec needs no particular order: only that the sender's kept indices and the wire's are one
array (its gradient is gathered and scattered at that array on both ends); ascending columns
make the message deterministic and its gather and scatter walk each row forward.

Dispatch (kernels' `use_triton`): a CUDA tensor runs the kernel (without triton, the reference
with a warning once); a CPU tensor runs `row_topk_reference` (torch.topk per row: the same set
when the k-th magnitude has no tie, in torch.topk's order) unless `force_triton=True`, which
runs the kernel under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported). At
k = h every path keeps every column in order. No autograd history; the current CUDA stream.
"""

# No `from __future__ import annotations`: Triton reads the kernel's `tl.constexpr` annotations.
import torch
from torch import Tensor

from megadomino.kernels.quant_launch import on_device, tl, triton, use_triton

MAX_ROW = 16384
"""The longest row: one program holds it in registers (32 keys a thread at 16 warps), and the
packed prefix sum counts equal keys in 16 bits."""
_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
_KEY_BITS = {torch.float32: 31, torch.bfloat16: 15, torch.float16: 15}
_BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@triton.jit
def _row_topk_kernel(bits_ptr, index_ptr, value_ptr, hidden, k, BLOCK: tl.constexpr,
                     KEY_BITS: tl.constexpr):
    """Row program_id(0) of the (R, hidden) floats read as integers at bits_ptr: its k entries of
    largest magnitude (module docstring) to index_ptr / value_ptr (R, k), ascending columns."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    bits = tl.load(bits_ptr + row * hidden + cols, mask=inside, other=0)
    # the sign bit cleared; padding is 0, below every candidate (>= 1) and never kept
    key = bits.to(tl.int32) & ((1 << KEY_BITS) - 1)
    threshold = tl.sum(tl.zeros_like(key), axis=0)
    for step in tl.static_range(KEY_BITS):  # invariant: #(key >= threshold) >= k
        candidate = threshold | (1 << (KEY_BITS - 1 - step))
        # (key - candidate) >> 31: -1 below the candidate, else 0 (two instructions a key,
        # against four for a compare, select and add; 0 <= key, candidate < 2**31)
        count = BLOCK + tl.sum((key - candidate) >> 31, axis=0)
        threshold = tl.where(count >= k, candidate, threshold)
    above = ((threshold - key).to(tl.uint32) >> 31).to(tl.int32)  # key > threshold
    equal = ((key == threshold) & inside).to(tl.int32)
    need = k - tl.sum(above, axis=0)  # >= 1: fewer than k keys lie above the k-th largest
    # one inclusive scan of both counts: above in the high bits, equal in the low 16
    packed = tl.cumsum(above * 65536 + equal, axis=0)
    above_before = (packed >> 16) - above
    equal_before = (packed & 0xFFFF) - equal
    keep = (above == 1) | ((equal == 1) & (equal_before < need))
    slot = above_before + tl.minimum(equal_before, need)
    tl.store(index_ptr + row * k + slot, cols.to(index_ptr.dtype.element_ty), mask=keep)
    tl.store(value_ptr + row * k + slot, bits, mask=keep)


def _launch(x: Tensor, k: int, indices: Tensor, values: Tensor) -> None:
    """One program a row, the row padded to a power of two, about 16 keys a thread (at most 16
    warps): at h = 2048, 4 warps compile to the fewest instructions a row that still fit 96
    registers (2 warps need 150 a thread, 8 run more reduction steps)."""
    rows, hidden = x.shape
    block = 1 << (hidden - 1).bit_length()
    bits_dtype = _BITS_DTYPE[x.dtype]
    with on_device(x):
        _row_topk_kernel[(rows,)](x.view(bits_dtype), indices, values.view(bits_dtype), hidden,
                                  k, BLOCK=block, KEY_BITS=_KEY_BITS[x.dtype],
                                  num_warps=min(16, max(1, block // 512)))


def _outputs(x: Tensor, k: int, indices: Tensor | None,
             values: Tensor | None) -> tuple[Tensor, Tensor]:
    """x and k checked; the (indices, values) to fill, made where not given, checked where."""
    if x.dim() != 2 or not x.is_contiguous() or x.dtype not in _KEY_BITS:
        raise ValueError(f"row_topk needs a contiguous (rows, h) fp32/bf16/fp16 tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    rows, hidden = x.shape
    if not 1 <= k <= hidden or hidden > MAX_ROW:
        raise ValueError(f"row_topk keeps 1 <= k <= h entries of rows of h <= {MAX_ROW}, got "
                         f"k={k}, h={hidden}")
    if indices is None:
        indices = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    if values is None:
        values = torch.empty((rows, k), dtype=x.dtype, device=x.device)
    for name, out, dtypes in (("indices", indices, _INDEX_DTYPES), ("values", values, (x.dtype,))):
        if out.shape != (rows, k) or out.dtype not in dtypes or not out.is_contiguous() \
                or out.device != x.device:
            raise ValueError(f"row_topk's {name} must be a contiguous ({rows}, {k}) tensor of "
                             f"{', '.join(map(str, dtypes))} on {x.device}, got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return indices, values


@torch.no_grad()
def row_topk(x: Tensor, k: int, *, indices: Tensor | None = None, values: Tensor | None = None,
             force_triton: bool = False) -> tuple[Tensor, Tensor]:
    """(indices, values) of the k entries of largest magnitude of each row of x (module
    docstring); `indices` / `values`, when given, are filled (e.g. a message's sections)."""
    indices, values = _outputs(x, k, indices, values)
    if x.numel() == 0:
        return indices, values
    if k == x.shape[1]:
        indices.copy_(torch.arange(k, device=x.device).expand(x.shape[0], k))
        return indices, values.copy_(x)
    if not use_triton(x, force_triton, "the row top-k select"):
        return row_topk_reference(x, k, indices=indices, values=values)
    _launch(x, k, indices, values)
    return indices, values


# --- torch reference (CPU tensors run it; the baseline the kernel is timed against) ------------

@torch.no_grad()
def row_topk_reference(x: Tensor, k: int, *, indices: Tensor | None = None,
                       values: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """row_topk() by torch.topk of |x| per row (unsorted) and a gather of the kept values."""
    indices, values = _outputs(x, k, indices, values)
    kept = torch.topk(x.abs(), k, dim=1, sorted=False).indices
    return indices.copy_(kept), torch.gather(x, 1, kept, out=values)
