"""AdamW over one flat fp32 master in one pass (the ZeRO engine's optimizer step on CUDA,
megadomino/zero/sharded.py): each element's gradient, moments and master read once, the master,
moments and the model's bf16 copy written once.

    adamw_flat(master, grad, exp_avg, exp_avg_sq, group, lr, weight_decay, beta1, beta2, eps,
               step, inv_scale, skip, weights)

The math is torch's AdamW (its fused kernel's formula), `adamw_flat_reference` below: `group`
[n] (uint8) picks each element's `lr` and `weight_decay` from the groups' [G] tensors; gradients
are multiplied by `inv_scale` (clipping) as they are read; `step` is the step number after this
one (0-dim); where `skip` (0-dim, nonzero) nothing is read or written; `weights`, when given,
receives the updated master in its dtype. All scalars are read on the device, so a step is
enqueued without the host reading anything.

Why a kernel of our own: torch.compile's kernel of the reference gathers each element's rate
from the [G] tensors by its index; here each element picks among the G scalars, loaded once per
program (benchmarks/bench_optimizer.py). A CPU tensor runs the reference unless
`force_triton=True` (Triton's interpreter, TRITON_INTERPRET=1 before triton is imported; it
rounds the bf16 copy toward zero, the GPU to nearest).
"""

from __future__ import annotations

import math

import torch

from megadomino.kernels.quant_launch import tl, triton, use_triton


@triton.jit
def _adamw_flat_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, group_ptr,
                       weights_ptr, lr_ptr, wd_ptr, step_ptr, scale_ptr, skip_ptr, n,
                       beta1, beta2, log_beta1, log_beta2, eps,
                       BLOCK: tl.constexpr, GROUPS: tl.constexpr, HAS_WEIGHTS: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < tl.where(tl.load(skip_ptr) == 0, n, 0)  # a skipped step: no element
    step = tl.load(step_ptr)
    bias1 = 1.0 - tl.exp(step * log_beta1)  # 1 - beta1 ** step
    bias2_sqrt = tl.sqrt(1.0 - tl.exp(step * log_beta2))
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * tl.load(scale_ptr)
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
    p = tl.load(master_ptr + offsets, mask=mask, other=0.0)
    index = tl.load(group_ptr + offsets, mask=mask, other=0)
    lr = tl.zeros_like(g) + tl.load(lr_ptr)
    wd = tl.zeros_like(g) + tl.load(wd_ptr)
    for k in tl.static_range(1, GROUPS):
        lr = tl.where(index == k, tl.load(lr_ptr + k), lr)
        wd = tl.where(index == k, tl.load(wd_ptr + k), wd)
    weight = 1.0 - beta1  # torch.lerp(m, g, weight), in its two forms
    m = tl.where(weight < 0.5, m + weight * (g - m), g - (g - m) * (1.0 - weight))
    v = v * beta2 + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias2_sqrt + eps
    p = p * (1.0 - lr * wd) - lr / bias1 * m / denom
    tl.store(master_ptr + offsets, p, mask=mask)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    if HAS_WEIGHTS:
        rounded = p.to(weights_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(weights_ptr + offsets, rounded, mask=mask)


def _log(beta: float) -> float:
    """log(beta), for beta ** step = exp(step * log(beta)); beta 0 gives 0 ** step = 0."""
    return math.log(beta) if beta > 0 else -math.inf


def adamw_flat_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                         exp_avg_sq: torch.Tensor, group: torch.Tensor, lr: torch.Tensor,
                         weight_decay: torch.Tensor, beta1: float, beta2: float, eps: float,
                         step: torch.Tensor, inv_scale: torch.Tensor, skip: torch.Tensor,
                         weights: torch.Tensor | None) -> None:
    """The torch definition (module docstring)."""
    g = grad.float() * inv_scale
    m = torch.lerp(exp_avg, g, 1 - beta1)
    v = exp_avg_sq * beta2 + (1 - beta2) * g * g
    index = group.long()
    rate = lr[index]
    bias2_sqrt = torch.sqrt(1 - beta2 ** step)
    denom = torch.sqrt(v) / bias2_sqrt + eps
    p = master * (1 - rate * weight_decay[index]) - rate / (1 - beta1 ** step) * m / denom
    keep = skip != 0
    master.copy_(torch.where(keep, master, p))
    exp_avg.copy_(torch.where(keep, exp_avg, m))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, v))
    if weights is not None:
        weights.copy_(master)


def adamw_flat(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, group: torch.Tensor, lr: torch.Tensor,
               weight_decay: torch.Tensor, beta1: float, beta2: float, eps: float,
               step: torch.Tensor, inv_scale: torch.Tensor, skip: torch.Tensor,
               weights: torch.Tensor | None, force_triton: bool = False,
               block: int = 1024, num_warps: int = 8) -> None:
    """The module docstring's update, in place. `block` elements a program of `num_warps`
    warps: 1024-element blocks were the fastest size in `bench_optimizer.py --sweep`, 4 and 8
    warps within 1% of each other."""
    n = master.numel()
    tensors = (master, grad, exp_avg, exp_avg_sq, group) + ((weights,) if weights is not None
                                                            else ())
    if any(t.numel() != n or not t.is_contiguous() for t in tensors):
        raise ValueError("adamw_flat needs contiguous flat tensors of one length: got "
                         f"{[tuple(t.shape) for t in tensors]}")
    if not use_triton(master, force_triton, "AdamW's flat step"):
        adamw_flat_reference(master, grad, exp_avg, exp_avg_sq, group, lr, weight_decay, beta1,
                             beta2, eps, step, inv_scale, skip, weights)
        return
    _adamw_flat_kernel[(triton.cdiv(n, block),)](
        master, grad, exp_avg, exp_avg_sq, group, master if weights is None else weights, lr,
        weight_decay, step.reshape(()), inv_scale.reshape(()).float(), skip.reshape(()), n,
        beta1, beta2, _log(beta1), _log(beta2), eps, BLOCK=block, GROUPS=lr.numel(),
        HAS_WEIGHTS=weights is not None, num_warps=num_warps)
