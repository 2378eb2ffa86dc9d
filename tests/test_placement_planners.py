"""The placement planners (megadomino/pipeline/placement/) on 20 hand-made machines of at most 8
ranks, links in the 8 Mbit/s - 10 Gbit/s tiers: for a given chain the dynamic-programming layer
cut equals brute force; OP-Fence's and DT-FM's searches equal an independent enumeration of
their own spaces on their own objectives; the brute-force oracle is never beaten on the
objective it shares with OP-Fence (and is OP-Fence's own search up to ALL_CHAINS_RANKS ranks);
and the gaps (OP-Fence to the oracle, DT-FM's local search
to its exhaustive search) are printed (`pytest -s`). No timings: costs are arithmetic."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from megadomino.config.pipeline_plan import plan_file, read_plan
from megadomino.pipeline.placement import dtfm
from megadomino.pipeline.placement.chains import (
    Rules,
    all_chains,
    clusters,
    fastest_first,
    op_fence_chains,
)
from megadomino.pipeline.placement.cost import Machine, Workload, boundary_times, stage_costs
from megadomino.pipeline.placement.cut import best_cut, brute_cut
from megadomino.pipeline.placement.planners import (
    ALL_CHAINS_RANKS,
    Costs,
    best_per_count,
    brute_force,
    dt_fm,
    op_fence,
)

MBIT = 1e6 / 8  # bytes/s
TIER = {"8M": 8 * MBIT, "100M": 100 * MBIT, "1G": 1000 * MBIT, "10G": 10000 * MBIT}
FAST, HALF = 1e11, 5e10  # FLOP/s


def sites(sizes, uplinks, intra="10G", speeds=None, latency=1e-4) -> Machine:
    """Hosts of `sizes` ranks; inside a host `intra`, between hosts the slower uplink (a star)."""
    host = [h for h, size in enumerate(sizes) for _ in range(size)]
    world = len(host)
    bandwidth = [[TIER[intra] if host[i] == host[j] else
                  min(TIER[uplinks[host[i]]], TIER[uplinks[host[j]]]) for j in range(world)]
                 for i in range(world)]
    return Machine.uniform(speeds or [FAST] * world, bandwidth, latency)


def matrix(rows: list[str], speeds=None, latency=2e-4) -> Machine:
    """A hand-written matrix: rows[i] the tiers from rank i to every rank ('-' on the diagonal)."""
    cells = [row.split() for row in rows]
    bandwidth = [[0.0 if cell == "-" else TIER[cell] for cell in row] for row in cells]
    return Machine.uniform(speeds or [FAST] * len(rows), bandwidth, latency)


CASES = {
    "2 sites 100M": sites([2, 2], ["100M", "100M"]),
    "3 sites A2 B1 C1, C at 8M": sites([2, 1, 1], ["100M", "100M", "8M"]),
    "3 sites, C half speed": sites([2, 1, 1], ["100M", "100M", "8M"],
                                   speeds=[FAST, FAST, FAST, HALF]),
    "3 sites, B half speed": sites([2, 1, 1], ["100M", "100M", "8M"],
                                   speeds=[FAST, FAST, HALF, FAST]),
    "4 singles 1G": sites([1, 1, 1, 1], ["1G"] * 4),
    "4 singles mixed": sites([1, 1, 1, 1], ["10G", "1G", "100M", "8M"]),
    "one host of 4": sites([4], ["1G"]),
    "one host of 5, uneven speeds": sites([5], ["1G"], speeds=[FAST, HALF, FAST, HALF, FAST]),
    "2 hosts of 3, 1G intra": sites([3, 3], ["8M", "100M"], intra="1G"),
    "3 hosts 2+2+2": sites([2, 2, 2], ["1G", "100M", "8M"]),
    "2+1+1+1 tiers": sites([2, 1, 1, 1], ["10G", "1G", "100M", "8M"]),
    "6 singles 100M": sites([1] * 6, ["100M"] * 6),
    "4+2, slow pair": sites([4, 2], ["1G", "8M"], speeds=[FAST] * 4 + [HALF] * 2),
    "2+2+2+2 uniform 1G": sites([2, 2, 2, 2], ["1G"] * 4),
    "8 on one host": sites([8], ["10G"], intra="10G"),
    "4+4 at 100M": sites([4, 4], ["100M", "100M"]),
    "asymmetric pair": matrix(["- 8M", "1G -"]),
    "asymmetric 3": matrix(["- 10G 8M", "100M - 1G", "1G 8M -"]),
    "asymmetric 4, slow rank 3": matrix(["- 1G 1G 8M", "1G - 10G 100M", "1G 10G - 100M",
                                         "100M 8M 8M -"], speeds=[FAST, FAST, FAST, HALF]),
    "ring of 5": matrix(["- 1G 8M 8M 1G", "1G - 1G 8M 8M", "8M 1G - 1G 8M",
                         "8M 8M 1G - 1G", "1G 8M 8M 1G -"]),
}
ORACLE_RANKS = 6  # brute force over every ordered partition, kept quick


def workload(layers: int = 6, micro_batch: int = 4, tied: bool = False) -> Workload:
    """A 1.3B-like layer (h 2048, s 1024) in bf16: compute and transfers of one order."""
    hidden, seq = 2048, 1024
    return Workload(num_layers=layers, layer_flops=2 * seq * 12 * hidden ** 2,
                    head_flops=2 * seq * hidden * 50304, activation_bytes=seq * hidden * 2,
                    layer_params=12 * hidden ** 2, first_params=50304 * hidden,
                    last_params=2 * hidden + (50304 * hidden if tied else 0),
                    tied_params=50304 * hidden if tied else 0, grad_bytes=4,
                    micro_batch=micro_batch, micro_batches=8)


def key_of(work: Workload, machine: Machine, chain) -> tuple[float, float]:
    """OP-Fence's (bottleneck, fill) of a chain, by brute-force cut: independent of Costs."""
    links = [boundary_times(work, machine, a, b) for a, b in zip(chain, chain[1:])]
    costs = np.stack([stage_costs(work, machine, ranks) for ranks in chain])
    cut = brute_cut(costs, max(max(pair) for pair in links))
    if cut is None:
        return math.inf, math.inf
    return cut.bottleneck, cut.total + sum(sum(pair) for pair in links)


