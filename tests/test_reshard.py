"""Cross-mesh resharding without processes: tiles cover the tensor, the planner's slices cover
every destination tile exactly once, the bytes on each link equal the closed-form counts of each
strategy, the bounded search equals brute force on up to 6 works, the greedy solvers are never
worse than no balancing and are deterministic for a fixed seed, and bad input is refused. The
randomized greedy and the search are the benchmark's (benchmarks/reshard_solvers.py), passed to
make_plan as Solvers."""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import sys

import pytest
import torch

from megadomino.pipeline.reshard import STRATEGIES, Layout, Mesh, make_plan
from megadomino.pipeline.reshard.layout import box_numel, box_slices, part_range
from megadomino.pipeline.reshard.plan import binomial_edges, make_works, plan_transfers
from megadomino.pipeline.reshard.resharding import work_options
from megadomino.pipeline.reshard.solvers import choice_loads, makespan, solve, solver_name

_SPEC = importlib.util.spec_from_file_location(  # the benchmark's solvers
    "reshard_solvers", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks", "reshard_solvers.py"))
_SOLVERS = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = _SOLVERS  # its dataclasses look their module up there
_SPEC.loader.exec_module(_SOLVERS)
RandomGreedy, Search, every_solver = _SOLVERS.RandomGreedy, _SOLVERS.Search, _SOLVERS.solvers

SHAPE = (5, 7, 3)
MB = 4  # bytes per fp32 element


def mesh(first: int, hosts: str, shape: tuple[int, ...] = ()) -> Mesh:
    """Ranks first, first+1, ... on the hosts named by the letters of `hosts`."""
    return Mesh(tuple(range(first, first + len(hosts))), tuple(hosts), shape)


def some_layouts(on: Mesh) -> list[Layout]:
    found = [Layout.replicated(on, 3)]
    if len(on.shape) == 1:
        found += [Layout.sharded(on, 3, dim) for dim in range(3)]
    else:
        found += [Layout(on, ((0,), (1,), ())), Layout(on, ((), (1, 0), ())),
                  Layout(on, ((1,), (), ()))]
    return found


MESH_PAIRS = [(mesh(0, "A"), mesh(1, "BBCC")), (mesh(0, "AA"), mesh(2, "BC")),
              (mesh(0, "AB"), mesh(2, "BCC")), (mesh(0, "AABB", (2, 2)), mesh(4, "CCD")),
              (mesh(0, "AB"), mesh(2, "CCDD", (2, 2)))]
LAYOUT_PAIRS = [pair for src, dst in MESH_PAIRS
                for pair in itertools.product(some_layouts(src), some_layouts(dst))]


@pytest.mark.parametrize("size, parts", [(7, 3), (3, 4), (8, 4), (0, 2), (1, 1)])
def test_part_range_is_tensor_split(size, parts):
    pieces = torch.arange(size).tensor_split(parts)
    for index, piece in enumerate(pieces):
        start, stop = part_range(size, parts, index)
        assert piece.tolist() == list(range(start, stop))


@pytest.mark.parametrize("layout", [lay for src, dst in MESH_PAIRS for on in (src, dst)
                                    for lay in some_layouts(on)], ids=str)
def test_tiles_cover_the_tensor_once_per_replica_set(layout):
    count = torch.zeros(SHAPE, dtype=torch.int64)
    tiles = layout.tiles(SHAPE)
    for box in tiles:
        count[box_slices(box)] += 1
    assert torch.equal(count, torch.ones(SHAPE, dtype=torch.int64))
    holders = sorted(r for ranks in tiles.values() for r in ranks)
    assert holders == [r for r in layout.mesh.ranks if box_numel(layout.tile(SHAPE, r))]


def test_2d_layout_tiles():
    on = mesh(0, "AABB", (2, 2))  # ranks 0 1 / 2 3
    layout = Layout(on, ((), (0,), (1,)))
    assert layout.tile((4, 5, 3), 1) == ((0, 4), (0, 3), (2, 3))
    assert layout.tile((4, 5, 3), 2) == ((0, 4), (3, 5), (0, 2))
    both = Layout(on, ((1, 0),))  # axis 1 major: rank 2 (coords 1, 0) holds part 0*2 + 1
    assert [both.tile((8,), r) for r in range(4)] == [((0, 2),), ((4, 6),), ((2, 4),), ((6, 8),)]


@pytest.mark.parametrize("src, dst", LAYOUT_PAIRS, ids=str)
def test_slices_cover_each_destination_tile_once(src, dst):
    covered: dict = {}
    src_tiles = src.tiles(SHAPE)
    for transfer in plan_transfers(SHAPE, src, dst):
        holding = [ranks for box, ranks in src_tiles.items()
                   if all(lo <= start and stop <= hi
                          for (lo, hi), (start, stop) in zip(box, transfer.box))]
        assert holding == [transfer.senders]  # one source tile holds the slice: its replicas
        assert transfer.receivers == dst.tiles(SHAPE)[transfer.tile]
        count = covered.setdefault(transfer.tile, torch.zeros(SHAPE, dtype=torch.int64))
        count[box_slices(transfer.box)] += 1
    for tile, count in covered.items():
        expected = torch.zeros(SHAPE, dtype=torch.int64)
        expected[box_slices(tile)] = 1
        assert torch.equal(count, expected)
    assert set(covered) == set(dst.tiles(SHAPE))


# ---- bytes on each link ------------------------------------------------------------------------

HEADLINE = (Layout.replicated(mesh(0, "A"), 1), Layout.replicated(mesh(1, "BBCC"), 1))


@pytest.mark.parametrize("strategy, up_a, down_b, up_b", [
    ("send_recv", 4, 2, 0),             # four copies out of A
    ("send_recv_allgather", 1, 1.5, 1),  # a quarter to each, then the halves cross B <-> C
    ("broadcast", 3, 2, 1),             # gloo's binomial tree over 0..4: 0->1, 0->2, 1->3, 0->4
    ("chained_broadcast", 1, 1, 1),     # A -> B -> B -> C -> C: once over every link
])
def test_headline_link_bytes(strategy, up_a, down_b, up_b):
    nbytes = 1000 * MB
    plan = make_plan((1000,), torch.float32, *HEADLINE, strategy, "none")
    loads = plan.link_bytes()
    assert loads[("up", "A")] == up_a * nbytes
    assert loads[("down", "B")] == down_b * nbytes
    assert loads.get(("up", "B"), 0) == up_b * nbytes
    assert plan.makespan() == max(up_a, down_b, up_b) * nbytes


def test_binomial_edges_follow_gloo():
    # root 3 of 5: virtual ranks v -> (v + 3) % 5 over sorted members
    assert binomial_edges(3, (0, 1, 2, 4)) == [(3, 4), (3, 0), (4, 1), (3, 2)]


def formula_links(strategy: str, src: Layout, dst: Layout) -> dict:
    """Closed-form link bytes when every source rank is on host "A" (no sender choice matters):
    send/recv: every destination rank receives its tile over A's uplink; chain: every tile
    leaves A once, enters each host holding it once, and leaves each such host but the last."""
    host = dict(zip(dst.mesh.ranks, dst.mesh.hosts))
    loads: dict = {}

    def add(link, n):
        loads[link] = loads.get(link, 0) + n * MB

    for tile, ranks in dst.tiles(SHAPE).items():
        numel = box_numel(tile)
        if strategy == "send_recv":
            for rank in ranks:
                add(("up", "A"), numel)
                add(("down", host[rank]), numel)
            continue
        hosts = list(dict.fromkeys(host[r] for r in ranks))
        add(("up", "A"), numel)
        for index, name in enumerate(hosts):
            add(("down", name), numel)
            if index + 1 < len(hosts):
                add(("up", name), numel)
    return loads


@pytest.mark.parametrize("strategy", ["send_recv", "chained_broadcast"])
@pytest.mark.parametrize("dst", some_layouts(mesh(2, "BCBC")) + some_layouts(mesh(2, "BBC")),
                         ids=str)
def test_link_bytes_equal_the_formula(strategy, dst):
    for src in some_layouts(mesh(0, "AA")):
        plan = make_plan(SHAPE, torch.float32, src, dst, strategy, "least_bytes")
        rated = {link: n for link, n in plan.link_bytes().items() if link[0] != "local"}
        assert rated == formula_links(strategy, src, dst)


# ---- solvers -----------------------------------------------------------------------------------


def random_problem(rng: random.Random, works: int):
    hosts = ["A", "B", "C", "D"]
    options = []
    for _ in range(works):
        candidates = rng.randint(1, 3)
        options.append([{("up", rng.choice(hosts)): rng.randint(1, 9),
                         ("down", rng.choice(hosts)): rng.randint(1, 9)}
                        for _ in range(candidates)])
    rates = {(way, h): rng.choice([1.0, 2.0]) for h in hosts for way in ("up", "down")}
    fixed = {("down", "A"): rng.randint(0, 5)}
    return options, fixed, rates


def brute_force(options, fixed, rates) -> float:
    return min(makespan(choice_loads(options, fixed, choice), rates)
               for choice in itertools.product(*(range(len(o)) for o in options)))


@pytest.mark.parametrize("seed", range(40))
def test_search_equals_brute_force(seed):
    rng = random.Random(seed)
    options, fixed, rates = random_problem(rng, rng.randint(1, 6))
    found = solve(options, fixed, rates, Search())
    assert found.exact
    assert found.makespan == pytest.approx(brute_force(options, fixed, rates), rel=1e-12)
    assert found.makespan == makespan(choice_loads(options, fixed, found.choice), rates)


@pytest.mark.parametrize("seed", range(40))
def test_greedy_solvers_never_worse_than_none(seed):
    options, fixed, rates = random_problem(random.Random(seed), 12)
    plain = solve(options, fixed, rates, "none").makespan
    for solver in every_solver(seed):
        found = solve(options, fixed, rates, solver)
        assert found.makespan <= plain
        assert sorted(found.order) == list(range(len(options)))
        assert found.makespan == makespan(choice_loads(options, fixed, found.choice), rates)


@pytest.mark.parametrize("src, dst", LAYOUT_PAIRS[::3], ids=str)
def test_solvers_on_plans(src, dst):
    """On real plans: every solver no worse than none, and the search's answer the brute-force
    optimum where there are at most 6 works."""
    host_of = {**dict(zip(src.mesh.ranks, src.mesh.hosts)),
               **dict(zip(dst.mesh.ranks, dst.mesh.hosts))}
    for strategy in STRATEGIES:
        spans = {solver_name(solver): make_plan(SHAPE, torch.float32, src, dst, strategy,
                                                solver).makespan()
                 for solver in every_solver()}
        assert all(span <= spans["none"] for span in spans.values()), spans
        works = make_works(strategy, plan_transfers(SHAPE, src, dst))
        if len(works) <= 6:
            options, fixed = work_options(strategy, works, host_of, MB)
            rates = {(way, h): 1.0 for h in host_of.values() for way in ("up", "down")}
            assert spans["search"] == brute_force(options, fixed, rates)


def test_random_greedy_is_deterministic_for_a_seed():
    options, fixed, rates = random_problem(random.Random(5), 20)
    runs = [solve(options, fixed, rates, RandomGreedy(11)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    others = {solve(options, fixed, rates, RandomGreedy(s)).choice for s in range(8)}
    assert len(others) > 1  # the seed does steer it
    src, dst = Layout.replicated(mesh(0, "AB"), 3), Layout.sharded(mesh(2, "CCDD"), 3, 0)
    plans = [make_plan(SHAPE, torch.float32, src, dst, "send_recv", RandomGreedy(3))
             for _ in range(2)]
    assert plans[0] == plans[1]


def test_balancing_spreads_senders_over_hosts():
    src = Layout.replicated(mesh(0, "AB"), 3)
    dst = Layout.sharded(mesh(2, "CCDD"), 3, 0)
    none = make_plan(SHAPE, torch.float32, src, dst, "send_recv", "none")
    best = make_plan(SHAPE, torch.float32, src, dst, "send_recv", Search())
    assert {step.sender for step in none.steps} == {0}
    assert {step.sender for step in best.steps} == {0, 1}
    assert best.makespan() < none.makespan()


def test_auto_takes_the_chain_only_where_it_lowers_the_bound():
    assert make_plan((1000,), torch.float32, *HEADLINE).strategy == "chained_broadcast"
    one_to_one = (Layout.replicated(mesh(0, "A"), 3), Layout.sharded(mesh(1, "BC"), 3, 1))
    assert make_plan(SHAPE, torch.float32, *one_to_one).strategy == "send_recv"


def test_backward_plan_reverses_the_layouts():
    src, dst = LAYOUT_PAIRS[5]
    plan = make_plan(SHAPE, torch.float32, src, dst, "broadcast", "least_bytes", chunks=4)
    back = plan.backward()
    assert (back.src, back.dst, back.strategy, back.chunks) == (dst, src, "broadcast", 4)


@pytest.mark.parametrize("call, match", [
    (lambda: Mesh((0, 0), ("A", "A")), "distinct"),
    (lambda: Mesh((0, 1), ("A",)), "hosts"),
    (lambda: Mesh((0, 1, 2), "ABC", (2, 2)), "shape"),
    (lambda: Layout(mesh(0, "AB"), ((0,), (0,))), "at most one"),
    (lambda: make_plan((4,), torch.float32, Layout.replicated(mesh(0, "AB"), 1),
                       Layout.replicated(mesh(1, "B"), 1)), "overlap"),
    (lambda: make_plan((4,), torch.float32, *HEADLINE, "scatter"), "strategy"),
    (lambda: make_plan((4,), torch.float32, *HEADLINE, "send_recv", "optimal"), "solver"),
    (lambda: make_plan((4,), torch.float32, *HEADLINE, chunks=0), "chunks"),
    (lambda: HEADLINE[0].tile((4, 4), 0), "dims"),
])
def test_refuses_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
