"""On the GPU machine: the FP8 linear's three GEMMs (cuBLAS through torch._scaled_mm) against the
dequantize-then-matmul reference (the same quantized operands, fp32 matmul on the GPU), at the
shapes of tests/test_fp8.py and at a GPT-3 6.7B projection's, fp32 and bf16 activations, both
formats; plus a delayed-scaling linear trained a few steps on CUDA against the same on CPU.
Skipped without CUDA; `python3 -m pytest tests/gpu/test_gpu_fp8.py -q` runs it."""

from __future__ import annotations

import pytest
import torch
from test_fp8 import _dequantized, _Net, _train_net

from dist_utils import assert_close
from megadomino.config import FP8Recipe
from megadomino.tp.fp8 import E4M3, E5M2, FP8State, fp8_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {"small": (4, 16, 32, 48), "fallback": (4, 5, 40, 24), "6.7b-fc1": (2, 2048, 4096, 4096)}
"""(b, s, in, out); 6.7b-fc1 is a quarter of fc1's 16384 outputs at micro-batch 2 (memory)."""
REL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
"""Relative to max |reference|: Hopper's FP8 tensor cores accumulate with fewer mantissa bits
than an fp32 GEMM (1.2e-4 measured on an H100 at K = 4096), and bf16 output rounding."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemms_match_dequantized_reference(shape, fmt, dtype, monkeypatch):
    b, s, k, n = SHAPES[shape]
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, s, k, generator=gen, device="cuda").to(dtype).requires_grad_()
    weight = torch.nn.Parameter((0.02 * torch.randn(n, k, generator=gen, device="cuda")).to(dtype))
    bias = torch.nn.Parameter(torch.randn(n, generator=gen, device="cuda").to(dtype))
    grad_out = torch.randn(b, s, n, generator=gen, device="cuda").to(dtype)
    state = FP8State(FP8Recipe(format=fmt, recipe="tensorwise"))
    y = fp8_linear(x, weight, bias, state)
    y.backward(grad_out)
    assert y.dtype == x.grad.dtype == weight.grad.dtype == dtype
    assert len(calls) == (0 if shape == "fallback" else 3)

    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    x_d = _dequantized(x.detach().float().reshape(-1, k), E4M3)
    w_d = _dequantized(weight.detach().float(), E4M3)
    g_d = _dequantized(grad_out.float().reshape(-1, n), grad_dtype)
    rel = REL[dtype]
    assert_close(y.detach().float().reshape(-1, n), x_d @ w_d.t() + bias.detach().float(), rel,
                 "y")
    assert_close(x.grad.float().reshape(-1, k), g_d @ w_d, rel, "dx")
    assert_close(weight.grad.float(), g_d.t() @ x_d, rel, "dW")


def test_delayed_training_on_cuda_matches_cpu():
    """Six SGD steps of a delayed-scaling linear: the scaling state evolves alike on CUDA and
    CPU, outputs within 1e-2 of max |output| (where the weights differ in a last fp32 bit, an
    element may round to the neighbouring e4m3 value)."""
    recipe = FP8Recipe(recipe="delayed", amax_history_len=4, amax_compute_algo="max", margin=1)
    cpu, gpu = _Net(recipe), _Net(recipe).cuda()
    outputs_cpu = _train_net(cpu, 0, 6)
    outputs_gpu = _train_net_on(gpu, 6)
    for step, (a, b) in enumerate(zip(outputs_gpu, outputs_cpu)):
        assert_close(a.cpu(), b, 1e-2, f"output at step {step}")
    torch.testing.assert_close(gpu.fp8_state.scale.cpu(), cpu.fp8_state.scale, rtol=1e-5, atol=0)


def _train_net_on(net: _Net, steps: int) -> list[torch.Tensor]:
    """_train_net's steps with its CPU-drawn inputs moved to the net's device."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outputs = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = ((1 + step) * torch.randn(16, 48, generator=gen)).cuda()
        y = net(x)
        outputs.append(y.detach())
        optimizer.zero_grad()
        (y * torch.randn(16, 32, generator=gen).cuda()).sum().backward()
        optimizer.step()
    return outputs
