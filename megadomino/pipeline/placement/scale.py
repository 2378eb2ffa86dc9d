"""The scale model: a TP x PP x DP run's predicted step time and MFU on a cluster of nodes, from
the placement cost model's counts (cost.py's `Workload`: config/flops.py's FLOPs, parameters
and activation bytes) and the one pipeline simulator (pipeline/simulate.py), priced with
measured rates (`Rates`). benchmarks/scale_model.py calibrates the rates and prints the
predictions; docs/scale_model.md says what it assumes.

Rank grid: `arange(world).view(pp, dp, tp)` (distributed/dims.py), nodes of `gpus_per_node`
consecutive ranks. A group is inside a node when its ranks span at most one node: the TP group
when tp <= gpus_per_node, the DP group when dp * tp <= gpus_per_node, a pipeline boundary when
both stages' first ranks sit on one node; otherwise it runs at the inter-node rate.

Per micro-batch on one GPU (W the FLOPs of a layer's forward + backward on its shard):
  layer      W / rate(W) at the layer's TP shard, never below the layer's launch floor
             (`LayerTimes`: 1-GPU timings of each measured layer at each TP shard's shapes and
             micro-batch; smaller shards and micro-batches run smaller, less efficient GEMMs)
  logits     the same rate rule for the output layer (no floor), on the last stage
  TP         4 collectives of the (s, b, h) activation a layer, forward and backward (plain TP:
             all-reduces; SP: all-gathers and reduce-scatters, the same bus bytes), each
             factor * bytes / busbw(kind, tp, bytes) (nccl-tests' bus bandwidth: all-reduce
             factor 2 (n - 1) / n, reduce-scatter and all-gather (n - 1) / n; the measured curve
             of that collective, whose times include each ring step's latency; across nodes the
             assumed rate plus a latency a ring step); exposed in full, or with `overlap_tp`
             (--tp-comm-overlap, Domino) only what exceeds the layer's compute (ideal overlap:
             an upper bound on its benefit)
  forward : backward = 1 : 2 (cost.py's rule); the pipeline is `simulate` of the schedule with
  these per-stage times and one activation message per boundary (bf16; / tp under SP).
Per step:
  DP         the first stage's gradients (fp32, the engine's reduce dtype) over the DP group:
             ZeRO 0 an all-reduce, ZeRO 1/2 a reduce-scatter then the bf16 parameters'
             all-gather after the optimizer; the reduction overlaps the last backward at PP 1
             (the engine reduces under it) and nothing at PP > 1 (the runtime reduces after the
             last backward); ZeRO 3 gathers the parameters in each micro-batch's forward and
             backward and reduce-scatters its gradients, overlapped with that micro-batch's
             compute (exposed: what exceeds it)
  rest       the optimizer and the step's host work: `Rates.rest_per_param` seconds per
             parameter a GPU updates (its stage's share / tp, / dp under ZeRO >= 1), calibrated
             as what a 1-GPU step took beyond its layers and logits
MFU: the model FLOPs of the step (3 x the forward's, as train/metrics.py counts them) over
step x GPUs x peak.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from megadomino.config.flops import (
    embedding_params,
    layer_macs,
    layer_params,
    logits_macs,
    output_params,
)
from megadomino.config.model import ModelConfig
from megadomino.pipeline.placement.cost import Workload
from megadomino.pipeline.reshard.layout import part_range
from megadomino.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD
from megadomino.pipeline.simulate import simulate

ACTIVATION_BYTES = 2
"""bf16 activations and parameters."""
GRAD_BYTES = 4
"""The ZeRO engine's default reduce dtype, float32."""
TP_COLLECTIVES = 4
"""A layer's TP collectives per micro-batch, forward and backward: Megatron's g in attention
and MLP forward, f's backward in both (SP: an all-gather and a reduce-scatter each)."""
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}
"""nccl-tests' bus bandwidth: a collective's bytes times its factor over its seconds, for n
ranks (benchmarks/domino_links.py measures with it, the scale model prices with it)."""


