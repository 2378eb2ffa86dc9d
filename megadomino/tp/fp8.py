"""FP8 GEMMs for the tensor-parallel linears: e4m3 forward, e5m2 (hybrid) or e4m3 gradients,
per-tensor scales, through `torch._scaled_mm`.

    y  [M, N] = x [M, K] @ W^T            x, W in e4m3
    dx [M, K] = g [M, N] @ W [N, K]       g in e5m2 (--fp8-format hybrid) or e4m3 (e4m3)
    dW [N, K] = g^T [N, M] @ x [M, K]     bias and its gradient stay in high precision

A tensor t is quantized as q = clamp(t * scale, +-max).to(fp8) (saturating) and stands for
q / scale; `_scaled_mm` takes the inverse scales and accumulates in fp32. Its layout rules: first
operand row-major, second column-major, every dim of both (M, K, N) a multiple of 16. The rule for
other shapes: the operands are quantized exactly as on the FP8 path and multiplied dequantized in
fp32 (the same numbers through the high-precision GEMM), with a warning once per shape. The choice
is made per GEMM call, since M is the call's token count. The quantized x and W are what backward
keeps (1 byte an element); the master weights are untouched (fp32, or bf16 parameters with fp32
masters in the optimizer).

Scaling recipes, per tensor role (input, weight, output gradient):
    tensorwise  current scaling: scale = max / amax of the tensor being cast, this rank's shard
                (no collective: at TP > 1 a sharded weight or input gets per-shard scales, so
                results differ from TP = 1 by rounding of the same size as FP8's own error).
    delayed     Megatron-LM's default: a step casts with the scale computed before it and records
                its amax in an amax history of --fp8-amax-history-len steps. At the start of each
                training forward (grad enabled; no-grad forwards cast and record nothing), the
                previous step's amaxes are max-all-reduced over the TP group (one 3-float
                all-reduce per linear and step, so every TP rank casts with the scales of the
                whole tensor, as at TP = 1); after every --fp8-interval steps, scale = max / amax
                / 2^margin where amax is the history's max (max) or its newest entry
                (most_recent), kept when amax is 0 or not finite; then the history rolls. Each
                data-parallel rank keeps its own state (no DP reduction). The state is module
                buffers (FP8State), saved per rank in checkpoints, so a run resumes exactly. A
                re-run forward (full activation recompute) would advance it twice, so that
                combination is refused in config.

With ZeRO's --fp8-param-gather the weight arrives as e4m3 codes with its scale
(zero/fp8_gather.py: each DP rank casts its part with the scale of the whole weight's amax,
max-reduced over DP), handed over in `FP8State.gathered_weight`: the GEMMs take them as they are
(the transposed copy backward needs is made from them), and the weight's own amax and cast are
skipped. Without them (before the first gather) the weight takes current scaling under either
recipe (`FP8State.weight_current_scaling`), which gives the same codes and scale.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from megadomino.config.train import E4M3, E5M2, FP8Recipe
from megadomino.distributed import comm
from megadomino.kernels.fp8_cast import cast_transpose

FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344
INPUT, WEIGHT, GRAD = 0, 1, 2
"""Tensor roles: the columns of FP8State's amax history and scales."""

_warned_shapes: set[tuple[int, int, int]] = set()


def quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * scale, saturated to dtype's range, in the FP8 dtype (rounded to nearest). The fp32
    copy of t is scaled and clamped in place, so one fp32 copy is alive at a time, not two (the
    eager cast's transient is then 4 bytes an element of t, beside its 1-byte result)."""
    limit = FP8_MAX[dtype]
    return t.to(torch.float32, copy=True).mul_(scale).clamp_(-limit, limit).to(dtype)


def cast_operand(t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                 transposed: bool, with_amax: bool):
    """One operand's cast, 2-D t: (quantize(t, scale), its transpose made contiguous or None
    unless `transposed`, the scale, amax(|t|) or None unless `with_amax`). scale None: current
    scaling, max / amax(|t|) (1 for an all-zero tensor)."""
    amax = t.abs().amax().float() if with_amax or scale is None else None
    if scale is None:
        scale = _scale_of(amax, dtype)
    q = quantize(t, scale, dtype)
    return q, (q.t().contiguous() if transposed else None), scale, amax


def fused_cast(t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
               transposed: bool, with_amax: bool):
    """cast_operand as one Triton kernel that reads t once (kernels/fp8_cast.py: the cast, the
    transposed copy and the amax together; bit-identical). Current scaling needs the amax
    before the cast: it is taken first, by torch."""
    amax = None
    if scale is None:
        amax = t.abs().amax().float()
        scale, with_amax = _scale_of(amax, dtype), False
    q, q_t, fused_amax = cast_transpose(t.contiguous(), scale, dtype, transposed, with_amax)
    return q, q_t, scale, fused_amax if amax is None else amax


@functools.cache
def _compiled_cast():
    """cast_operand compiled (one wrapper for the process, compiled per shape and flags)."""
    return torch.compile(cast_operand, dynamic=False)


def close_step(history: torch.Tensor, scale: torch.Tensor, steps: torch.Tensor,
               fp8_max: torch.Tensor, margin: int, interval: int, use_max: bool) -> None:
    """FP8State.begin_step's update, in place: every `interval` steps scale = fp8_max / amax /
    2^margin (amax: the history's max if `use_max`, else its newest row; the scale kept where
    amax is 0 or not finite), then the history rolls one row and `steps` counts one."""
    amax = history.amax(0) if use_max else history[0]
    fresh = fp8_max / amax / 2.0**margin
    fresh = torch.where((amax > 0) & torch.isfinite(amax), fresh, scale)
    due = (steps > 0) & (steps % interval == 0)
    scale.copy_(torch.where(due, fresh, scale))
    history.copy_(history.roll(1, 0))
    history[0].zero_()
    steps += 1


@functools.cache
def _compiled_close_step():
    """close_step compiled (one wrapper for the process)."""
    return torch.compile(close_step, dynamic=False)


def current_scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """max / amax(t), fp32 scalar (1 for an all-zero tensor)."""
    return _scale_of(t.abs().amax().float(), dtype)


def _scale_of(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(amax > 0, FP8_MAX[dtype] / amax, torch.ones_like(amax))


class FP8State(nn.Module):
    """One linear's scaling state. Under `delayed` it holds the buffers `amax_history`
    [history_len, 3] (row 0: the current step), `scale` [3] and `steps` (training forwards so
    far), columns INPUT, WEIGHT, GRAD; under `tensorwise` it holds nothing. `amax_group`: the
    process group (TP) whose ranks' amaxes a delayed step max-reduces; None for none."""

    def __init__(self, recipe: FP8Recipe, device=None, amax_group=None, compiled: bool = False):
        super().__init__()
        self.recipe, self.amax_group, self.compiled = recipe, amax_group, compiled
        self.weight_current_scaling = False
        """Set by ZeRO's FP8 parameter gather: the WEIGHT role is cast with current scaling."""
        self.gathered_weight: tuple[torch.Tensor, torch.Tensor] | None = None
        """Set by ZeRO's FP8 parameter gather while the weight is gathered: (its e4m3 codes, in
        the weight's shape, the inverse of their scale), which the GEMMs take instead of a
        cast."""
        if recipe.recipe == "delayed":
            self.register_buffer("amax_history",
                                 torch.zeros(recipe.amax_history_len, 3, device=device))
            self.register_buffer("scale", torch.ones(3, device=device))
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64, device=device))
            limits = [FP8_MAX[E4M3], FP8_MAX[E4M3], FP8_MAX[recipe.grad_dtype]]
            self.register_buffer("fp8_max", torch.tensor(limits, device=device),
                                 persistent=False)

    @torch.no_grad()
    def begin_step(self) -> None:
        """Delayed: close the previous step (scales updated every `interval` steps, history
        rolled) and count this one. Device-side only: no host synchronization. With compiled
        pieces the closing is one compiled function (a few kernels, not one per operation: it
        runs for every linear at every training forward)."""
        recipe = self.recipe
        history = self.amax_history
        if self.amax_group is not None:
            newest = history[0].clone()
            comm.all_reduce(newest, op=comm.ReduceOp.MAX, group=self.amax_group)
            history[0] = newest
        close = _compiled_close_step() if self.compiled else close_step
        close(history, self.scale, self.steps, self.fp8_max, recipe.margin, recipe.interval,
              recipe.amax_compute_algo == "max")

    @torch.no_grad()
    def scale_for(self, role: int, t: torch.Tensor, record: bool) -> torch.Tensor:
        """The scale that casts `t` in `role` this step (a fresh fp32 scalar); under delayed,
        `record` writes t's amax into the current history row."""
        dtype = self.recipe.grad_dtype if role == GRAD else E4M3
        if not self._delayed(role):
            return current_scale(t, dtype)
        if record:
            self.amax_history[0, role] = t.abs().amax().float()
        return self.scale[role].clone()

    def _delayed(self, role: int) -> bool:
        return self.recipe.recipe == "delayed" and not (
            role == WEIGHT and self.weight_current_scaling)

    def cast(self, role: int, t: torch.Tensor, record: bool,
             transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(t in FP8, its contiguous transpose or None, the inverse scale) for 2-D t in `role`,
        scaled and recorded as scale_for says, amax and cast in one (compiled) function."""
        dtype = self.recipe.grad_dtype if role == GRAD else E4M3
        delayed = self._delayed(role)
        fn = cast_operand
        if self.compiled:
            fn = fused_cast if t.is_cuda else _compiled_cast()
        q, q_t, scale, amax = fn(t, self.scale[role] if delayed else None, dtype, transposed,
                                 delayed and record)
        if delayed and record:
            self.amax_history[0, role] = amax
        return q, q_t, scale.reciprocal()


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a / a_scale) @ (b / b_scale) (+ bias [N]) for FP8 a [M, K] row-major and b [K, N]
    column-major (the casts write them so), in out_dtype. `_scaled_mm` where M, K and N are
    multiples of 16 (the bias added in its epilogue, before the one rounding to a 16-bit
    out_dtype; after it for fp32, which the epilogue does not take), else the dequantized fp32
    GEMM."""
    (m, k), n = a.shape, b.shape[1]
    if bias is not None:
        bias = bias.to(out_dtype)
    if m % 16 == 0 and k % 16 == 0 and n % 16 == 0:
        if out_dtype == torch.float32 and bias is not None:  # CUDA's epilogue: 16-bit outputs
            return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv,
                                    out_dtype=out_dtype) + bias
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, bias=bias,
                                out_dtype=out_dtype)
    if (m, k, n) not in _warned_shapes:
        _warned_shapes.add((m, k, n))
        warnings.warn(f"FP8 GEMM [{m}, {k}] x [{k}, {n}]: a dim is not a multiple of 16, so "
                      "torch._scaled_mm cannot run it; the quantized operands are multiplied "
                      "in fp32 instead", stacklevel=2)
    product = (a.float() * a_inv) @ (b.float() * b_inv)
    return (product if bias is None else product + bias.float()).to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs in FP8 (module docstring). x [..., K], W [N, K]."""

    @staticmethod
    def forward(ctx, x, weight, bias, state, record):
        x_2d = x.reshape(-1, x.shape[-1])
        if record and state.recipe.recipe == "delayed":
            state.begin_step()
        # dW needs x as a second operand (column-major: x's transpose), dx needs W's
        x_q, x_t, x_inv = state.cast(INPUT, x_2d, record, transposed=ctx.needs_input_grad[1])
        if state.gathered_weight is not None:  # cast by ZeRO's FP8 parameter gather
            w_q, w_inv = state.gathered_weight
            w_t = w_q.t().contiguous() if ctx.needs_input_grad[0] else None
        else:
            w_q, w_t, w_inv = state.cast(WEIGHT, weight, record,
                                         transposed=ctx.needs_input_grad[0])
        y = scaled_matmul(x_q, w_q.t(), x_inv, w_inv, x.dtype, bias)
        ctx.save_for_backward(x_t, w_t, x_inv, w_inv)
        ctx.state, ctx.record = state, record
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_t, w_t, x_inv, w_inv = ctx.saved_tensors
        state = ctx.state
        g_2d = grad_out.reshape(-1, grad_out.shape[-1])
        g_q, g_t, g_inv = state.cast(GRAD, g_2d, ctx.record,
                                     transposed=ctx.needs_input_grad[1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_matmul(g_q, w_t.t(), g_inv, w_inv, ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_matmul(g_t, x_t.t(), g_inv, x_inv, ctx.w_dtype)
        if ctx.needs_input_grad[2]:
            grad_b = g_2d.sum(dim=0)
        return grad_x, grad_w, grad_b, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: FP8State) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias [N] -> [..., N] with FP8 GEMMs (module docstring).
    A call with grad enabled is a training step: under delayed it advances `state`."""
    return _FP8Linear.apply(x, weight, bias, state, torch.is_grad_enabled())


def fp8_states(model: nn.Module) -> dict[str, FP8State]:
    """Every FP8State of `model`, by module name (what checkpoints save)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, FP8State)}
