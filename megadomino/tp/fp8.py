"""FP8 GEMMs for the tensor-parallel linears: e4m3 forward, e5m2 (hybrid) or e4m3 gradients,
per-tensor scales, through `torch._scaled_mm`. Which of a layer's linears run them is the
recipe's (FP8Recipe.linears and Megatron's first / last layers in bf16, applied where the layers
are built, models/blocks.py and transformer.py; --fp8-linears auto times them at start-up,
train/fp8_linears.py); the others are plain linears in the model's dtype.

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
(their transposed copy, which backward needs, is made once per gather, at the first forward that
needs it), and the weight's own amax and cast are skipped. Without them (before the first gather)
the weight takes current scaling under either recipe (`FP8State.weight_current_scaling`), which
gives the same codes and scale.

The weight's cast is made once per weight value and reused by the step's later micro-batches
(`FP8State.cast_weight`): codes, transposed copy, inverse scale and amax stay valid while the
weight is the same tensor at the same version counter and storage (in-place updates bump it; so
does ZeRO where it writes parameters through flat buffers, zero/params.py) and, under delayed,
while scale[WEIGHT] is provably the one they were made with. That scale can change within a step:
begin_step runs at every training forward (micro-batch), and a due update recomputes it from the
history rows of the forwards before, so a step's first micro-batch casts with a scale from the
previous weight's amax, its second from the current one's. The host follows which weight value
each newest history row was recorded from, and keeps an update's scale as known only when every
row it reads (most_recent: the newest; max: all) is of the value the last due update read: the
same amax then gives the same scale (or the scale is kept). A reusing forward still records the
weight's amax, so the history and all scales are those of casting every time, bit for bit. Casts
per step of M micro-batches: 1 under tensorwise, 2 under delayed's defaults (history 1,
most_recent, interval 1), up to min(M, history_len + 1) under `max`. This assumes a linear's TP
peers change their weight shards when it does (they step together). The codes take 2 bytes per
weight element from the first forward on; nothing of them is saved, load_state_dict drops them.

Under CUDA graphs (`--enable-cuda-graph`, overlap/cuda_graph.py) the host's bookkeeping runs only
while the layers are captured, not at the replays, so a captured linear casts its weight at every
call (`FP8State.cache_weight` False: one cast kernel per weight and micro-batch, a few
microseconds on the GPU). Everything else is device-side already: the steps' closing, the scales
read from their buffers, the amaxes written into the history, the TP amax all-reduce.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch
from torch import nn

from megadomino.config.train import E4M3, E5M2, FP8Recipe
from megadomino.distributed import comm
from megadomino.kernels.fp8_cast import cast_transpose
from megadomino.tp.wgrad import defer_or_compute

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


class _WeightCodes(NamedTuple):
    """A weight's cast (FP8State.cast_weight): for weight value `value` with the WEIGHT scale that
    `scale_key` names (None: current scaling); `q_t` and `amax` None until a forward needs them."""

    value: int
    scale_key: int | None
    q: torch.Tensor
    q_t: torch.Tensor | None
    inverse: torch.Tensor
    amax: torch.Tensor | None


class FP8State(nn.Module):
    """One linear's scaling state. Under `delayed` it holds the buffers `amax_history`
    [history_len, 3] (row 0: the current step), `scale` [3] and `steps` (training forwards so
    far), columns INPUT, WEIGHT, GRAD; under `tensorwise` it holds nothing. `amax_group`: the
    process group (TP) whose ranks' amaxes a delayed step max-reduces; None for none.

    Beside the buffers the host keeps the weight's cached cast and what it knows of the WEIGHT
    scale's provenance (module docstring): never saved, dropped by load_state_dict. Only
    begin_step, the casts and load_state_dict write the buffers."""

    def __init__(self, recipe: FP8Recipe, device=None, amax_group=None, compiled: bool = False):
        super().__init__()
        self.recipe, self.amax_group, self.compiled = recipe, amax_group, compiled
        self.weight_current_scaling = False
        """Set by ZeRO's FP8 parameter gather: the WEIGHT role is cast with current scaling."""
        self.cache_weight = True
        """Whether the weight's cast is reused while it provably holds (cast_weight); cleared
        for linears captured in CUDA graphs, whose replays run none of the host's checks."""
        self.gathered_weight = None
        if recipe.recipe == "delayed":
            self.register_buffer("amax_history",
                                 torch.zeros(recipe.amax_history_len, 3, device=device))
            self.register_buffer("scale", torch.ones(3, device=device))
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64, device=device))
            limits = [FP8_MAX[E4M3], FP8_MAX[E4M3], FP8_MAX[recipe.grad_dtype]]
            self.register_buffer("fp8_max", torch.tensor(limits, device=device),
                                 persistent=False)
        self._values = self._scale_key = 0
        self._forget(steps=0)

    @property
    def gathered_weight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Set by ZeRO's FP8 parameter gather while the weight is gathered: (its e4m3 codes, in
        the weight's shape, the inverse of their scale), which the GEMMs take instead of a
        cast."""
        return self._gathered_weight

    @gathered_weight.setter
    def gathered_weight(self, gathered: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._gathered_weight, self._gathered_t = gathered, None

    def gathered_transpose(self) -> torch.Tensor:
        """The gathered codes' contiguous transpose (backward's dx operand), made once per
        gathered value: setting gathered_weight drops it."""
        if self._gathered_t is None:
            self._gathered_t = self._gathered_weight[0].t().contiguous()
        return self._gathered_t

    def _forget(self, steps: int) -> None:
        """Drop the host's cached codes and what it knows of the history (all rows of unknown
        origin, the WEIGHT scale of a new provenance); `steps`: the `steps` buffer's value."""
        self._codes: _WeightCodes | None = None
        self._seen: tuple[torch.Tensor, int, int] | None = None
        self._pending: int | None = None  # the weight value the current row records
        self._streak_value: int | None = None  # the newest closed rows' weight value...
        self._streak = 0  # ...and how many rows in a row, from the newest, hold it
        self._scale_source: int | None = None  # the value the last due update read, if one
        self._scale_key += 1
        self._steps_seen = steps

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._forget(int(self.steps) if self.recipe.recipe == "delayed" else 0)

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
        self._close_on_host()

    def _close_on_host(self) -> None:
        """close_step's effect on scale[WEIGHT] as far as the host can tell: a due update that
        reads only rows of the weight value the last due update read leaves the scale as it was
        (the same amax gives the same scale, or the scale is kept); any other due update gives
        it a new key."""
        recipe = self.recipe
        closed, self._pending = self._pending, None
        if closed is not None and closed == self._streak_value:
            self._streak += 1
        else:
            self._streak_value, self._streak = closed, int(closed is not None)
        steps, self._steps_seen = self._steps_seen, self._steps_seen + 1
        if steps > 0 and steps % recipe.interval == 0:
            read = recipe.amax_history_len if recipe.amax_compute_algo == "max" else 1
            source = self._streak_value if self._streak >= read else None
            if source is None or source != self._scale_source:
                self._scale_key += 1
            self._scale_source = source

    @torch.no_grad()
    def scale_for(self, role: int, t: torch.Tensor, record: bool) -> torch.Tensor:
        """The scale that casts `t` in `role` this step (a fresh fp32 scalar); under delayed,
        `record` writes t's amax into the current history row."""
        dtype = self.recipe.grad_dtype if role == GRAD else E4M3
        if not self._delayed(role):
            return current_scale(t, dtype)
        if record:
            self._record(role, t.abs().amax().float())
        return self.scale[role].clone()

    def _delayed(self, role: int) -> bool:
        return self.recipe.recipe == "delayed" and not (
            role == WEIGHT and self.weight_current_scaling)

    def _record(self, role: int, amax: torch.Tensor, value: int | None = None) -> None:
        """amax into the current history row; for WEIGHT, `value`: the weight value it is of
        (None: not known to the host)."""
        self.amax_history[0, role] = amax
        if role == WEIGHT:
            self._pending = value

    def _cast_fn(self, t: torch.Tensor):
        if self.compiled:
            return fused_cast if t.is_cuda else _compiled_cast()
        return cast_operand

    def cast(self, role: int, t: torch.Tensor, record: bool,
             transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(t in FP8, its contiguous transpose or None, the inverse scale) for 2-D t in `role`,
        scaled and recorded as scale_for says, amax and cast in one (compiled) function."""
        dtype = self.recipe.grad_dtype if role == GRAD else E4M3
        delayed = self._delayed(role)
        q, q_t, scale, amax = self._cast_fn(t)(t, self.scale[role] if delayed else None, dtype,
                                               transposed, delayed and record)
        if delayed and record:
            self._record(role, amax)
        return q, q_t, scale.reciprocal()

    def cast_weight(self, weight: torch.Tensor, record: bool,
                    transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """cast(WEIGHT, weight, record, transposed), made once per weight value and WEIGHT scale
        and reused after (module docstring); a recording call under delayed writes the weight's
        amax into the history all the same."""
        if not self.cache_weight:
            return self.cast(WEIGHT, weight, record, transposed)
        delayed = self._delayed(WEIGHT)
        value = self._weight_value(weight)
        key = (value, self._scale_key if delayed else None)
        codes = self._codes
        if codes is None or (codes.value, codes.scale_key) != key:
            q, q_t, scale, amax = self._cast_fn(weight)(
                weight, self.scale[WEIGHT] if delayed else None, E4M3, transposed,
                delayed and record)
            codes = _WeightCodes(*key, q, q_t, scale.reciprocal(), amax)
        if transposed and codes.q_t is None:
            codes = codes._replace(q_t=codes.q.t().contiguous())
        if delayed and record and codes.amax is None:
            codes = codes._replace(amax=weight.detach().abs().amax().float())
        self._codes = codes
        if delayed and record:
            self._record(WEIGHT, codes.amax, value)
        return codes.q, codes.q_t if transposed else None, codes.inverse

    def _weight_value(self, weight: torch.Tensor) -> int:
        """A number for `weight`'s value: the same while it is the same tensor at the same
        version counter and storage, a new one (never given before) otherwise."""
        seen = (weight, weight._version, weight.data_ptr())
        if self._seen is None or self._seen[0] is not weight or self._seen[1:] != seen[1:]:
            self._seen = seen
            self._values += 1
        return self._values


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
            w_t = state.gathered_transpose() if ctx.needs_input_grad[0] else None
        else:
            w_q, w_t, w_inv = state.cast_weight(weight, record,
                                                transposed=ctx.needs_input_grad[0])
        y = scaled_matmul(x_q, w_q.t(), x_inv, w_inv, x.dtype, bias)
        ctx.save_for_backward(x_t, w_t, x_inv, w_inv)
        ctx.state, ctx.record, ctx.weight = state, record, weight
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
        if ctx.needs_input_grad[1]:  # deferred to W under a split backward (tp/wgrad.py)
            grad_w = defer_or_compute(ctx, ctx.weight, lambda dtype=ctx.w_dtype: scaled_matmul(
                g_t, x_t.t(), g_inv, x_inv, dtype))
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
