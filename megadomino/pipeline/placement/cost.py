"""The placement cost model: what a pipeline plan costs on a measured machine, per micro-batch
and per step. The planners (planners.py) and the start-up line that predicts a plan's step time
use it alone, and its step time comes from the one pipeline simulator (pipeline/simulate.py).

Inputs: a `Workload` (config/flops.py's multiply-adds and parameters per layer, the boundary
activation's bytes, the step's micro-batches) and a `Machine` (measure.py: bandwidth and latency
from every rank to every other, both directions, and each rank's GEMM speed).

A stage of the plan holds layers [a, b) on ranks R that split each micro-batch of m sequences
(position d computes rows part_range(m, |R|, d), the runtime's torch.tensor_split rule; TP 1).
Per micro-batch:
  forward    max_d rows_d * flops(a, b) / speed(R[d]), flops(a, b) the forward FLOPs of one
             sequence through layers a..b (and the logits on the last stage; the embedding's
             gather is free)
  backward   2 x forward (the data- and the weight-gradient GEMMs)
  boundary   the activation's send-recv resharding between two stages' batch splits: source
             position i sends destination position j the rows they share (both ranks of one
             position when the splits agree, as the runtime's same-layout route does); a message
             takes lat(i, j) + bytes / bw(i, j), a rank's messages go one after another (one
             NIC), the boundary takes the busiest rank's time. The activation forward on
             bw(src -> dst), its gradient back on bw(dst -> src): a rate limit shapes one
             direction only.
Per step:
  DP reduce  a stage's gradients summed over its ranks, a ring in plan order:
             2 (k - 1) max over the ring's edges (lat + bytes / k / bw)
  tied       with tied embeddings the first and last stage sum the word table's gradient,
             position by position (a two-rank all-reduce each)

`predict` runs the schedule's action lists through pipeline/simulate.py with these forward and
backward times and adds the largest DP reduce and the tied sum (the runtime reduces after the
last backward). Each boundary's messages take that boundary's time in their direction (the
simulator's per-link `link`), so a chain with one slow boundary is not priced as if every
boundary were slow.

The OP-Fence objective (`stage_costs`, `boundary_cost`) is per micro-batch: a stage's forward
plus backward plus its DP reduce spread over the step's micro-batches, a boundary's slower
direction; a plan's bottleneck is the largest of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from megadomino.config.flops import (
    embedding_params,
    layer_macs,
    layer_params,
    logits_macs,
    output_params,
)
from megadomino.config.pipeline_plan import PipelinePlan
from megadomino.config.validate import batch_plan
from megadomino.pipeline.reshard.layout import part_range
from megadomino.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD
from megadomino.pipeline.simulate import simulate

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Machine:
    """bandwidth[i][j]: bytes/s from rank i to rank j (inf on the diagonal); latency[i][j]:
    seconds a message from i to j takes to start arriving; speed[i]: rank i's FLOP/s."""

    bandwidth: tuple[tuple[float, ...], ...]
    latency: tuple[tuple[float, ...], ...]
    speed: tuple[float, ...]

    @property
    def world(self) -> int:
        return len(self.speed)

    def message(self, source: int, target: int, nbytes: float) -> float:
        """Seconds of one message of `nbytes` from `source` to `target`."""
        if source == target or nbytes <= 0:
            return 0.0
        return self.latency[source][target] + nbytes / self.bandwidth[source][target]

    def to_json(self) -> str:
        return json.dumps({key: _finite(value) for key, value in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> Machine:
        data = json.loads(text)
        return cls(*(_tuples(data[key]) for key in ("bandwidth", "latency", "speed")))

    @classmethod
    def uniform(cls, speeds: list[float], bandwidth: list[list[float]],
                latency: float = 0.0) -> Machine:
        """A machine from a bandwidth matrix (bytes/s) and one latency for every pair."""
        world = len(speeds)
        bw = tuple(tuple(math.inf if i == j else float(bandwidth[i][j]) for j in range(world))
                   for i in range(world))
        lat = tuple(tuple(0.0 if i == j else latency for j in range(world)) for i in range(world))
        return cls(bw, lat, tuple(float(s) for s in speeds))


def _finite(value):
    """JSON has no infinity: the diagonal's unlimited bandwidth is written as null."""
    if isinstance(value, (tuple, list)):
        return [_finite(item) for item in value]
    return None if math.isinf(value) else value


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return math.inf if value is None else float(value)


@dataclass(frozen=True)
class Workload:
    """One training step's work, from the config (config/flops.py's counts)."""

    num_layers: int
    layer_flops: float
    """Forward FLOPs of one layer for one sequence."""
    head_flops: float
    """Forward FLOPs of the output layer (logits) for one sequence: the last stage's."""
    activation_bytes: float
    """One sequence's (s, h) activation at a boundary, in the training dtype."""
    layer_params: int
    first_params: int
    """Parameters only the first stage holds (the embedding)."""
    last_params: int
    """Parameters only the last stage holds (final norm, untied output weight; tied, its copy
    of the word table)."""
    tied_params: int
    """The word table the first and last stage sum gradients of (0 untied)."""
    grad_bytes: int
    """Bytes per gradient element in the DP reduce."""
    micro_batch: int
    """Sequences per pipeline micro-batch (--micro-batch-size under a plan)."""
    micro_batches: int
    schedule: str = "1f1b"
    prefetch: bool = True

    @classmethod
    def from_config(cls, config, nccl: bool = False) -> Workload:
        """The run's workload; `nccl`: the stages talk over NCCL (whether receives are
        prefetched, ParallelConfig.prefetches_receives)."""
        model, parallel, schedule = config.model, config.parallel, config.train.schedule
        vocab, seq = model.padded_vocab_size(1), model.seq_length
        tied = 0 if model.untie_embeddings_and_output_weights else vocab * model.hidden_size
        _, micro_batches = batch_plan(schedule, 1)  # a plan's micro-batch is the pipeline's
        return cls(
            num_layers=model.num_layers, layer_flops=2 * seq * layer_macs(model),
            head_flops=2 * seq * logits_macs(model, vocab),
            activation_bytes=seq * model.hidden_size * ITEMSIZE[config.train.precision
                                                                .params_dtype],
            layer_params=layer_params(model), first_params=embedding_params(model, vocab),
            last_params=output_params(model, vocab) + tied, tied_params=tied,
            grad_bytes=ITEMSIZE[parallel.zero.reduce_dtype],
            micro_batch=schedule.micro_batch_size, micro_batches=micro_batches,
            # --pipeline-schedule auto picks its schedule once the plan runs: priced as 1F1B
            schedule=(parallel.pipeline_schedule if parallel.pipeline_schedule in SCHEDULES
                      else "1f1b"), prefetch=parallel.prefetches_receives(nccl))

    def stage_params(self, start: int, end: int) -> int:
        return ((end - start) * self.layer_params + (self.first_params if start == 0 else 0)
                + (self.last_params if end == self.num_layers else 0))

    def stage_flops(self, start: int, end: int) -> float:
        """Forward FLOPs of one sequence through layers [start, end) (and the logits last)."""
        return (end - start) * self.layer_flops + (self.head_flops if end == self.num_layers
                                                   else 0.0)


def rows(micro_batch: int, ranks: tuple[int, ...]) -> list[int]:
    """Sequences each position of a stage computes of one micro-batch."""
    return [stop - start for start, stop in
            (part_range(micro_batch, len(ranks), d) for d in range(len(ranks)))]


def seconds_per_flop(work: Workload, machine: Machine, ranks: tuple[int, ...]) -> float:
    """A stage's forward seconds per FLOP of one sequence: its slowest position's."""
    return max(count / machine.speed[rank] for count, rank in zip(rows(work.micro_batch, ranks),
                                                                  ranks))


def forward_time(work: Workload, machine: Machine, ranks: tuple[int, ...], start: int,
                 end: int) -> float:
    return work.stage_flops(start, end) * seconds_per_flop(work, machine, ranks)


def reduce_time(machine: Machine, ranks: tuple[int, ...], nbytes: float) -> float:
    """A ring all-reduce of `nbytes` over `ranks` in their order (module docstring)."""
    count = len(ranks)
    if count == 1:
        return 0.0
    ring = [(ranks[i], ranks[(i + 1) % count]) for i in range(count)]
    step = max(machine.message(i, j, nbytes / count) for i, j in ring)
    return 2 * (count - 1) * step


def transfer_time(work: Workload, machine: Machine, src: tuple[int, ...],
                  dst: tuple[int, ...]) -> float:
    """One micro-batch's activation from stage `src` to stage `dst` (module docstring)."""
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    for i, (a0, a1) in enumerate(part_range(work.micro_batch, len(src), d)
                                 for d in range(len(src))):
        for j, (b0, b1) in enumerate(part_range(work.micro_batch, len(dst), d)
                                     for d in range(len(dst))):
            shared = min(a1, b1) - max(a0, b0)
            if shared > 0:
                seconds = machine.message(src[i], dst[j], shared * work.activation_bytes)
                sent[src[i]] = sent.get(src[i], 0.0) + seconds
                received[dst[j]] = received.get(dst[j], 0.0) + seconds
    return max([*sent.values(), *received.values(), 0.0])


def boundary_times(work: Workload, machine: Machine, src: tuple[int, ...],
                   dst: tuple[int, ...]) -> tuple[float, float]:
    """(the activation forward, its gradient back) per micro-batch."""
    return transfer_time(work, machine, src, dst), transfer_time(work, machine, dst, src)


def boundary_cost(work: Workload, machine: Machine, src: tuple[int, ...],
                  dst: tuple[int, ...]) -> float:
    """The OP-Fence objective's boundary term: the slower direction."""
    return max(boundary_times(work, machine, src, dst))


def tied_time(work: Workload, machine: Machine, first: tuple[int, ...],
              last: tuple[int, ...]) -> float:
    """The word table's gradient summed between the first and last stage, per position."""
    if not work.tied_params or first == last:
        return 0.0
    nbytes = work.tied_params * work.grad_bytes
    return max(reduce_time(machine, (a, b), nbytes) for a, b in zip(first, last))


def stage_costs(work: Workload, machine: Machine, ranks: tuple[int, ...]) -> np.ndarray:
    """costs[a, b]: the OP-Fence objective's term for a stage on `ranks` holding layers
    [a, b) (inf where b <= a): forward + backward per micro-batch + its DP reduce / the step's
    micro-batches."""
    layers = work.num_layers
    start, end = np.meshgrid(np.arange(layers + 1), np.arange(layers + 1), indexing="ij")
    count, first, last = end - start, start == 0, end == layers
    flops = count * work.layer_flops + last * work.head_flops
    nbytes = (count * work.layer_params + first * work.first_params
              + last * work.last_params) * float(work.grad_bytes)
    k = len(ranks)
    reduce = np.zeros_like(flops, dtype=float)
    for i in range(k if k > 1 else 0):  # reduce_time's ring, over every (a, b) at once
        source, target = ranks[i], ranks[(i + 1) % k]
        step = machine.latency[source][target] + nbytes / k / machine.bandwidth[source][target]
        reduce = np.maximum(reduce, 2 * (k - 1) * step)
    costs = 3 * flops * seconds_per_flop(work, machine, ranks) + reduce / work.micro_batches
    return np.where(count > 0, costs, math.inf)


@dataclass(frozen=True)
class Estimate:
    """A plan's predicted costs (module docstring), seconds."""

    step: float
    pipeline: float
    """The simulated schedule alone (forwards, backwards, transfers)."""
    bottleneck: float
    """The OP-Fence objective: the slowest stage or boundary per micro-batch."""
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    boundaries: tuple[tuple[float, float], ...]
    reduce: tuple[float, ...]
    tied: float
    bubble: tuple[float, ...]

    def describe(self) -> str:
        stages = ", ".join(f"{f + b:.3g}" for f, b in zip(self.forward, self.backward))
        links = ", ".join(f"{f:.3g}/{b:.3g}" for f, b in self.boundaries)
        return (f"predicted step {self.step:.4g} s (pipeline {self.pipeline:.4g} s, DP reduce "
                f"{max(self.reduce):.3g} s, tied embedding {self.tied:.3g} s); per micro-batch: "
                f"stages F+B [{stages}] s, boundaries fwd/bwd [{links}] s; bubble "
                f"{max(self.bubble):.0%}")


def predict(plan: PipelinePlan, work: Workload, machine: Machine) -> Estimate:
    """The plan's step on `machine` (module docstring)."""
    spans = [stage.layers[0] for stage in plan.stages]
    forward = [forward_time(work, machine, stage.ranks, *span)
               for stage, span in zip(plan.stages, spans)]
    backward = [2 * f for f in forward]
    boundaries = [boundary_times(work, machine, a.ranks, b.ranks)
                  for a, b in zip(plan.stages, plan.stages[1:])]
    link = {}  # per direction of each boundary: (from stage, to stage) -> seconds
    for index, (forward_s, backward_s) in enumerate(boundaries):
        link[(index, index + 1)], link[(index + 1, index)] = forward_s, backward_s
    weight = None
    if work.schedule in SPLIT_BACKWARD:  # B and W each one forward's worth
        backward, weight = list(forward), list(forward)
    run = simulate(work.schedule, plan.size, work.micro_batches, forward, backward, link,
                   prefetch=work.prefetch, weight=weight)
    reduce = [reduce_time(machine, stage.ranks, work.stage_params(*span) * work.grad_bytes)
              for stage, span in zip(plan.stages, spans)]
    tied = tied_time(work, machine, plan.stages[0].ranks, plan.stages[-1].ranks)
    costs = [3 * f + r / work.micro_batches for f, r in zip(forward, reduce)]
    bottleneck = max(costs + [max(pair) for pair in boundaries])
    return Estimate(run.step + max(reduce) + tied, run.step, bottleneck, tuple(forward),
                    tuple(2 * f for f in forward), tuple(boundaries), tuple(reduce), tied,
                    run.bubble)
