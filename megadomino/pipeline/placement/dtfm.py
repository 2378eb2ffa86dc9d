"""DT-FM's objective (Yuan et al., "Decentralized Training of Foundation Models in Heterogeneous
Environments", NeurIPS 2022; DS3Lab/DT-FM's scheduler/heuristic_evolutionary_solver), as a
second planner to weigh OP-Fence's against.

DT-FM splits the devices into S groups of equal size k (a group holds one pipeline stage, every
stage the same number of layers: it assumes equal device speeds), and scores an assignment,
per step, by

    cost = DP cost + 2 x PP cost
    DP cost  max over groups g, members i of g: sum over the other members j of
             2 (lat(i, j) + G / (bw(i, j) k))             G: one stage's gradient bytes
    PP cost  the cheapest open path through all groups (a travelling-salesman path) of the
             cross costs between consecutive groups, cross(g, h) the bottleneck perfect
             matching of g's members to h's: min over matchings of max over pairs of
             lat(i, j) + A / bw(i, j)                      A: a member's activations per step

the factor 2 counting the activations forward and their gradients back. G is the mean stage's
parameters times the gradient element size (DT-FM's one gradient size for every stage); A is the
step's micro-batches times a position's sequences times one sequence's activation bytes. DT-FM's
bandwidth matrix is symmetric; here a pair's bandwidth is its slower direction.

A plan from an assignment: the groups in path order, each group's ranks ordered so that the
matching's pairs sit at the same position (the runtime's same-layout boundary sends position d
to position d), the first group's by rank; the layers as even as they divide (part_range: the
first stages one more).

Search: DT-FM runs a genetic algorithm (GCMA). Up to `EXHAUSTIVE_RANKS` ranks every partition
into groups is scored with the exact path (every order of the groups) and matchings; beyond, a
deterministic local search (seeded random starts, the best swap of two members of different
groups until none improves) stands in for it, and beyond EXHAUSTIVE_RANKS groups the path is
the best greedy one (from each start, the cheapest next group); tests/test_placement_planners.py
reports the local search's gap to the exhaustive search.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from megadomino.pipeline.placement.chains import Chain, pair_bandwidth
from megadomino.pipeline.placement.cost import Machine, Workload

EXHAUSTIVE_RANKS = 8
RESTARTS = 8


def pair_time(machine: Machine, i: int, j: int, nbytes: float) -> float:
    return machine.latency[i][j] + nbytes / pair_bandwidth(machine, i, j)


def dp_cost(machine: Machine, groups: Chain, grad_bytes: float) -> float:
    worst = 0.0
    for group in groups:
        k = len(group)
        for i in group:
            worst = max(worst, sum(2 * (machine.latency[i][j] + grad_bytes
                                        / (pair_bandwidth(machine, i, j) * k))
                                   for j in group if j != i))
    return worst


def matching(machine: Machine, src: tuple[int, ...], dst: tuple[int, ...], nbytes: float
             ) -> tuple[float, tuple[int, ...]]:
    """The bottleneck perfect matching of `src` to `dst`: (its cost, dst reordered so that
    dst[d] is matched with src[d]); thresholds tried from the least, each by augmenting paths."""
    times = [[pair_time(machine, i, j, nbytes) for j in dst] for i in src]
    for bound in sorted({t for row in times for t in row}):
        match = _perfect(times, bound)
        if match is not None:
            return bound, tuple(dst[match[d]] for d in range(len(src)))
    raise ValueError("groups of different sizes have no perfect matching")


def _perfect(times: list[list[float]], bound: float) -> list[int] | None:
    """A perfect matching using pairs of time <= bound (Kuhn's augmenting paths), or None."""
    owner: dict[int, int] = {}

    def augment(row: int, seen: set[int]) -> bool:
        for col, seconds in enumerate(times[row]):
            if seconds <= bound and col not in seen:
                seen.add(col)
                if col not in owner or augment(owner[col], seen):
                    owner[col] = row
                    return True
        return False

    if not all(augment(row, set()) for row in range(len(times))):
        return None
    return [col for _, col in sorted((row, col) for col, row in owner.items())]


def pp_cost(machine: Machine, groups: Chain, act_bytes: float) -> tuple[float, Chain]:
    """The cheapest open path (its cost, the groups in path order, each matched to the one
    before it); every order tried, the first found on ties."""
    count = len(groups)
    cross = {(a, b): matching(machine, groups[a], groups[b], act_bytes)
             for a in range(count) for b in range(count) if a != b}
    total, order = min(((sum(cross[pair][0] for pair in zip(order, order[1:])), order)
                        for order in _orders(cross, count)), key=lambda found: found[0])
    path = [tuple(sorted(groups[order[0]]))]
    for b in order[1:]:
        path.append(matching(machine, path[-1], groups[b], act_bytes)[1])
    return total, tuple(path)


def _orders(cross: dict, count: int) -> Iterator[tuple[int, ...]]:
    """Every order of the groups up to EXHAUSTIVE_RANKS of them; beyond, the greedy paths
    (from each start, the cheapest next group) stand in for the exact path."""
    if count <= EXHAUSTIVE_RANKS:
        yield from itertools.permutations(range(count))
        return
    for start in range(count):
        order = [start]
        while len(order) < count:
            order.append(min((g for g in range(count) if g not in order),
                             key=lambda g: (cross[(order[-1], g)][0], g)))
        yield tuple(order)


def score(machine: Machine, work: Workload, groups: Chain) -> tuple[float, Chain]:
    """DT-FM's cost of a grouping and its chain (module docstring)."""
    stages = len(groups)
    total_params = (work.num_layers * work.layer_params + work.first_params + work.last_params)
    grad = total_params / stages * work.grad_bytes
    k = len(groups[0])
    act = work.micro_batches * work.micro_batch / k * work.activation_bytes
    path_cost, chain = pp_cost(machine, groups, act)
    return dp_cost(machine, groups, grad) + 2 * path_cost, chain


def groupings(ranks: tuple[int, ...], size: int) -> Iterator[Chain]:
    """Every partition of `ranks` into groups of `size` (unordered: each group's least rank
    comes first, groups by their least rank)."""
    if not ranks:
        yield ()
        return
    head, rest = ranks[0], ranks[1:]
    for others in itertools.combinations(rest, size - 1):
        group = (head, *others)
        left = tuple(rank for rank in rest if rank not in others)
        for tail in groupings(left, size):
            yield (group, *tail)


def search(machine: Machine, work: Workload, stages: int,
           exhaustive: bool | None = None) -> tuple[float, Chain]:
    """The least DT-FM cost over groupings into `stages` equal groups: (cost, chain)."""
    ranks = tuple(range(machine.world))
    size = machine.world // stages
    if exhaustive is None:
        exhaustive = machine.world <= EXHAUSTIVE_RANKS
    if exhaustive:
        return min((score(machine, work, groups) for groups in groupings(ranks, size)),
                   key=lambda found: found[0])
    best = None
    for seed in range(RESTARTS):
        order = list(ranks)
        random.Random(seed).shuffle(order)
        found = _local_search(machine, work, tuple(tuple(order[g * size:(g + 1) * size])
                                                   for g in range(stages)))
        if best is None or found[0] < best[0]:
            best = found
    return best


def _local_search(machine: Machine, work: Workload, groups: Chain) -> tuple[float, Chain]:
    """The best swap of two members of different groups, repeated while it improves."""
    current = score(machine, work, groups)
    while True:
        swaps = []
        for (a, b) in itertools.combinations(range(len(groups)), 2):
            for i, j in itertools.product(range(len(groups[a])), range(len(groups[b]))):
                moved = [list(group) for group in groups]
                moved[a][i], moved[b][j] = groups[b][j], groups[a][i]
                trial = tuple(tuple(group) for group in moved)
                swaps.append((score(machine, work, trial), trial))
        found, trial = min(swaps, key=lambda pair: pair[0][0], default=(current, groups))
        if found[0] >= current[0]:
            return current
        current, groups = found, trial
