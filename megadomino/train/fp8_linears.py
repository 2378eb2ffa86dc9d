"""`--fp8-linears auto`: which of a transformer layer's linears run FP8, timed at start-up.

A linear's FP8 GEMMs win only where the GEMM is large enough to pay for its operands' casts, the
transposed copies backward needs, and the scaling bookkeeping (amaxes, the delayed recipe's
history and its TP max-reduce). So before the model is built each role of FP8_ROLES (qkv, proj,
fc1, fc2) is timed at this run's shapes, forward + backward (dx and dW), as the layer runs it:

    tokens M = micro-batch x seq-length (the column-parallel linears cast the input after its
    sequence-parallel gather, and the row-parallel ones multiply before their reduce-scatter:
    every GEMM of the layer sees all M tokens), K and N this rank's TP shard of the weight, no
    bias (the two sides would add it alike);
    bf16: torch's F.linear in the model's dtype;
    FP8:  tp.fp8.fp8_linear with an FP8State of the run's recipe (casts, transposes, amaxes and,
          under delayed, the step's closing and TP amax all-reduce included), its weight cast
          once per `min(micro-batches a step, 8)` calls, as a step's micro-batches reuse it;
    with --enable-cuda-graph both sides are timed as the graphs run them: forward and backward
          captured and replayed, the weight cast at every call, the host's launches out of the
          time (eager, an FP8 linear's dozens of launches are what its time measures at these
          shapes).

The roles are timed in interleaved passes, the median of each, the slowest rank's time
(overlap.domino.autotune's start-up timer, as --domino's plans are). The rule: a role runs FP8
where its FP8 time is at most RULE (0.98) x its bf16 time, so FP8 is kept only where it is
measurably faster; rank 0 decides and broadcasts, so every rank builds the same model. The
config that runs (and the model, whose FP8 linears its checkpoints' scaling states record)
names the chosen roles; `--first-last-layers-bf16` applies on top. One start-up line gives the
choice and every time compared (LinearTimes.line).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megadomino.config import Config, FP8Recipe, ModelConfig
from megadomino.config.train import FP8_AUTO, FP8_ROLES
from megadomino.distributed import comm
from megadomino.models.blocks import DTYPES
from megadomino.overlap.cuda_graph import capture
from megadomino.overlap.domino.autotune import interleaved_medians, time_step
from megadomino.tp.fp8 import FP8State, fp8_linear

RULE = 0.98
"""A role runs FP8 where its FP8 time is at most this fraction of its bf16 time."""
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def calls_per_cast(micro_batches: int) -> int:
    """How many calls the timed FP8 linear reuses a weight cast for: a step's micro-batches on a
    rank, at most 8 (a pass of whole steps stays short)."""
    return max(1, min(micro_batches, 8))


def role_shapes(model: ModelConfig, tp: int, tokens: int) -> dict[str, tuple[int, int, int]]:
    """Each role's GEMM (M, K, N) on one TP rank: y [M, N] = x [M, K] @ W^T, W this rank's
    shard [N, K]; `tokens`: M."""
    hidden, ffn = model.hidden_size, model.ffn_hidden_size
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * model.kv_channels
    attention = model.num_attention_heads * model.kv_channels
    stripes = 2 if model.swiglu else 1  # SwiGLU's fc1 holds [gate; up]
    return {"qkv": (tokens, hidden, qkv // tp), "proj": (tokens, attention // tp, hidden),
            "fc1": (tokens, hidden, stripes * ffn // tp), "fc2": (tokens, ffn // tp, hidden)}


def choose(bf16_ms: Sequence[float], fp8_ms: Sequence[float]) -> tuple[str, ...]:
    """The roles of FP8_ROLES (times in that order) whose FP8 time is at most RULE x bf16's."""
    return tuple(role for role, high, low in zip(FP8_ROLES, bf16_ms, fp8_ms)
                 if low <= RULE * high)


@dataclasses.dataclass(frozen=True)
class LinearTimes:
    """What auto timed and chose, the same on every rank."""

    shapes: tuple[tuple[int, int, int], ...]
    """Per role of FP8_ROLES: (M, K, N) on this rank (rank 0's, in the line)."""
    bf16_ms: tuple[float, ...]
    fp8_ms: tuple[float, ...]
    """Per role: ms of one forward + backward, median of the passes, MAX over the world."""
    chosen: tuple[str, ...]
    """The roles that run FP8 (rank 0's decision, broadcast)."""
    passes: int
    dtype: str = "bf16"
    """The model's dtype, the high-precision side ('bf16', 'fp16' or 'fp32')."""
    graphed: bool = False
    """Timed as CUDA-graph replays (--enable-cuda-graph: the host's launches drop out)."""

    def line(self) -> str:
        """'fp8 linears auto: FP8 in <roles>, <dtype> in <roles> (...): <every role's times>'."""
        kept = [role for role in FP8_ROLES if role not in self.chosen]
        choice = f"FP8 in {', '.join(self.chosen) or 'none'}" + (
            f", {self.dtype} in {', '.join(kept)}" if kept else "")
        rows = ", ".join(
            f"{role} [{m}x{k}x{n}] {self.dtype} {high:.3f} ms, FP8 {low:.3f} ms "
            f"({low / high:.2f}x)"
            for role, (m, k, n), high, low in zip(FP8_ROLES, self.shapes, self.bf16_ms,
                                                  self.fp8_ms))
        return (f"fp8 linears auto: {choice} (FP8 where it takes at most {RULE}x "
                f"{self.dtype}'s time); timed each GEMM's forward+backward [MxKxN]"
                f"{' as CUDA-graph replays' if self.graphed else ''}, median of "
                f"{self.passes} passes, slowest rank: {rows}")


