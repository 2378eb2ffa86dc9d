"""The planners of `--pipeline-plan auto`: OP-Fence's, DT-FM's and the brute-force oracle, each
a pure function of the workload, the measured machine and the rules (chains.py), so that every
rank that calls one with the same inputs gets the same plan.

  op-fence     FusionLLM's scheduler as its abstract describes it (arXiv 2410.12707: cluster
               devices of similar bandwidth, partition the model over the clusters; the body of
               the paper was not available): the chains of chains.py's clusters; for each, the
               exact layer cut (cut.py) minimising the slowest stage or boundary per micro-batch
               (cost.py's objective), the sum of the stages second
  dt-fm        DT-FM's groups, path and objective (dtfm.py), the layers split evenly
  brute-force  every ordered partition of the ranks into stages with the same exact cut: the
               oracle the other two are measured against (slow beyond 8 ranks)

Each planner searches every chain of its space on its own objective for each stage count (at
most EXHAUSTIVE_RANKS ranks for DT-FM; OP-Fence's space is every chain up to ALL_CHAINS_RANKS
ranks, where that search takes under a second, and the clusters' orders times splits beyond:
a stage may then not span clusters, which costs plans whose batch-split stages join ranks
across a slow link when that is faster), and
then picks the stage count whose plan the shared cost model (cost.predict: the simulator) gives
the least step time: a deeper pipeline divides the work further but fills and drains longer,
which a per-micro-batch objective cannot see. Where our OP-Fence may differ from FusionLLM's:
its stages are contiguous runs of layers on a chain of clusters (FusionLLM partitions an
operator DAG), a stage's ranks split the batch (TP 1), and the objective is ours as stated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.pipeline.placement import dtfm
from megadomino.pipeline.placement.chains import (
    Chain,
    Rules,
    all_chains,
    fastest_first,
    op_fence_chains,
)
from megadomino.pipeline.placement.cost import (
    Estimate,
    Machine,
    Workload,
    boundary_times,
    predict,
    stage_costs,
)
from megadomino.pipeline.placement.cut import Cut, best_cut
from megadomino.pipeline.reshard.layout import part_range

PLANNERS = ("op-fence", "dt-fm", "brute-force")
ALL_CHAINS_RANKS = 6
"""Up to this many ranks OP-Fence searches every ordered partition of the ranks (4,683 at 6
ranks, about a third of a second; 545,835 at 8), beyond only the clusters' chains."""


@dataclass(frozen=True)
class Placement:
    planner: str
    plan: PipelinePlan
    objective: float
    """The planner's own objective of the plan (op-fence, brute-force: the bottleneck per
    micro-batch, seconds; dt-fm: its cost per step, seconds)."""
    estimate: Estimate
    note: str = ""


class Costs:
    """The OP-Fence objective's terms, each computed once per stage and per boundary."""

    def __init__(self, work: Workload, machine: Machine):
        self.work, self.machine = work, machine
        self._stages: dict[tuple[int, ...], np.ndarray] = {}
        self._links: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, float]] = {}

    def stage(self, ranks: tuple[int, ...]) -> np.ndarray:
        if ranks not in self._stages:
            self._stages[ranks] = stage_costs(self.work, self.machine, ranks)
        return self._stages[ranks]

    def links(self, chain: Chain) -> list[tuple[float, float]]:
        """Each boundary's (forward, backward) seconds per micro-batch."""
        for pair in zip(chain, chain[1:]):
            if pair not in self._links:
                self._links[pair] = boundary_times(self.work, self.machine, *pair)
        return [self._links[pair] for pair in zip(chain, chain[1:])]

    def key(self, chain: Chain) -> tuple[float, float, Cut | None]:
        """The chain's (bottleneck, fill) and its cut: the exact cut's bottleneck, and its
        stages' sum plus every boundary both ways (what a micro-batch's way through the
        pipeline and back crosses: the fill and drain)."""
        links = self.links(chain)
        floor = max((max(pair) for pair in links), default=0.0)
        cut = best_cut(np.stack([self.stage(ranks) for ranks in chain]), floor)
        if cut is None:
            return float("inf"), float("inf"), None
        return cut.bottleneck, cut.total + sum(sum(pair) for pair in links), cut


