"""A --pipeline-plan boundary as training moves it (pipeline/reshard/boundary.py), without
processes: under every strategy each receiving rank's pieces (messages, broadcasts, all-gather
parts) tile exactly its part of the activation and of the gradient, uneven splits included;
broadcasts and gathers appear where a tile has replicas; `auto` on the nominal networks takes
the broadcast for a large TP1 -> TP2 activation on NCCL and send/recv back, send/recv on one
gloo host; --nics-per-node moves the senders from per host to per device; the flags are refused
without a plan or with more NICs than GPUs, one line each."""

from __future__ import annotations

import pytest
import torch
from test_pipeline_hetero import GOOD, plan_config, plan_file

from megadomino.config import ConfigError
from megadomino.config.pipeline_plan import Stage
from megadomino.config.validate import validate
from megadomino.pipeline.reshard.boundary import STRATEGY_OF, boundary_routes, stage_layout
from megadomino.pipeline.reshard.layout import box_intersection, box_numel
from megadomino.pipeline.reshard.network import nominal_network

SHAPE = (6, 5, 8)  # (seq, batch, hidden): batch 5 splits unevenly over 2 and 3
BOUNDARIES = {  # name -> (stage b, stage b + 1, sequence parallel): (ranks, tp)
    "tp1-tp2": (((0,), 1), ((1, 2), 2), False),
    "tp2-tp1": (((0, 1), 2), ((2,), 1), False),
    "dp2-tp2": (((0, 1), 1), ((2, 3), 2), False),
    "dp2tp2-sp-tp1": (((0, 1, 2, 3), 2), ((4,), 1), True),
    "dp2-dp3tp2": (((0, 1), 1), ((2, 3, 4, 5, 6, 7), 2), False),
}


def layouts(name: str, gpus_per_node: int = 8):
    (src_ranks, src_tp), (dst_ranks, dst_tp), sp = BOUNDARIES[name]
    return tuple(stage_layout(Stage(index, ranks, tp, ((0, 1),)), SHAPE, sp, gpus_per_node)
                 for index, (ranks, tp) in enumerate(((src_ranks, src_tp),
                                                      (dst_ranks, dst_tp))))


def received(route, rank: int) -> list[tuple]:
    """(box, start, stop) of every piece `rank` ends up with: its messages, broadcasts and the
    all-gathered parts of its slices."""
    pieces = [(m.piece.box, m.piece.start, m.piece.stop) for m in route.messages
              if m.receiver == rank]
    pieces += [(b.box, 0, box_numel(b.box)) for b in route.broadcasts
               if rank in b.ranks and rank != b.sender]
    for gather in route.gathers:
        if rank in gather.replicas:
            mine = gather.parts[gather.replicas.index(rank)]
            pieces += [(gather.box, *part) for part in gather.parts if part != mine]
    return pieces


def assert_tiles_covered(route) -> None:
    """Each receiving rank's pieces cover its tile exactly once: the boxes lie in the tile, the
    flat ranges of one box do not overlap, and they add up to the tile."""
    for rank in route.dst.mesh.ranks:
        tile = route.dst.tile(SHAPE, rank)
        by_box: dict = {}
        for box, start, stop in received(route, rank):
            assert box_intersection(box, tile) == box, (rank, box, tile)
            by_box.setdefault(box, []).append((start, stop))
        for box, ranges in by_box.items():
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == box_numel(box), (rank, box, ranges)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (rank, box, ranges)
        assert sum(box_numel(box) for box in by_box) == box_numel(tile), (rank, by_box)


@pytest.mark.parametrize("strategy", ["auto", *STRATEGY_OF])
@pytest.mark.parametrize("name", list(BOUNDARIES))
def test_every_rank_receives_its_tile_exactly_once(name, strategy):
    network, rate = nominal_network("nccl", 8, 1)
    forward, backward = boundary_routes(*layouts(name), SHAPE, torch.float32, strategy,
                                        network, rate)
    for route in (forward, backward):
        assert_tiles_covered(route)
        if strategy != "auto":
            assert route.plan.strategy == STRATEGY_OF[strategy]
        replicated = any(len(ranks) > 1 for ranks in route.dst.tiles(SHAPE).values())
        assert bool(route.broadcasts) == (route.plan.strategy == "broadcast")
        assert bool(route.gathers) == (route.plan.strategy == "send_recv_allgather"
                                       and replicated)