@dataclass(frozen=True)
class Curve:
    """y(x) through measured points, linear in log x and log y between them and flat beyond
    the first and last (a point's rate is never extrapolated to unmeasured work). The points'
    x are distinct."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self):
        if not self.points or any(x <= 0 or y <= 0 for x, y in self.points):
            raise ValueError(f"a curve needs positive points, not {self.points}")
        if len({x for x, _ in self.points}) < len(self.points):
            raise ValueError(f"a curve needs distinct x, not {self.points}")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    def __call__(self, x: float) -> float:
        xs = [p[0] for p in self.points]
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return self.points[0][1]
        if i == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[i - 1], self.points[i]
        t = math.log(x / x0) / math.log(x1 / x0)
        return math.exp(math.log(y0) + t * math.log(y1 / y0))


def layer_work(model: ModelConfig, tp: int, micro_batch: int) -> float:
    """FLOPs of one layer's forward + backward on one GPU of TP `tp` (3 x the forward's)."""
    return 6 * model.seq_length * micro_batch * layer_macs(model) / tp


def layer_shape(model: ModelConfig) -> tuple:
    """What tells layers apart in `LayerTimes`: (SwiGLU, hidden, FFN, heads, query groups, head
    dim). The sequence length is not part of it: it enters through a layer's FLOPs."""
    return (model.swiglu, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads,
            model.num_query_groups, model.kv_channels)


@dataclass(frozen=True)
class LayerTimes:
    """One layer's forward + backward on one GPU, from 1-GPU timings of layers at TP-shard
    shapes (one GPU computing what one rank of TP t computes, its collectives absent).

    `rates[shape][t]`: FLOP/s against FLOPs of the layer `shape` (`layer_shape`) at TP shard
    shape t, one point a measured micro-batch; a measured (layer, t, micro-batch) is priced at
    its measured time. Between measured micro-batches the rate is log-log interpolated; beyond
    the largest its rate holds (a saturated GEMM's time grows with its work). A TP degree
    between measured shapes interpolates their rates at the same FLOPs (log-log in t), beyond
    them the nearest shape's rate holds.
    `floors[shape]`: the least time measured for that layer. Small shards are launch-bound: an
    eager layer takes about 2 ms whatever its micro-batch once its GEMMs are small (GPT-3 1.3B
    at TP 8), so no layer is predicted faster than its floor (below the measured FLOPs, where
    the rate holds and the time would shrink with the work, the floor decides).
    A layer not measured is priced by the measured layer of its kind (SwiGLU or not) nearest
    in hidden size, at its own FLOPs."""

    rates: dict[tuple, dict[int, Curve]]
    floors: dict[tuple, float]

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[ModelConfig, int, int, float]]) -> LayerTimes:
        """From (model, TP shape, micro-batch, seconds) rows, the model at the timed sequence
        length."""
        points: dict[tuple, dict[int, list]] = {}
        floors: dict[tuple, float] = {}
        for model, tp_shape, micro_batch, seconds in rows:
            shape, work = layer_shape(model), layer_work(model, tp_shape, micro_batch)
            points.setdefault(shape, {}).setdefault(tp_shape, []).append((work, work / seconds))
            floors[shape] = min(seconds, floors.get(shape, seconds))
        rates = {shape: {t: Curve(tuple(p)) for t, p in by_tp.items()}
                 for shape, by_tp in points.items()}
        return cls(rates, floors)

    def measured(self, model: ModelConfig) -> tuple:
        """The measured layer that prices `model`'s (itself when measured)."""
        shape = layer_shape(model)
        if shape in self.rates:
            return shape
        kind = [s for s in self.rates if s[0] == model.swiglu] or list(self.rates)
        return min(kind, key=lambda s: abs(math.log(s[1] / model.hidden_size)))

    def rate(self, model: ModelConfig, tp: int, work: float) -> float:
        """FLOP/s of `work` FLOPs of `model`'s layer on one GPU of TP `tp`."""
        by_tp = self.rates[self.measured(model)]
        return Curve(tuple((t, curve(work)) for t, curve in by_tp.items()))(tp)

    def seconds(self, model: ModelConfig, tp: int, micro_batch: int) -> float:
        """One layer's forward + backward on one GPU of TP `tp`, never below the floor."""
        work = layer_work(model, tp, micro_batch)
        return max(self.floors[self.measured(model)], work / self.rate(model, tp, work))