def _close(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] == b[0] and a[1] == pytest.approx(b[1], rel=1e-9)


@pytest.mark.parametrize("name", CASES)
def test_the_layer_cut_equals_brute_force(name):
    machine, work = CASES[name], workload(layers=7)
    costs = Costs(work, machine)
    chains = list(itertools.islice(all_chains(machine, Rules(7, 4, False)), 0, None, 97))[:12]
    chains += list(itertools.islice(op_fence_chains(machine, Rules(7, 4, False)), 12))
    assert chains
    for chain in chains:
        table = np.stack([costs.stage(ranks) for ranks in chain])
        floor = max(max(pair) for pair in costs.links(chain))
        fast, slow = best_cut(table, floor), brute_cut(table, floor)
        if slow is None:
            assert fast is None
            continue
        assert fast.bottleneck == slow.bottleneck, chain
        assert fast.total == pytest.approx(slow.total, rel=1e-12), chain
        each = [float(table[s, a, b]) for s, (a, b) in enumerate(fast.spans)]
        assert max(floor, *each) == fast.bottleneck  # the cut reaches what it claims
        bounds = [a for a, _ in fast.spans] + [fast.spans[-1][1]]
        assert bounds[0] == 0 and bounds[-1] == 7 and bounds == sorted(set(bounds)), fast.spans


def _splits(ranks):
    """Every split into consecutive groups, by bitmask (independent of chains.splits)."""
    for mask in range(1 << (len(ranks) - 1)):
        groups, current = [], [ranks[0]]
        for index, rank in enumerate(ranks[1:]):
            if mask >> index & 1:
                groups.append(tuple(current))
                current = []
            current.append(rank)
        yield (*groups, tuple(current))


