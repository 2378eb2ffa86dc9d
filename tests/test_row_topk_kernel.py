"""The row top-k kernel (kernels/row_topk.py, adatopk's select) against an exact oracle and
against torch.topk, on rows with remainders (h = 2048, 1000, 8192, 37; k = 1, 3, h / 10, h - 1,
h), fp32, bf16 and fp16, with distinct magnitudes and with many ties:

- the oracle is the module docstring's rule written in torch (a stable descending sort of |x|,
  its first k columns, ascending): the kernel's indices equal it exactly, ties included;
- the values are x at those indices bit for bit, and the indices ascend;
- against torch.topk: the kept magnitudes are always the same multiset, and the kept set is
  torch.topk's wherever the row has no tie at the k-th magnitude;
- the codec's adatopk round trip (native, int8 and int4 values) with the kernel as its select: the
  decoded activation and the gradient put back at the kept indices are the torch.topk path's
  bit for bit on rows without ties, and x (g) masked to the oracle's set with ties.

The kernels run on CPU only under Triton's interpreter, chosen before triton is imported: the
cases run in one subprocess started with TRITON_INTERPRET=1 (`python
tests/test_row_topk_kernel.py` prints their results as JSON). tests/gpu/test_gpu_kernels.py runs
the same checks on CUDA, larger.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from interpreted import interpreted_test, run_cases

import megadomino.pipeline.codec as codec
from megadomino.kernels.row_topk import row_topk, row_topk_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FINITE_16 = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}  # bit patterns below inf


def draw(rows: int, hidden: int, dtype: str, kind: str, seed: int = 0) -> torch.Tensor:
    """(rows, hidden) of `dtype`: 'distinct' magnitudes in each row (distinct bit patterns,
    random signs), 'ties' (integers -4..4) or 'special' (ties plus NaN, +-inf, +-0, subnormals)."""
    gen = torch.Generator().manual_seed(seed * 7919 + hidden)
    dt = DTYPES[dtype]
    if kind == "distinct":
        limit = _FINITE_16.get(dt, 0x7F80)
        bits = torch.stack([torch.randperm(limit, generator=gen)[:hidden] for _ in range(rows)])
        sign = torch.randint(0, 2, (rows, hidden), generator=gen) << 15
        if dt != torch.float32:
            return (bits | sign).to(torch.int16).view(dt)
        low = torch.randint(0, 1 << 16, (rows, hidden), generator=gen)
        word = bits << 16 | low | sign << 16  # int64; as int32 the sign bit is negative
        return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32).view(dt)
    x = torch.randint(-4, 5, (rows, hidden), generator=gen).to(dt)
    if kind == "special":
        tiny = torch.finfo(dt).tiny / 4  # subnormal
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, tiny, -tiny,
                                 float("nan")], dtype=dt)
        x[:, :min(hidden, len(specials))] = specials[:hidden]
    return x


def oracle(x: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel's rule in torch: the k largest |x| of each row, ties to the lowest column,
    ascending columns (a stable sort keeps equal magnitudes in column order)."""
    order = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=1).values


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def check_row_topk(device: str, force_triton: bool, rows: int, hidden: int, dtype: str,
                   kind: str, index_dtype: torch.dtype = torch.int64) -> None:
    """Every k of the module docstring on one draw."""
    x = draw(rows, hidden, dtype, kind).to(device)
    for k in sorted({1, 3, max(1, hidden // 10), hidden - 1, hidden} & set(range(1, hidden + 1))):
        indices = torch.empty((rows, k), dtype=index_dtype, device=device)
        got, values = row_topk(x, k, indices=indices, force_triton=force_triton)
        want = oracle(x, k)
        assert got is indices and torch.equal(got.long(), want), f"k={k}: indices"
        # gathered as integers: torch's bf16 gather on CPU rewrites a NaN's bits
        assert torch.equal(_bits(values), _bits(x).gather(1, want)), f"k={k}: values"
        topk = torch.topk(x.abs(), k, dim=1, sorted=False)
        assert torch.equal(_bits(values.abs().sort(1).values),
                           _bits(topk.values.sort(1).values)), f"k={k}: magnitudes"
        kth = topk.values.min(dim=1, keepdim=True).values
        untied = ((x.abs() == kth) | (kth.isnan() & x.isnan())).sum(1) == 1
        assert torch.equal(want[untied], topk.indices.sort(1).values[untied]), f"k={k}: set"


def _round_trip(x: torch.Tensor, g: torch.Tensor, k: int, values: str):
    """adatopk's encode and decode of x, then of its gradient g at the kept indices: (decoded
    x, decoded g, the sender's kept indices, the receiver's)."""
    setting = codec.Setting("adatopk", k)
    fmt = codec.Format(x.shape[0], x.shape[1], x.dtype, values=values)
    wire, sent = codec.encode(x, setting, fmt, "F")
    assert wire.numel() == codec.message_bytes(setting, fmt, "F")
    out, grad = torch.empty_like(x), torch.empty_like(g)
    received = codec.decode(wire, setting, fmt, "F", out)
    wire_b, _ = codec.encode(g, setting, fmt, "B", received)
    codec.decode(wire_b, setting, fmt, "B", grad, sent)
    return out, grad, sent, received


def check_codec(device: str, force_triton: bool, rows: int, hidden: int, dtype: str, kind: str,
                values: str) -> None:
    """The round trip with the kernel as the codec's select (force_triton: under the
    interpreter) against the torch.topk path on CPU (module docstring)."""
    x = draw(rows, hidden, dtype, kind)
    g = draw(rows, hidden, dtype, "distinct", seed=1)
    k = max(1, hidden // 10)
    original = codec.row_topk
    if force_triton:
        codec.row_topk = functools.partial(row_topk, force_triton=True)
    try:
        out, grad, sent, received = _round_trip(x.to(device), g.to(device), k, values)
    finally:
        codec.row_topk = original
    want = oracle(x, k)
    assert torch.equal(sent.cpu(), want) and torch.equal(received.cpu(), want), "kept indices"
    if kind == "distinct":
        out_ref, grad_ref, _, _ = _round_trip(x, g, k, values)
        assert torch.equal(_bits(out.cpu()), _bits(out_ref)), "decoded x vs torch.topk's"
        assert torch.equal(_bits(grad.cpu()), _bits(grad_ref)), "decoded g vs torch.topk's"
    if values == "native":
        mask = torch.zeros_like(x, dtype=torch.bool).scatter_(1, want, True)
        assert torch.equal(out.cpu(), torch.where(mask, x, 0)), "decoded x vs masked x"
        assert torch.equal(grad.cpu(), torch.where(mask, g, 0)), "decoded g vs masked g"


def cases() -> dict[str, tuple]:
    out = {}
    for hidden in (2048, 1000, 8192, 37):
        for dtype in ("fp32", "bf16"):
            for kind in ("distinct", "ties"):
                out[f"topk-{hidden}-{dtype}-{kind}"] = (check_row_topk, 3, hidden, dtype, kind)
    for dtype in DTYPES:
        out[f"topk-special-{dtype}"] = (check_row_topk, 2, 300, dtype, "special")
    out["topk-1000-fp16-distinct"] = (check_row_topk, 3, 1000, "fp16", "distinct")
    for index_dtype in (torch.int16, torch.int32):
        out[f"topk-{index_dtype}"] = (check_row_topk, 2, 1000, "bf16", "ties", index_dtype)
    for dtype in ("fp32", "bf16"):
        for kind in ("distinct", "ties"):
            for values in ("native", "int8", "int4"):
                out[f"codec-{dtype}-{kind}-{values}"] = (check_codec, 5, 1000, dtype, kind,
                                                         values)
    return out


CASES = cases()


test_row_topk_kernel_interpreted = interpreted_test(__file__, CASES)


def test_reference_on_cpu_keeps_torch_topks_set() -> None:
    """Without force_triton a CPU tensor runs torch.topk: the oracle's set on distinct rows."""
    x = draw(4, 1000, "bf16", "distinct")
    indices, values = row_topk(x, 100)
    assert torch.equal(indices.sort(1).values, oracle(x, 100))
    assert torch.equal(values, x.gather(1, indices))
    assert torch.equal(row_topk_reference(x, 100)[0], indices)


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(4, 6).t(), 2), "contiguous"),
    ((torch.zeros(4, 6, dtype=torch.int32), 2), "fp32/bf16/fp16"),
    ((torch.zeros(4, 6), 7), "1 <= k <= h"),
    ((torch.zeros(4, 6), 0), "1 <= k <= h"),
    ((torch.zeros(2, 16385), 1), "h <= 16384"),
])
def test_refuses_what_it_cannot_select(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        row_topk(*args)


def test_refuses_wrong_outputs() -> None:
    with pytest.raises(ValueError, match="indices must be a contiguous"):
        row_topk(torch.zeros(4, 6), 2, indices=torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="values must be a contiguous"):
        row_topk(torch.zeros(4, 6), 2, values=torch.zeros(4, 3))


if __name__ == "__main__":
    print(json.dumps(run_cases(CASES, lambda check, *args: check("cpu", True, *args))))