@dataclass(frozen=True)
class Rates:
    """What the model prices work with. `layer`: a layer's seconds on one GPU; `busbw`:
    bytes/s of a collective inside a node vs its message bytes, by (collective, group size): a
    larger group uses the largest measured size's curve, a smaller the smallest's;
    `inter_node`: bytes/s a GPU sends across nodes (also the bus bandwidth of a group spanning
    nodes), `inter_latency` seconds a ring step across nodes."""

    layer: LayerTimes
    busbw: dict[tuple[str, int], Curve]
    inter_node: float
    rest_per_param: float
    peak_flops: float
    gpus_per_node: int = 8
    inter_latency: float = 10e-6

    def bandwidth(self, kind: str, group: int, nbytes: float) -> float:
        """The measured bus bandwidth of `kind` inside a node (class docstring)."""
        sizes = sorted(n for k, n in self.busbw if k == kind)
        if not sizes:
            raise ValueError(f"no bus bandwidth measured for {kind}")
        measured = max([n for n in sizes if n <= group] or sizes[:1])
        return self.busbw[(kind, measured)](nbytes)

    def collective(self, kind: str, nbytes: float, group: int, inside: bool) -> float:
        """Seconds of one collective of `nbytes` (module docstring); 0 for a group of one.
        Inside a node the measured times include the ring steps' latency; across nodes it is
        added to the assumed bandwidth's time."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        bus_bytes = BUS_FACTOR[kind](group) * nbytes
        if inside:
            return bus_bytes / self.bandwidth(kind, group, nbytes)
        steps = 2 * (group - 1) if kind == "all_reduce" else group - 1
        return steps * self.inter_latency + bus_bytes / self.inter_node


@dataclass(frozen=True)
class Layout:
    """One run: degrees, batch, ZeRO stage, TP overlap (--tp-comm-overlap or Domino), SP and
    the pipeline schedule. The global batch is micro_batch x dp x micro-batches."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    zero_stage: int = 1
    sequence_parallel: bool = False
    overlap_tp: bool = False
    schedule: str = "1f1b"

    def __post_init__(self):
        if min(self.tp, self.pp, self.dp, self.micro_batch) < 1:
            raise ValueError(f"degrees and micro-batch must be positive: {self}")
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"global batch {self.global_batch} is not a multiple of micro-batch "
                             f"x dp = {self.micro_batch * self.dp}")
        if self.schedule not in SCHEDULES or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"schedule {self.schedule!r} / ZeRO stage {self.zero_stage}: "
                             f"choose one of {SCHEDULES} / 0-3")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)


@dataclass(frozen=True)
class ScaleEstimate:
    """A layout's predicted step, seconds, and its parts (module docstring)."""

    step: float
    mfu: float
    pipeline: float
    layer: float
    """One layer's compute, one micro-batch, one GPU."""
    tp_exposed: float
    """One layer's exposed TP communication, one micro-batch."""
    dp_exposed: float
    rest: float
    bubble: float
    parts: dict = field(default_factory=dict)


def workload(model: ModelConfig, layout: Layout) -> Workload:
    """cost.py's counts of `model` under `layout` (one sequence per `Workload` unit)."""
    vocab, seq = model.padded_vocab_size(layout.tp), model.seq_length
    tied = 0 if model.untie_embeddings_and_output_weights else vocab * model.hidden_size
    return Workload(
        num_layers=model.num_layers, layer_flops=2 * seq * layer_macs(model),
        head_flops=2 * seq * logits_macs(model, vocab),
        activation_bytes=seq * model.hidden_size * ACTIVATION_BYTES,
        layer_params=layer_params(model), first_params=embedding_params(model, vocab),
        last_params=output_params(model, vocab) + tied, tied_params=tied,
        grad_bytes=GRAD_BYTES, micro_batch=layout.micro_batch,
        micro_batches=layout.micro_batches, schedule=layout.schedule)


def first_stage_params(work: Workload, layout: Layout) -> int:
    """The first stage's parameters (the largest DP reduction's): cost.py counts the last
    stage's copy of a tied word table apart, which a single stage holds once."""
    params = work.stage_params(*part_range(work.num_layers, layout.pp, 0))
    return params - (work.tied_params if layout.pp == 1 else 0)


def tp_seconds(rates: Rates, work: Workload, layout: Layout) -> float:
    """One layer's TP collectives for one micro-batch, forward and backward (module docstring)."""
    nbytes = work.activation_bytes * layout.micro_batch
    inside = layout.tp <= rates.gpus_per_node
    if layout.sequence_parallel:
        one = (rates.collective("all_gather", nbytes, layout.tp, inside)
               + rates.collective("reduce_scatter", nbytes, layout.tp, inside))
    else:
        one = rates.collective("all_reduce", nbytes, layout.tp, inside)
    return TP_COLLECTIVES * one


def exposed(communication: float, compute: float, overlapped: bool) -> float:
    """Communication time left on the critical path: all of it, or with overlap the part that
    exceeds the compute it runs under."""
    return max(0.0, communication - compute) if overlapped else communication


