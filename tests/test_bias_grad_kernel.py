"""The bias-gradient kernels (kernels/bias_grad.py) against their torch references and against
autograd: GELU's backward with its bias's column sums, and the QKV split's backward (the
interleaved gradient from strided dq, dk, dv, and its column sums), on shapes that leave partial
tiles (rows and columns not multiples of the tile), grouped-query and multi-head layouts, SDPA's
(b, heads, s, d) gradient strides, fp32 and bf16.

The kernels run on CPU only under Triton's interpreter, chosen before triton is imported: the
cases run in one subprocess started with TRITON_INTERPRET=1 (`python
tests/test_bias_grad_kernel.py` prints their results as JSON). fp32 is compared to 1e-5; bf16
within its rounding (the interpreter truncates to bf16 where CUDA rounds to nearest).
tests/gpu/test_gpu_kernels.py runs the same checks on CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F

from megadomino.kernels.bias_grad import (
    gelu_bias_backward,
    gelu_bias_backward_reference,
    qkv_backward,
    qkv_backward_reference,
)
from megadomino.kernels.quant_launch import HAS_TRITON

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    scale = want.float().abs().max().clamp(min=1e-12)
    error = (got.float() - want.float()).abs().max()
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    assert error <= rel * scale, f"{what}: max abs error {error:.3e} > {rel} x {scale:.3e}"


def check_gelu(device: str, force_triton: bool, rows: int, cols: int, dtype: str,
               block: tuple[int, int] = (16, 32)) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + cols)
    g, h = (torch.randn(rows, cols, generator=gen) for _ in range(2))
    h[0, :3] = torch.tensor([30.0, -30.0, 0.0])  # tanh saturated both ways, and zero
    bias = torch.randn(cols, generator=gen)
    # autograd of the layer's own piece, in fp32: the definition the kernel must meet
    x, b = h.clone().requires_grad_(), bias.clone().requires_grad_()
    F.gelu(x + b, approximate="tanh").backward(g)
    dt = DTYPES[dtype]
    g, h, bias = (t.to(device=device, dtype=dt) for t in (g, h, bias))
    dh, dbias = gelu_bias_backward(g, h, bias, force_triton=force_triton, block=block)
    ref_dh, ref_dbias = gelu_bias_backward_reference(g, h, bias)
    _close(dh, ref_dh, TOLERANCE[dtype], "dh vs reference")
    _close(dbias, ref_dbias, TOLERANCE[dtype], "dbias vs reference")
    if dtype == "fp32":
        _close(dh.cpu(), x.grad, 1e-5, "dh vs autograd")
        _close(dbias.cpu(), b.grad, 1e-5, "dbias vs autograd")


def _sdpa_layout(s: int, b: int, groups: int, heads: int, d: int, gen) -> torch.Tensor:
    """A gradient of (s, b, groups, heads, d) stored as SDPA returns it: (b, groups*heads, s, d)
    memory."""
    return (torch.randn(b, groups * heads, s, d, generator=gen).permute(2, 0, 1, 3)
            .reshape(s, b, groups, heads, d))


def check_qkv(device: str, force_triton: bool, s: int, b: int, groups: int, hpg: int, d: int,
              dtype: str, layout: str, block: tuple[int, int] = (16, 32)) -> None:
    gen = torch.Generator().manual_seed(s * 7 + groups)
    if layout == "sdpa":
        dq, dk, dv = (_sdpa_layout(s, b, groups, n, d, gen) for n in (hpg, 1, 1))
    else:  # views of one contiguous buffer, as autograd may hand them over
        whole = torch.randn(s, b, groups, hpg + 2, d, generator=gen)
        dq, dk, dv = whole.split([hpg, 1, 1], dim=3)
    dt = DTYPES[dtype]
    dq, dk, dv = (t.to(device=device, dtype=dt) for t in (dq, dk, dv))
    for with_bias in (False, True):
        dqkv, dbias = qkv_backward(dq, dk, dv, with_bias, force_triton=force_triton,
                                   block=block)
        ref, ref_bias = qkv_backward_reference(dq, dk, dv, with_bias)
        assert torch.equal(dqkv, ref), "dqkv is a copy: it must equal the cat exactly"
        assert dqkv.is_contiguous()
        if with_bias:
            _close(dbias, ref_bias, TOLERANCE[dtype], "dbias")
            # the sum autograd takes for a bias broadcast over (s, b)
            expected = torch.cat([dq, dk, dv], dim=3).float().sum((0, 1)).flatten()
            _close(dbias.float(), expected, TOLERANCE[dtype], "dbias vs the column sums")
        else:
            assert dbias is None


def cases() -> dict[str, tuple]:
    out = {}
    for rows, cols in ((37, 70), (64, 128), (1, 5), (130, 3)):
        for dtype in DTYPES:
            out[f"gelu-{rows}x{cols}-{dtype}"] = ("gelu", rows, cols, dtype)
    for s, b, groups, hpg, d in ((7, 3, 2, 3, 8), (16, 2, 4, 1, 16), (5, 1, 1, 4, 6)):
        for dtype in DTYPES:
            for layout in ("sdpa", "views"):
                out[f"qkv-{s}x{b}-g{groups}h{hpg}d{d}-{dtype}-{layout}"] = (
                    "qkv", s, b, groups, hpg, d, dtype, layout)
    return out


CASES = cases()


def run_cases(device: str, force_triton: bool) -> dict[str, str | None]:
    results = {}
    for name, (kind, *args) in CASES.items():
        try:
            (check_gelu if kind == "gelu" else check_qkv)(device, force_triton, *args)
            results[name] = None
        except Exception:  # reported per case by the test below
            results[name] = traceback.format_exc(limit=3)
    return results


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str | None]:
    if not HAS_TRITON:
        pytest.skip("triton is not installed (the test extra brings it where a wheel exists)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_bias_grad_kernel_interpreted(case: str, interpreted_results: dict) -> None:
    assert interpreted_results[case] is None, interpreted_results[case]


def test_bias_grad_references_on_cpu() -> None:
    """Without force_triton a CPU tensor runs the reference, which meets autograd."""
    check_gelu("cpu", False, 37, 70, "fp32")
    check_qkv("cpu", False, 7, 3, 2, 3, 8, "fp32", "sdpa")


def test_bias_grad_kernels_refuse_what_they_cannot_tile() -> None:
    with pytest.raises(ValueError, match="contiguous g and h"):
        gelu_bias_backward(torch.zeros(4, 6).t(), torch.zeros(6, 4), torch.zeros(4))
    with pytest.raises(ValueError, match=r"dk, dv \(s, b, groups"):
        qkv_backward(torch.zeros(2, 1, 1, 2, 4), torch.zeros(2, 1, 1, 2, 4),
                     torch.zeros(2, 1, 1, 1, 4), True)


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu", True)))