class _RoleLinear(nn.Module):
    """One role's linear: F.linear in the model's dtype, or fp8_linear with `state`."""

    def __init__(self, weight: torch.Tensor, state: FP8State | None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            return F.linear(x, self.weight)
        return fp8_linear(x, self.weight, None, self.state)


def role_case(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
              recipe: FP8Recipe | None, fp8_state: Callable[[], FP8State], per_step: int,
              generator: torch.Generator, graphed: bool = False):
    """One role's timed case in bf16 (`recipe` None) or FP8: (linear, x, grad, iters) for
    time_step(linear, x, grad, None, per_step, iters), a pass of whole steps. Eager, the weight is
    cast once per `per_step` calls, as a step's micro-batches reuse it; `graphed` (CUDA), the
    forward and backward are captured (overlap/cuda_graph.capture) and replayed, the weight cast
    at every call, as --enable-cuda-graph runs the layers."""
    m, k, n = shape
    x = torch.randn(m, k, device=device, dtype=dtype, generator=generator).requires_grad_()
    module = _RoleLinear(torch.randn(n, k, device=device, dtype=dtype, generator=generator) * 0.02,
                         fp8_state() if recipe is not None else None)
    grad = torch.randn(m, n, device=device, dtype=dtype, generator=generator)
    iters = per_step * math.ceil(4 / per_step)
    weight, state = module.weight, module.state
    if graphed:
        if state is not None:
            state.cache_weight = False
        replay = capture(module, (x,), warmup=2,
                         buffers=list(state.buffers()) if state is not None else [])

        def graphed_linear(x: torch.Tensor, _rotary) -> torch.Tensor:
            weight.grad = None
            return replay(x)

        return graphed_linear, x, grad, iters
    calls = [0]

    def linear(x: torch.Tensor, _rotary) -> torch.Tensor:
        weight.grad = None
        if state is not None and calls[0] % per_step == 0:  # a step's first micro-batch: a new
            torch.autograd.graph.increment_version(weight)  # weight value to cast
        calls[0] += 1
        return module(x)

    return linear, x, grad, iters


def _timer(case, per_step: int) -> Callable[[], float]:
    """One pass of role_case's `case`: ms per forward + backward."""
    linear, x, grad, iters = case
    return lambda: time_step(linear, x, grad, None, per_step, iters)


def time_linears(config: Config, dims, micro_batches: int, device: torch.device,
                 rounds: int = 3) -> LinearTimes:
    """Time every role in bf16 and in FP8 (module docstring) and choose. A collective over the
    world: every rank calls it."""
    model, fp8 = config.model, config.train.precision.fp8
    tokens = config.train.schedule.micro_batch_size * model.seq_length
    shapes = role_shapes(model, dims.tp, tokens)
    dtype = DTYPES[model.params_dtype]
    amax_group = dims.tp_group if dims.tp > 1 else None  # as the layers' FP8States reduce

    def fp8_state() -> FP8State:
        return FP8State(fp8, device, amax_group, config.parallel.compile_layer_pieces)

    generator = torch.Generator(device=device).manual_seed(1234)  # not the model's generator
    per_step = calls_per_cast(micro_batches)
    graphed = config.parallel.enable_cuda_graph and device.type == "cuda"
    timers = [_timer(role_case(shapes[role], dtype, device, recipe, fp8_state, per_step,
                               generator, graphed), per_step)
              for role in FP8_ROLES for recipe in (None, fp8)]
    measured = interleaved_medians(timers, rounds, device, dims.world_size).tolist()
    bf16_ms, fp8_ms = measured[0::2], measured[1::2]
    chosen = torch.tensor([role in choose(bf16_ms, fp8_ms) for role in FP8_ROLES],
                          dtype=torch.int32, device=device)
    if dims.world_size > 1:
        comm.broadcast(chosen, src=0)
    return LinearTimes(tuple(shapes[role] for role in FP8_ROLES), tuple(bf16_ms), tuple(fp8_ms),
                       tuple(role for role, on in zip(FP8_ROLES, chosen.tolist()) if on),
                       rounds, DTYPE_NAMES[model.params_dtype], graphed)


def resolve_fp8_linears(config: Config, dims, micro_batches: int, log: Callable[[str], None],
                        device: torch.device | None = None) -> Config:
    """`config` with --fp8-linears auto replaced by the roles time_linears chose (rank 0 logs
    its line); any other config as it is. `micro_batches`: a step's micro-batches on a rank;
    `device`: where the model will be (default: the current CUDA device, else the CPU, as
    build_stage places it). A collective over the world under auto."""
    fp8 = config.train.precision.fp8
    if fp8 is None or fp8.linears != FP8_AUTO:
        return config
    if device is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timed = time_linears(config, dims, micro_batches, device)
    if dims.rank == 0:
        log(timed.line())
    precision = dataclasses.replace(config.train.precision,
                                    fp8=dataclasses.replace(fp8, linears=timed.chosen))
    return dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                 precision=precision))