def test_auto_broadcasts_a_large_activation_to_tp_replicas_on_nccl_only():
    shape = (4096, 8, 4096)  # 512 MiB of fp32: bandwidth, not latency, decides
    src, dst = (stage_layout(Stage(i, ranks, tp, ((0, 1),)), shape, False, 8)
                for i, (ranks, tp) in enumerate((((0,), 1), ((1, 2), 2))))
    nccl = boundary_routes(src, dst, shape, torch.float32, "auto", *nominal_network("nccl", 8, 1))
    assert [route.plan.strategy for route in nccl] == ["broadcast", "send_recv"]
    gloo = boundary_routes(src, dst, shape, torch.float32, "auto", *nominal_network("gloo", 8, 1))
    assert [route.plan.strategy for route in gloo] == ["send_recv", "send_recv"]
    line = nccl[0].describe()
    assert line.startswith("ranks 0 -> 1,2 (4096, 8, 4096) float32: broadcast (least_bytes; "
                           "nccl, senders balanced per host) predicted ")
    assert "weighed send_recv" in line and "\n" not in line


@pytest.mark.parametrize("nics, senders", [(1, [0, 0, 2, 2]), (4, [0, 1, 2, 3])])
def test_nics_per_node_balances_senders_per_host_or_per_device(nics, senders):
    """DP2 x TP2 on one host of 4 GPUs -> DP4 on another: each source tile has two holders;
    one NIC a host sends every quarter through it, one a GPU spreads them over the devices."""
    stages = (Stage(0, (0, 1, 2, 3), 2, ((0, 1),)), Stage(1, (4, 5, 6, 7), 1, ((1, 2),)))
    shape = (8, 8, 4)
    src, dst = (stage_layout(stage, shape, False, 4) for stage in stages)
    forward, _ = boundary_routes(src, dst, shape, torch.float32, "send-recv",
                                 *nominal_network("nccl", 4, nics))
    assert [m.sender for m in forward.messages] == senders


def test_same_layout_boundaries_go_rank_to_rank():
    stage = Stage(0, (0, 1), 2, ((0, 1),))
    src = stage_layout(stage, SHAPE, True, 8)
    dst = stage_layout(Stage(1, (2, 3), 2, ((1, 2),)), SHAPE, True, 8)
    forward, backward = boundary_routes(src, dst, SHAPE, torch.float32, "broadcast",
                                        *nominal_network("gloo", 8, 1))
    assert forward.plan is None and not forward.broadcasts
    assert [(m.sender, m.receiver) for m in forward.messages] == [(0, 2), (1, 3)]
    assert [(m.sender, m.receiver) for m in backward.messages] == [(2, 0), (3, 1)]
    assert forward.describe() == "ranks 0,1 -> 2,3: same layout, rank to rank"


@pytest.mark.parametrize("leaves, message", [
    (dict(pipeline_reshard="broadcast"), "--pipeline-reshard needs --pipeline-plan"),
    (dict(nics_per_node=2), "--nics-per-node needs --pipeline-plan"),
])
def test_the_reshard_flags_need_a_plan(leaves, message):
    config = plan_config(None, pp=1, **leaves)
    with pytest.raises(ConfigError, match=message) as error:
        validate(config, 2)
    assert "\n" not in str(error.value)


def test_a_node_has_at_most_one_nic_per_gpu(tmp_path):
    path = plan_file(tmp_path, GOOD)
    validate(plan_config(path, nics_per_node=3), 3, 3)
    with pytest.raises(ConfigError, match=r"--nics-per-node=4 is invalid: it must be between 1 "
                                          r"and the GPUs per node \(3"):
        validate(plan_config(path, nics_per_node=4), 3, 3)
    with pytest.raises(ConfigError, match="--pipeline-reshard=ring is invalid"):
        validate(plan_config(path, pipeline_reshard="ring"), 3)
