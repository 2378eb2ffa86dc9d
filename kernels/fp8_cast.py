"""FP8 cast of a GEMM operand in one pass: scale, saturate, convert, the transposed copy and the
amax, reading the input once (what torch.compile cannot give: it emits the amax reduction and the
cast as two kernels, each reading the whole input).

    q, q_t, amax = cast_transpose(t, scale, dtype, transposed, with_amax)

t: 2-D, contiguous (bf16, fp16 or fp32); scale: fp32 scalar tensor (delayed scaling: known before
the cast); q = clamp(t * scale, +-max(dtype)).to(dtype) rounded to nearest, as
`megadomino.tp.fp8.quantize` computes it; q_t = q.t().contiguous() when `transposed`, else None;
amax = amax(|t|) in fp32 when `with_amax` (NaN when t holds one), else None.

Each program casts one (BLOCK_M, BLOCK_N) tile, writes it and its transpose, and the tile's max
|t| (NaN if the tile has one) into a partials buffer, reduced by torch's amax afterwards (one tiny
kernel; no atomics, so the result does not depend on the order programs run in). A CPU tensor
runs the torch reference (`cast_transpose_reference`, bit-identical) unless `force_triton=True`,
which runs the kernel under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported).
The interpreter converts to FP8 by truncating the mantissa where a carry reaches the exponent
(127.3 -> 64 in e4m3), so interpreted runs match the reference bit for bit only on inputs whose
scaled values are FP8 numbers; the GPU tests compare random inputs.
"""

from __future__ import annotations

import torch

from megadomino.kernels.quant_launch import tl, triton, use_triton

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _cast_transpose_kernel(t_ptr, scale_ptr, q_ptr, qt_ptr, partial_ptr, M, N, limit,
                           TRANSPOSED: tl.constexpr, WITH_AMAX: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(t_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    scaled = x * scale
    clamped = tl.minimum(tl.maximum(scaled, -limit), limit)
    clamped = tl.where(scaled != scaled, scaled, clamped)  # NaN stays NaN, as torch's clamp
    q = clamped.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
    if TRANSPOSED:
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q), mask=tl.trans(mask))
    if WITH_AMAX:
        peak = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        nans = tl.sum(tl.sum((x != x).to(tl.int32), axis=1), axis=0)
        peak = tl.where(nans > 0, float("nan"), peak)
        tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_n, peak)


def cast_transpose_reference(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                             transposed: bool, with_amax: bool):
    """The torch definition (module docstring)."""
    limit = FP8_MAX[dtype]
    q = (t.float() * scale).clamp(-limit, limit).to(dtype)
    return (q, q.t().contiguous() if transposed else None,
            t.abs().amax().float() if with_amax else None)


def cast_transpose(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transposed: bool,
                   with_amax: bool, force_triton: bool = False,
                   block: tuple[int, int] = (64, 64)):
    """(q, q_t or None, amax or None): module docstring. block: the (BLOCK_M, BLOCK_N) tile."""
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"cast_transpose needs a contiguous 2-D tensor, got {tuple(t.shape)} "
                         f"with strides {t.stride()}")
    if not use_triton(t, force_triton, "the FP8 cast"):
        return cast_transpose_reference(t, scale, dtype, transposed, with_amax)
    (m, n), (block_m, block_n) = t.shape, block
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    q = torch.empty((m, n), dtype=dtype, device=t.device)
    q_t = torch.empty((n, m), dtype=dtype, device=t.device) if transposed else q
    partials = torch.empty(grid[0] * grid[1] if with_amax else 1, dtype=torch.float32,
                           device=t.device)
    _cast_transpose_kernel[grid](t, scale.reshape(1).float(), q, q_t, partials, m, n,
                                 FP8_MAX[dtype], TRANSPOSED=transposed, WITH_AMAX=with_amax,
                                 BLOCK_M=block_m, BLOCK_N=block_n)
    return q, (q_t if transposed else None), (partials.amax() if with_amax else None)