def _cluster_stages(machine: Machine, group) -> list:
    """A cluster's ranks by speed either way, every split, each stage fastest first."""
    fastest = fastest_first(machine, group)
    return list({tuple(fastest_first(machine, stage) for stage in split): None
                 for ranks in (fastest, fastest[::-1]) for split in _splits(ranks)})


@pytest.mark.parametrize("name", CASES)
def test_op_fence_searches_its_chains_exhaustively(name):
    machine, work, rules = CASES[name], workload(), Rules(6, 4, False)
    found = best_per_count(op_fence_chains(machine, rules), Costs(work, machine))
    groups = clusters(machine)
    expected: dict[int, tuple[float, float]] = {}
    for order in itertools.permutations(groups):
        for parts in itertools.product(*(_cluster_stages(machine, g) for g in order)):
            chain = tuple(stage for part in parts for stage in part)
            if rules.allows(chain):
                key = key_of(work, machine, chain)
                expected[len(chain)] = min(expected.get(len(chain), key), key)
    assert sorted(found) == sorted(expected)
    for count, (_, chain) in found.items():
        assert _close(key_of(work, machine, chain), expected[count]), (count, chain)


def _dt_fm_cost(machine: Machine, work: Workload, groups) -> float:
    """DT-FM's objective by brute force: every path order, every matching."""
    stages, k = len(groups), len(groups[0])
    params = work.num_layers * work.layer_params + work.first_params + work.last_params
    grad = params / stages * work.grad_bytes
    act = work.micro_batches * work.micro_batch / k * work.activation_bytes

    def slow(i, j):
        return min(machine.bandwidth[i][j], machine.bandwidth[j][i])

    dp = max(sum(2 * (machine.latency[i][j] + grad / (slow(i, j) * k)) for j in g if j != i)
             for g in groups for i in g)

    def cross(a, b):
        return min(max(machine.latency[i][j] + act / slow(i, j) for i, j in zip(a, perm))
                   for perm in itertools.permutations(b))

    pp = min(sum(cross(groups[x], groups[y]) for x, y in zip(order, order[1:]))
             for order in itertools.permutations(range(stages)))
    return dp + 2 * pp


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.slow] if CASES[n].world == 6 and n != "3 hosts 2+2+2"
                 else []) for n in CASES if CASES[n].world <= 6])
def test_dt_fm_searches_its_groupings_exhaustively(name):
    """Every 6-rank machine takes seconds (720 orders a stage count): one in the default tier."""
    machine, work = CASES[name], workload()
    world = machine.world
    for stages in [s for s in range(2, world + 1) if world % s == 0]:
        k = world // stages
        best = min(_dt_fm_cost(machine, work, tuple(tuple(sorted(perm[g * k:(g + 1) * k]))
                                                      for g in range(stages)))
                   for perm in itertools.permutations(range(world)))
        cost, chain = dtfm.search(machine, work, stages, exhaustive=True)
        assert cost == pytest.approx(best, rel=1e-12), stages
        assert sorted(r for stage in chain for r in stage) == list(range(world))
        local, _ = dtfm.search(machine, work, stages, exhaustive=False)
        assert local >= cost * (1 - 1e-12)
        print(f"{name}: dt-fm S={stages} local search / exhaustive = {local / cost:.3f}")


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].world <= ORACLE_RANKS])
def test_the_oracle_is_never_beaten_on_its_objective(name):
    machine, work, rules = CASES[name], workload(), Rules(6, 4, False)
    costs = Costs(work, machine)
    oracle = best_per_count(all_chains(machine, rules), costs)
    ours = best_per_count(op_fence_chains(machine, rules), costs)
    for count, (cut, chain) in ours.items():
        best = costs.key(oracle[count][1])[:2]
        assert best <= costs.key(chain)[:2] or _close(best, costs.key(chain)[:2])
        print(f"{name}: S={count} op-fence bottleneck / oracle = "
              f"{cut.bottleneck / oracle[count][0].bottleneck:.3f}")
    placements = [op_fence(work, machine, rules), dt_fm(work, machine, rules),
                  brute_force(work, machine, rules)]
    print(name, " ".join(f"{p.planner} {p.estimate.step:.4g}s" for p in placements))