def stage_times(rates: Rates, model: ModelConfig, work: Workload,
                layout: Layout) -> tuple[list[float], list[float], float, float]:
    """(forward, backward per stage per micro-batch, one layer's compute, its exposed TP)."""
    layer = rates.layer.seconds(model, layout.tp, layout.micro_batch)
    head_work = 3 * work.head_flops * layout.micro_batch / layout.tp
    head = head_work / rates.layer.rate(model, layout.tp, head_work)
    tp = exposed(tp_seconds(rates, work, layout), layer, layout.overlap_tp)
    totals = []
    for stage in range(layout.pp):
        start, end = part_range(work.num_layers, layout.pp, stage)
        totals.append((end - start) * (layer + tp) + (head if end == work.num_layers else 0.0))
    return [t / 3 for t in totals], [2 * t / 3 for t in totals], layer, tp


def boundary_seconds(rates: Rates, work: Workload, layout: Layout) -> dict:
    """Each boundary's message time, both directions: (from stage, to stage) -> seconds."""
    nbytes = work.activation_bytes * layout.micro_batch
    if layout.sequence_parallel:
        nbytes /= layout.tp
    link = {}
    for stage in range(layout.pp - 1):
        first = stage * layout.dp * layout.tp
        second = first + layout.dp * layout.tp
        inside = first // rates.gpus_per_node == second // rates.gpus_per_node
        seconds = rates.collective("all_reduce", nbytes, 2, inside)  # 2 ranks: S at busbw
        link[(stage, stage + 1)] = link[(stage + 1, stage)] = seconds
    return link


def dp_seconds(rates: Rates, work: Workload, layout: Layout, backward: float,
               compute: float) -> float:
    """The DP reduction's exposed seconds a step (module docstring): `backward` the last
    micro-batch's backward on the first stage, `compute` one micro-batch's F + B there."""
    params = first_stage_params(work, layout) / layout.tp
    inside = layout.dp * layout.tp <= rates.gpus_per_node
    grads, weights = params * work.grad_bytes, params * ACTIVATION_BYTES
    if layout.zero_stage == 3:
        per_micro = (2 * rates.collective("all_gather", weights, layout.dp, inside)
                     + rates.collective("reduce_scatter", grads, layout.dp, inside))
        return layout.micro_batches * exposed(per_micro, compute, True)
    reduce_kind = "all_reduce" if layout.zero_stage == 0 else "reduce_scatter"
    reduce = rates.collective(reduce_kind, grads, layout.dp, inside)
    gather = (rates.collective("all_gather", weights, layout.dp, inside)
              if layout.zero_stage in (1, 2) else 0.0)
    return exposed(reduce, backward, layout.pp == 1) + gather


def model_flops(work: Workload, layout: Layout) -> float:
    """The step's model FLOPs, counted as train/metrics.py counts them."""
    return 3 * layout.global_batch * (work.num_layers * work.layer_flops + work.head_flops)


def predict(model: ModelConfig, layout: Layout, rates: Rates) -> ScaleEstimate:
    """`layout`'s step of `model` on `rates`' machine (module docstring)."""
    work = workload(model, layout)
    forward, backward, layer, tp = stage_times(rates, model, work, layout)
    weight = None
    if layout.schedule in SPLIT_BACKWARD:  # B and W each a forward's worth, as cost.predict
        backward, weight = list(forward), list(forward)
    # receives posted just before their compute: NCCL's default (prefetches_receives)
    run = simulate(layout.schedule, layout.pp, layout.micro_batches, forward, backward,
                   boundary_seconds(rates, work, layout), prefetch=False, weight=weight)
    last_backward = backward[0] + (weight[0] if weight else 0.0)
    dp = dp_seconds(rates, work, layout, last_backward, forward[0] + last_backward)
    updated = first_stage_params(work, layout) / layout.tp
    if layout.zero_stage >= 1:
        updated /= layout.dp
    rest = rates.rest_per_param * updated
    step = run.step + dp + rest
    mfu = model_flops(work, layout) / (step * layout.gpus * rates.peak_flops)
    return ScaleEstimate(step, mfu, run.step, layer, tp, dp, rest, max(run.bubble),
                         {"forward": forward, "backward": backward})


def rest_per_param(model: ModelConfig, layout: Layout, rates: Rates, step: float) -> float:
    """The 1-GPU calibration: seconds per parameter of a measured 1-GPU `step` beyond what
    `rates` prices its layers and logits at (never negative)."""
    if layout.gpus != 1:
        raise ValueError(f"the rest is calibrated on a 1-GPU step, not {layout}")
    work = workload(model, layout)
    forward, backward, _, _ = stage_times(rates, model, work, layout)
    layers = layout.micro_batches * (forward[0] + backward[0])
    return max(0.0, step - layers) / first_stage_params(work, layout)
