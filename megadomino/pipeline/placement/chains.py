"""Chains: the ordered stages (each a tuple of ranks) a plan may run on, before the layer cut.

`Rules` are what every plan must meet: every rank in exactly one stage, a stage's ranks at most
the micro-batch (each position computes at least one sequence), 2 <= stages <= layers (or
exactly --pipeline-model-parallel-size when given), and with tied embeddings a first and last
stage of one size (the runtime sums the word table position by position).

OP-Fence's chains (`op_fence_chains`):
- Clusters (`clusters`): single linkage on log bandwidth, cut at a 2x gap. A pair's bandwidth
  is its slower direction. Pairs are merged from the fastest (Kruskal's order); the merge levels
  (the bandwidths at which two clusters joined) fall as merging goes on, and merging stops at
  the first level below half of the level before it. So every cluster is joined by links
  within 2x of each other step by step, and the links between clusters are more than 2x slower
  than the slowest link that joined any of them.
- The clusters are ordered into a chain in every order.
- Inside a cluster the links are alike by construction, so only the ranks' speeds tell them
  apart: its ranks are taken in order of GEMM speed, fastest first or slowest first (the last
  stage also computes the logits, the first only gathers the embedding), and split into
  consecutive groups, every split: each group is a stage whose ranks split the batch, its
  faster ranks first (an uneven split gives them the extra sequence).
Beyond EXHAUSTIVE clusters, or ranks in a cluster, a heuristic serves (`op_fence_chains`'s
`exhaustive`): the clusters in greedy orders (from each cluster, on to the fastest-linked
unvisited one) and a cluster split only into groups of one size; tests/test_placement_planners.py
reports its gap to the exhaustive search.
The oracle's chains (`all_chains`): every ordered partition of the ranks into stages, each
stage's ranks fastest first, whatever the clusters.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from megadomino.pipeline.placement.cost import Machine

Chain = tuple[tuple[int, ...], ...]
EXHAUSTIVE = 8
"""OP-Fence searches every chain up to this many clusters and ranks a cluster."""


@dataclass(frozen=True)
class Rules:
    num_layers: int
    max_dp: int
    """The most ranks a stage may have: the micro-batch's sequences."""
    tied: bool
    stages: int | None = None
    """The stage count asked for (--pipeline-model-parallel-size > 1); None: any."""

    def allows(self, chain: Chain) -> bool:
        return (self.stage_counts_allow(len(chain))
                and all(len(stage) <= self.max_dp for stage in chain)
                and (not self.tied or len(chain[0]) == len(chain[-1])))

    def stage_counts_allow(self, count: int) -> bool:
        if self.stages is not None:
            return count == self.stages
        return 2 <= count <= self.num_layers


def pair_bandwidth(machine: Machine, i: int, j: int) -> float:
    """A pair's bandwidth for clustering: its slower direction."""
    return min(machine.bandwidth[i][j], machine.bandwidth[j][i])


def clusters(machine: Machine) -> tuple[tuple[int, ...], ...]:
    """The bandwidth clusters (module docstring), each sorted, in order of their least rank."""
    parent = list(range(machine.world))

    def root(rank: int) -> int:
        while parent[rank] != rank:
            rank = parent[rank]
        return rank

    pairs = sorted(itertools.combinations(range(machine.world), 2),
                   key=lambda pair: (-pair_bandwidth(machine, *pair), pair))
    level = None
    for i, j in pairs:
        a, b = root(i), root(j)
        if a == b:
            continue
        bandwidth = pair_bandwidth(machine, i, j)
        if level is not None and bandwidth < level / 2:
            break
        parent[max(a, b)] = min(a, b)
        level = bandwidth
    groups: dict[int, list[int]] = {}
    for rank in range(machine.world):
        groups.setdefault(root(rank), []).append(rank)
    return tuple(tuple(group) for group in sorted(groups.values()))


def fastest_first(machine: Machine, ranks) -> tuple[int, ...]:
    return tuple(sorted(ranks, key=lambda rank: (-machine.speed[rank], rank)))


def splits(ranks: tuple[int, ...]) -> Iterator[Chain]:
    """Every split of `ranks` into consecutive non-empty groups, in order."""
    for count in range(len(ranks)):
        for inner in itertools.combinations(range(1, len(ranks)), count):
            bounds = (0, *inner, len(ranks))
            yield tuple(ranks[a:b] for a, b in zip(bounds, bounds[1:]))


def op_fence_chains(machine: Machine, rules: Rules,
                    groups: tuple[tuple[int, ...], ...] | None = None,
                    exhaustive: bool | None = None) -> Iterator[Chain]:
    """OP-Fence's chains over `groups` (default: the bandwidth clusters) that `rules` allow.
    Exhaustive (the default up to EXHAUSTIVE clusters and ranks a cluster): every order of the
    clusters, every split of each; else the heuristic (`_orders`, `_cluster_splits`)."""
    groups = clusters(machine) if groups is None else groups
    if exhaustive is None:
        exhaustive = len(groups) <= EXHAUSTIVE and max(map(len, groups)) <= EXHAUSTIVE
    per_cluster = [_cluster_splits(machine, group, exhaustive) for group in groups]
    for order in _orders(machine, groups, exhaustive):
        for parts in itertools.product(*(per_cluster[c] for c in order)):
            chain = tuple(stage for part in parts for stage in part)
            if rules.allows(chain):
                yield chain


def _orders(machine: Machine, groups, exhaustive: bool) -> Iterator[tuple[int, ...]]:
    """Every order of the clusters; the heuristic: from each cluster, the path that goes on to
    the unvisited cluster of the fastest link from the last one."""
    if exhaustive:
        yield from itertools.permutations(range(len(groups)))
        return

    def link(a: int, b: int) -> float:
        return max(pair_bandwidth(machine, i, j) for i in groups[a] for j in groups[b])

    for start in range(len(groups)):
        order = [start]
        while len(order) < len(groups):
            order.append(max((g for g in range(len(groups)) if g not in order),
                             key=lambda g: (link(order[-1], g), -g)))
        yield tuple(order)


def _cluster_splits(machine: Machine, group: tuple[int, ...], exhaustive: bool = True
                    ) -> list[Chain]:
    """A cluster's stages in the chain: its ranks fastest or slowest first, every split (the
    heuristic: only splits into groups of one size), each stage's ranks fastest first."""
    fastest = fastest_first(machine, group)
    found: dict[Chain, None] = {}
    for ranks in (fastest, fastest[::-1]):
        for split in splits(ranks) if exhaustive else _even_splits(ranks):
            found[tuple(fastest_first(machine, stage) for stage in split)] = None
    return list(found)


def _even_splits(ranks: tuple[int, ...]) -> Iterator[Chain]:
    for size in range(1, len(ranks) + 1):
        if len(ranks) % size == 0:
            yield tuple(ranks[a:a + size] for a in range(0, len(ranks), size))


def all_chains(machine: Machine, rules: Rules) -> Iterator[Chain]:
    """Every ordered partition of the ranks into stages that `rules` allow (the oracle's)."""
    ranks = fastest_first(machine, range(machine.world))
    for chain in _ordered_partitions(ranks, rules.max_dp):
        if rules.allows(chain):
            yield chain


def _ordered_partitions(ranks: tuple[int, ...], max_size: int) -> Iterator[Chain]:
    if not ranks:
        yield ()
        return
    for size in range(1, min(max_size, len(ranks)) + 1):
        for first in itertools.combinations(ranks, size):
            rest = tuple(rank for rank in ranks if rank not in first)
            for tail in _ordered_partitions(rest, max_size):
                yield (first, *tail)
