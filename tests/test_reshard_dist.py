"""Cross-mesh resharding on gloo ranks: for every pair of layouts on a source and a destination
mesh (disjoint, all ranks of the world), every strategy and every solver, the destination tiles
are bit-identical to slices of the full tensor, the gradient going back gives the source tiles
of the full gradient bit-identically, and the bytes the ranks sent over each (sender, receiver)
pair equal the plan's edges (so its per-link bytes are what was sent).

Default tier: worlds of 2, 3 and 4 ranks (every source + destination split of them, 1-D meshes,
replicated or sharded along each dim of an odd (5, 7, 3) tensor, so some tiles are uneven and
some empty). Slow tier: worlds of 5, 6 and 8 with 2-D meshes (e.g. TP x batch-split DP). One
case per (world, strategy) runs every layout pair and solver, to keep process launches few.
Plans made for NCCL with one NIC per GPU (network.py) run here too: their all-gather exchange is
a ring (each part chained from its owner), their senders balanced per device."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys

import pytest
import torch
import torch.distributed as dist

from dist_utils import C, DistSuite
from megadomino.pipeline.reshard import STRATEGIES, Layout, Mesh, make_plan
from megadomino.pipeline.reshard.layout import box_slices
from megadomino.pipeline.reshard.network import Network
from megadomino.pipeline.reshard.solvers import solver_name

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


def _benchmark(name: str):
    """benchmarks/NAME.py: the blocking runner of a plan, and the solvers beyond training's."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_RUNNER = _benchmark("reshard_runner")
GroupCache, Reshard = _RUNNER.GroupCache, _RUNNER.Reshard
SOLVERS = _benchmark("reshard_solvers").solvers(seed=7)

SHAPE = (5, 7, 3)


def host_of(rank: int) -> str:
    """Two ranks per host, so meshes share hosts in some splits and not in others."""
    return f"h{rank // 2}"


def mesh_shapes(size: int, two_d: bool) -> list[tuple[int, ...]]:
    """(2, 2) and (3, 2) meshes in the slow tier's worlds, one axis otherwise."""
    return [{4: (2, 2), 6: (3, 2)}.get(size, (size,))] if two_d else [(size,)]


def layouts(mesh: Mesh) -> list[Layout]:
    """Replicated, and sharded along each dim over each axis (and both axes of a 2-D mesh)."""
    ndim = len(SHAPE)
    found = [Layout.replicated(mesh, ndim)]
    if len(mesh.ranks) == 1:
        return found
    axes_choices = [(0,)] if len(mesh.shape) == 1 else [(0,), (1,), (0, 1), (1, 0)]
    for dim, axes in itertools.product(range(ndim), axes_choices):
        found.append(Layout(mesh, tuple(axes if d == dim else () for d in range(ndim))))
    if len(mesh.shape) == 2:  # two dims split at once: batch over axis 0, hidden over axis 1
        found.append(Layout(mesh, ((), (0,), (1,))))
        found.append(Layout(mesh, ((1,), (), (0,))))
    return found


def layout_pairs(world: int, two_d: bool) -> list[tuple[Layout, Layout]]:
    pairs = []
    for n_src in range(1, world):
        src_ranks, dst_ranks = tuple(range(n_src)), tuple(range(n_src, world))
        for src_shape, dst_shape in itertools.product(mesh_shapes(n_src, two_d),
                                                      mesh_shapes(world - n_src, two_d)):
            if two_d and len(src_shape) + len(dst_shape) == 2:
                continue  # the default tier has the 1-D pairs
            src = Mesh(src_ranks, tuple(map(host_of, src_ranks)), src_shape)
            dst = Mesh(dst_ranks, tuple(map(host_of, dst_ranks)), dst_shape)
            pairs += list(itertools.product(layouts(src), layouts(dst)))
    return pairs


def check_strategy(strategy: str, groups: GroupCache, world: int, two_d: bool,
                   network: Network | None = None) -> None:
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(world)
    activation = torch.randn(SHAPE, generator=generator)
    gradient = torch.randn(SHAPE, generator=generator)
    failures = []
    for (src, dst), solver in itertools.product(layout_pairs(world, two_d), SOLVERS):
        plan = make_plan(SHAPE, torch.float32, src, dst, strategy, solver, chunks=3,
                         network=network)
        where = (f"{strategy}/{solver_name(solver)} {src.mesh.shape}{src.dims} -> "
                 f"{dst.mesh.shape}{dst.dims}"
                 f"{'' if network is None else ' ' + network.describe()}")
        for direction, current, full in ((" forward", plan, activation),
                                         (" backward", plan.backward(), gradient)):
            transport = Reshard(current, groups)
            mine = current.src.tile(SHAPE, rank) if rank in current.src.mesh.ranks else None
            out = transport.run(full[box_slices(mine)].clone() if mine is not None else None)
            if rank in current.dst.mesh.ranks:
                expected = full[box_slices(current.dst.tile(SHAPE, rank))]
                if not torch.equal(out, expected):
                    failures.append(f"{where}{direction}: rank {rank}'s tile differs")
            elif out is not None:
                failures.append(f"{where}{direction}: rank {rank} outside dst got a tile")
            sent = [None] * world
            dist.all_gather_object(sent, transport.sent)
            edges = {(source, target): nbytes for source, row in enumerate(sent)
                     for target, nbytes in row.items()}
            if edges != current.edge_bytes():
                failures.append(f"{where}{direction}: sent {edges} != plan "
                                f"{current.edge_bytes()}")
    assert not failures, f"{len(failures)} failures, first 5:\n" + "\n".join(failures[:5])


SUITE = DistSuite(worlds=(2, 3, 4), timeout=300)


@SUITE.setup
def _setup(world: int) -> dict:
    return {"groups": GroupCache()}


for _strategy in STRATEGIES:
    SUITE.case(f"reshard-{_strategy}", check_strategy, _strategy, C.groups, C.world, False)
RINGS = Network("nccl", gpus_per_host=2, nics_per_host=2)  # host_of: two ranks per host
for _strategy in ("send_recv_allgather", "broadcast"):
    SUITE.case(f"reshard-rings-{_strategy}", check_strategy, _strategy, C.groups, C.world, False,
               RINGS)

test_reshard = SUITE.test()

SLOW = DistSuite(worlds=(5, 6, 8), timeout=900)
SLOW.setup(_setup)
for _strategy in STRATEGIES:
    SLOW.case(f"reshard-2d-{_strategy}", check_strategy, _strategy, C.groups, C.world, True)

test_reshard_2d_meshes = SLOW.test(marks=(pytest.mark.slow,))
