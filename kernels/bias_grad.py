"""A bias's gradient summed in the pass that writes the gradient it sums: the column sums over
the tokens ride on a backward's element-wise pass instead of reading its output again
(torch.compile emits the sum as a kernel of its own: benchmarks/bench_bias_grad.py).

    dh, dbias = gelu_bias_backward(g, h, bias)
        GELU (tanh approximation) of h + bias, backward: dh = g * gelu'(h + bias) in h's dtype,
        dbias = dh's column sums (of the fp32 values, before rounding), in bias's dtype.
        g, h: [N, C] contiguous, same dtype; bias: [C].
    dqkv, dbias = qkv_backward(dq, dk, dv, with_bias)
        The fused QKV projection's gradient from its split's: dq (s, b, groups, hpg, d), dk and
        dv (s, b, groups, 1, d), any strides, concatenated along dim 3 into a contiguous
        (s, b, groups, hpg + 2, d); with `with_bias`, its column sums flattened (the
        projection bias's gradient, summed in fp32, in dq's dtype), else None.

Each program handles a (BLOCK_N rows, BLOCK_C columns) tile: it writes the tile and its column
sums into a partials buffer [row blocks, C] (fp32), which torch then sums (a small kernel; no
atomics, so the result does not depend on the order programs run in). A CPU tensor runs the torch
reference (`*_reference`, beside each kernel) unless `force_triton=True`, which runs the kernel
under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported).
"""

from __future__ import annotations

import math

import torch

from megadomino.kernels.quant_launch import HAS_TRITON, tl, triton

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
    t = torch.tanh(_SQRT_2_OVER_PI * (x + _KAPPA * x * x * x))
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
    if not (g.is_cuda or force_triton) or not HAS_TRITON:
        return gelu_bias_backward_reference(g, h, bias)
    (n, c), (block_n, block_c) = h.shape, block
    grid = (triton.cdiv(n, block_n), triton.cdiv(c, block_c))
    dh = torch.empty_like(h)
    partials = torch.empty((grid[0], c), dtype=torch.float32, device=h.device)
    _gelu_bias_backward_kernel[grid](g, h, bias.contiguous(), dh, partials, n, c,
                                     BLOCK_N=block_n, BLOCK_C=block_c)
    return dh, partials.sum(0).to(bias.dtype)


@triton.jit
def _qkv_backward_kernel(dq_ptr, dk_ptr, dv_ptr, out_ptr, partial_ptr, N, C, B, HPG, D,
                         q_s, q_b, q_g, q_j, q_e, k_s, k_b, k_g, k_e, v_s, v_b, v_g, v_e,
                         WITH_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    pid_n, pid_c = tl.program_id(0), tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # offsets may pass 2**31
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < N, cols < C
    s, b = rows // B, rows % B
    group, rest = cols // ((HPG + 2) * D), cols % ((HPG + 2) * D)
    head, e = rest // D, rest % D
    mask = row_ok[:, None] & col_ok[None, :]
    is_q, is_k, is_v = head < HPG, head == HPG, head > HPG
    q_off = (s * q_s + b * q_b)[:, None] + (group * q_g + head * q_j + e * q_e)[None, :]
    k_off = (s * k_s + b * k_b)[:, None] + (group * k_g + e * k_e)[None, :]
    v_off = (s * v_s + b * v_b)[:, None] + (group * v_g + e * v_e)[None, :]
    x = tl.where(is_q[None, :], tl.load(dq_ptr + q_off, mask=mask & is_q[None, :], other=0.0),
                 tl.where(is_k[None, :],
                          tl.load(dk_ptr + k_off, mask=mask & is_k[None, :], other=0.0),
                          tl.load(dv_ptr + v_off, mask=mask & is_v[None, :], other=0.0)))
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], x, mask=mask)
    if WITH_BIAS:
        tl.store(partial_ptr + pid_n * C + cols, tl.sum(x.to(tl.float32), axis=0), mask=col_ok)


def qkv_backward_reference(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                           with_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch definition (module docstring)."""
    dqkv = torch.cat([dq, dk, dv], dim=3)
    dbias = dqkv.float().sum((0, 1)).flatten().to(dq.dtype) if with_bias else None
    return dqkv, dbias


def qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, with_bias: bool,
                 force_triton: bool = False, block: tuple[int, int] = (64, 128)
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dqkv, dbias or None): module docstring. block: the (BLOCK_N, BLOCK_C) tile."""
    s, b, groups, hpg, d = dq.shape
    if dk.shape != (s, b, groups, 1, d) or dv.shape != dk.shape or not (
            dq.dtype == dk.dtype == dv.dtype):
        raise ValueError(f"qkv_backward needs dq (s, b, groups, hpg, d) and dk, dv (s, b, groups,"
                         f" 1, d) of one dtype, got {tuple(dq.shape)}, {tuple(dk.shape)}, "
                         f"{tuple(dv.shape)}")
    if not (dq.is_cuda or force_triton) or not HAS_TRITON:
        return qkv_backward_reference(dq, dk, dv, with_bias)
    n, c = s * b, groups * (hpg + 2) * d
    block_n, block_c = block
    grid = (triton.cdiv(n, block_n), triton.cdiv(c, block_c))
    out = torch.empty((s, b, groups, hpg + 2, d), dtype=dq.dtype, device=dq.device)
    partials = torch.empty((grid[0], c) if with_bias else (1,), dtype=torch.float32,
                           device=dq.device)
    qs, ks, vs = dq.stride(), dk.stride(), dv.stride()
    _qkv_backward_kernel[grid](dq, dk, dv, out, partials, n, c, b, hpg, d,
                               qs[0], qs[1], qs[2], qs[3], qs[4], ks[0], ks[1], ks[2], ks[4],
                               vs[0], vs[1], vs[2], vs[4], WITH_BIAS=with_bias,
                               BLOCK_N=block_n, BLOCK_C=block_c)
    return out, (partials.sum(0).to(dq.dtype) if with_bias else None)