def best_per_count(chains: Iterable[Chain], costs: Costs) -> dict[int, tuple[Cut, Chain]]:
    """For each stage count, the chain and cut of the least (bottleneck, fill) (Costs.key); the
    first found on ties. A chain whose slowest boundary alone exceeds the best bottleneck of
    its count is not cut (no cut can beat it)."""
    best: dict[int, tuple[tuple[float, float], Cut, Chain]] = {}
    for chain in chains:
        count = len(chain)
        if count in best and max((max(pair) for pair in costs.links(chain)),
                                 default=0.0) > best[count][0][0]:
            continue
        bottleneck, fill, cut = costs.key(chain)
        if cut is not None and (count not in best or (bottleneck, fill) < best[count][0]):
            best[count] = ((bottleneck, fill), cut, chain)
    return {count: (cut, chain) for count, (_, cut, chain) in best.items()}


def to_plan(chain: Chain, spans, num_layers: int) -> PipelinePlan:
    """A --pipeline-plan of the chain (TP 1, batch-split stages) with these layer spans."""
    return PipelinePlan(tuple(Stage(index, tuple(ranks), 1, (tuple(span),))
                              for index, (ranks, span) in enumerate(zip(chain, spans))),
                        num_layers, batch_split=True)


def _least_step(planner: str, found: dict[int, tuple[float, Chain, tuple]], work: Workload,
                machine: Machine, note: str = "") -> Placement:
    """Of each stage count's (objective, chain, spans), the plan of the least predicted step
    (fewer stages on ties)."""
    if not found:
        raise ValueError(f"{planner}: no plan meets the rules")
    placements = []
    for count in sorted(found):
        objective, chain, spans = found[count]
        plan = to_plan(chain, spans, work.num_layers)
        placements.append(Placement(planner, plan, objective, predict(plan, work, machine),
                                    note))
    return min(placements, key=lambda placement: placement.estimate.step)


def op_fence(work: Workload, machine: Machine, rules: Rules,
             groups: tuple[tuple[int, ...], ...] | None = None,
             exhaustive: bool | None = None) -> Placement:
    """OP-Fence (module docstring): every chain up to ALL_CHAINS_RANKS ranks, unless `groups`
    or `exhaustive` (chains.op_fence_chains') ask for the clusters' chains. When no chain of
    the clusters meets the rules (a tied embedding's first and last stage of one size, a stage
    count asked for), the ranks are taken as one cluster, whose splits hold every size."""
    costs, note = Costs(work, machine), ""
    if groups is None and exhaustive is None and machine.world <= ALL_CHAINS_RANKS:
        chains = all_chains(machine, rules)
    else:
        chains = op_fence_chains(machine, rules, groups, exhaustive)
    best = best_per_count(chains, costs)
    if not best:
        note = "no chain of the bandwidth clusters meets the rules: planned as one cluster"
        best = best_per_count(op_fence_chains(
            machine, rules, (fastest_first(machine, range(machine.world)),)), costs)
    found = {count: (cut.bottleneck, chain, cut.spans) for count, (cut, chain) in best.items()}
    return _least_step("op-fence", found, work, machine, note)


def brute_force(work: Workload, machine: Machine, rules: Rules) -> Placement:
    best = best_per_count(all_chains(machine, rules), Costs(work, machine))
    found = {count: (cut.bottleneck, chain, cut.spans) for count, (cut, chain) in best.items()}
    return _least_step("brute-force", found, work, machine)


def dt_fm(work: Workload, machine: Machine, rules: Rules,
          exhaustive: bool | None = None) -> Placement:
    """DT-FM (dtfm.py) for each stage count of equal groups the rules allow."""
    found = {}
    for count in dt_fm_counts(machine.world, rules):
        cost, chain = dtfm.search(machine, work, count, exhaustive)
        spans = tuple(part_range(work.num_layers, count, s) for s in range(count))
        found[count] = (cost, chain, spans)
    return _least_step("dt-fm", found, work, machine)


def dt_fm_counts(world: int, rules: Rules) -> list[int]:
    """The stage counts of equal groups: divisors of the world the rules allow."""
    return [count for count in range(2, world + 1)
            if world % count == 0 and world // count <= rules.max_dp
            and rules.stage_counts_allow(count)]


def plan_placement(planner: str, work: Workload, machine: Machine, rules: Rules) -> Placement:
    """The plan `planner` (one of PLANNERS) makes."""
    if planner == "op-fence":
        return op_fence(work, machine, rules)
    if planner == "dt-fm":
        return dt_fm(work, machine, rules)
    if planner == "brute-force":
        return brute_force(work, machine, rules)
    raise ValueError(f"planner {planner!r}: choose from {', '.join(PLANNERS)}")