def test_clusters_fence_off_links_more_than_twice_slower():
    assert clusters(CASES["3 sites A2 B1 C1, C at 8M"]) == ((0, 1), (2,), (3,))
    assert clusters(CASES["2 hosts of 3, 1G intra"]) == ((0, 1, 2), (3, 4, 5))
    assert clusters(CASES["2+2+2+2 uniform 1G"]) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert clusters(CASES["6 singles 100M"]) == ((0, 1, 2, 3, 4, 5),)
    assert clusters(CASES["asymmetric pair"]) == ((0, 1),)  # one pair: one cluster


@pytest.mark.parametrize("tied", [False, True])
def test_every_planner_meets_the_rules(tied, tmp_path):
    machine = CASES["3 sites, C half speed"]
    for rules in (Rules(6, 4, tied), Rules(6, 1, tied), Rules(6, 4, tied, stages=2)):
        for planner in (op_fence, dt_fm, brute_force):
            if planner is dt_fm and rules.max_dp == 1 and rules.stages == 2:
                continue
            plan = planner(workload(tied=tied), machine, rules).plan
            chain = tuple(stage.ranks for stage in plan.stages)
            assert rules.allows(chain), (planner.__name__, chain)
            assert sorted(r for s in chain for r in s) == list(range(machine.world))
            assert [s.layers[0] for s in plan.stages][0][0] == 0
            written = tmp_path / "plan.json"
            written.write_text(plan_file(plan))
            assert read_plan(str(written), 6) == plan


def test_dt_fm_orders_a_stage_by_its_matching():
    """Ranks 0-1 and 2-3 are fast pairs across the groups {0, 3} and {1, 2}: the matching puts
    each rank at the position of its fast partner."""
    machine = matrix(["- 1G 8M 8M", "1G - 8M 8M", "8M 8M - 1G", "8M 8M 1G -"])
    _, chain = dtfm.pp_cost(machine, ((0, 3), (1, 2)), 1e6)
    assert chain in (((0, 3), (1, 2)), ((1, 2), (0, 3)))
    first, second = chain
    assert {(a, b) for a, b in zip(first, second)} in ({(0, 1), (3, 2)}, {(1, 0), (2, 3)})


@pytest.mark.parametrize("name", CASES)
def test_op_fences_heuristic_never_beats_its_exhaustive_search(name):
    """The heuristic that serves more than 8 clusters (or ranks a cluster), forced here: its
    gap to the exhaustive search on the same objective, printed."""
    machine, work, rules = CASES[name], workload(), Rules(6, 4, False)
    costs = Costs(work, machine)
    exact = best_per_count(op_fence_chains(machine, rules, exhaustive=True), costs)
    rough = best_per_count(op_fence_chains(machine, rules, exhaustive=False), costs)
    assert set(rough) <= set(exact)
    for count, (cut, chain) in rough.items():
        best = costs.key(exact[count][1])[:2]
        assert best <= costs.key(chain)[:2] or _close(best, costs.key(chain)[:2])
        print(f"{name}: S={count} op-fence heuristic / exhaustive bottleneck = "
              f"{cut.bottleneck / exact[count][0].bottleneck:.3f}")


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].world <= ALL_CHAINS_RANKS])
def test_op_fence_searches_every_chain_up_to_all_chains_ranks(name):
    """Up to ALL_CHAINS_RANKS ranks OP-Fence's plan is the oracle's: a stage may join ranks of
    different clusters (a batch split across a slow link) when the cost model says it pays."""
    machine, work, rules = CASES[name], workload(), Rules(6, 4, False)
    ours, oracle = op_fence(work, machine, rules), brute_force(work, machine, rules)
    assert ours.plan == oracle.plan and ours.estimate.step == oracle.estimate.step
    clustered = op_fence(work, machine, rules, exhaustive=True)
    assert ours.estimate.step <= clustered.estimate.step * (1 + 1e-12)
    print(f"{name}: op-fence over the clusters' chains / over every chain = "
          f"{clustered.estimate.step / ours.estimate.step:.3f}")
