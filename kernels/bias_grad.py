"""A bias's gradient summed in the pass that writes the gradient it sums: the column sums over
the tokens ride on a backward's element-wise pass instead of reading its output again
(torch.compile emits the sum as a kernel of its own: benchmarks/bench_bias_grad.py).

    dh, dbias = gelu_bias_backward(g, h, bias)
        GELU (tanh approximation) of h + bias, backward: dh = g * gelu'(h + bias) in h's dtype,
        dbias = dh's column sums (of the fp32 values, before rounding), in bias's dtype.
        g, h: [N, C] contiguous, same dtype; bias: [C].

Each program handles a (BLOCK_N rows, BLOCK_C columns) tile: it writes the tile and its column
sums into a partials buffer [row blocks, C] (fp32), which torch then sums (a small kernel; no
atomics, so the result does not depend on the order programs run in). A CPU tensor runs the torch
reference (`*_reference`, beside each kernel) unless `force_triton=True`, which runs the kernel
under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported).
"""

from __future__ import annotations

import math

import torch

from megadomino.kernels.quant_launch import tl, triton, use_triton

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


@triton.jit
def _gelu_bias_backward_kernel(g_ptr, h_ptr, b_ptr, dh_ptr, partial_ptr, N, C,
                               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_n, pid_c = tl.program_id(0), tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # N * C may pass 2**31
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < N) & (cols[None, :] < C)
    offsets = rows[:, None] * C + cols[None, :]
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # tanh(inner), inf-safe
    slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (
        1.0 + 3.0 * 0.044715 * x * x)
    dh = g * slope
    tl.store(dh_ptr + offsets, dh.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(partial_ptr + pid_n * C + cols, tl.sum(dh, axis=0), mask=cols < C)


def gelu_bias_backward_reference(g: torch.Tensor, h: torch.Tensor,
                                 bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch definition (module docstring)."""
    x = h.float() + bias.float()
    # tanh in fp64: torch's fp32 CPU tanh is off by up to ~1e-4 in some processes (its kernel
    # choice varies per process), 10x the tolerance this definition is held to
    t = torch.tanh((_SQRT_2_OVER_PI * (x + _KAPPA * x * x * x)).double()).float()
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _KAPPA * x * x)
    dh = g.float() * slope
    return dh.to(h.dtype), dh.sum(0).to(bias.dtype)


def gelu_bias_backward(g: torch.Tensor, h: torch.Tensor, bias: torch.Tensor,
                       force_triton: bool = False,
                       block: tuple[int, int] = (64, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, dbias): module docstring. block: the (BLOCK_N, BLOCK_C) tile."""
    if g.dim() != 2 or g.shape != h.shape or not (g.is_contiguous() and h.is_contiguous()) \
            or bias.shape != (h.shape[1],):
        raise ValueError(f"gelu_bias_backward needs contiguous g and h of one 2-D shape and a "
                         f"bias of their columns, got {tuple(g.shape)}, {tuple(h.shape)}, "
                         f"{tuple(bias.shape)}")
    if not use_triton(g, force_triton, "the GELU bias gradient"):
        return gelu_bias_backward_reference(g, h, bias)
    (n, c), (block_n, block_c) = h.shape, block
    grid = (triton.cdiv(n, block_n), triton.cdiv(c, block_c))
    dh = torch.empty_like(h)
    partials = torch.empty((grid[0], c), dtype=torch.float32, device=h.device)
    _gelu_bias_backward_kernel[grid](g, h, bias.contiguous(), dh, partials, n, c,
                                     BLOCK_N=block_n, BLOCK_C=block_c)
    return dh, partials.sum(0).to(bias.dtype)
