"""The bias-gradient kernel (kernels/bias_grad.py) against its torch reference and against
autograd: GELU's backward with its bias's column sums, on shapes that leave partial tiles (rows
and columns not multiples of the tile), tanh saturated both ways, fp32 and bf16.

The kernels run on CPU only under Triton's interpreter, chosen before triton is imported: the
cases run in one subprocess started with TRITON_INTERPRET=1 (`python
tests/test_bias_grad_kernel.py` prints their results as JSON). fp32 is compared to 1e-5; bf16
within its rounding (the interpreter truncates to bf16 where CUDA rounds to nearest).
tests/gpu/test_gpu_kernels.py runs the same checks on CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from interpreted import interpreted_test, run_cases

from megadomino.kernels.bias_grad import gelu_bias_backward, gelu_bias_backward_reference

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


def cases() -> dict[str, tuple]:
    out = {}
    for rows, cols in ((37, 70), (64, 128), (1, 5), (130, 3)):
        for dtype in DTYPES:
            out[f"gelu-{rows}x{cols}-{dtype}"] = (rows, cols, dtype)
    return out


CASES = cases()


test_bias_grad_kernel_interpreted = interpreted_test(__file__, CASES)


def test_bias_grad_references_on_cpu() -> None:
    """Without force_triton a CPU tensor runs the reference, which meets autograd."""
    check_gelu("cpu", False, 37, 70, "fp32")


def test_bias_grad_kernel_refuses_what_it_cannot_tile() -> None:
    with pytest.raises(ValueError, match="contiguous g and h"):
        gelu_bias_backward(torch.zeros(4, 6).t(), torch.zeros(6, 4), torch.zeros(4))


if __name__ == "__main__":
    print(json.dumps(run_cases(CASES, lambda *args: check_gelu("cpu", True, *args))))
