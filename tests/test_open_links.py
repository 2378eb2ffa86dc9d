"""Every pipeline communicator is connected at set-up, in one order on every rank
(comm.open_links): NCCL connects a pair of ranks at their first send / receive on a
communicator, inside the host call that starts it, which returns only once the peer starts
its own; left to a step, two ranks could each wait in a different channel's connection. Here,
on gloo: the links each rank hands to
open_links are the same list on every rank (so the earliest unopened link always has all its
members at it), every channel and route group of the rank is among them with the direction
its pass moves, the channels and routes work after it (a message each way, in an order no
schedule uses), and a kind open_links does not know is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_pipeline_hetero import PLANS, file_plan

from dist_utils import DistSuite
from megadomino.distributed import ParallelDims, comm
from megadomino.pipeline.reshard.boundary import boundary_routes, route_groups, stage_layout
from megadomino.pipeline.reshard.network import nominal_network
from megadomino.pipeline.transport_p2p import channel


def _held(group) -> bool:
    return group is not None and group != dist.GroupMember.NON_GROUP_MEMBER


def _recorded(make):
    """(what `make()` returned, the links it handed to comm.open_links without their groups,
    [(group's ranks, link)] of the links whose group this rank holds)."""
    seen, mine = [], []
    real = comm.open_links

    def record(links):
        for kind, group, *ends in links:
            seen.append((kind, *ends))
            if _held(group):
                ranks = tuple(sorted(dist.get_process_group_ranks(group)))
                mine.append((ranks, (kind, *ends)))
        real(links)

    comm.open_links = record
    try:
        return make(), seen, mine
    finally:
        comm.open_links = real


def _same_everywhere(seen: list) -> None:
    everyone = comm.all_gather_object(seen)
    assert seen and all(other == seen for other in everyone), everyone


def check_channels(pp: int, chunks: int, nccl: dict | None = None) -> None:
    """`nccl`: the groups made with those NCCL settings (--nccl-communicator-config-path;
    on gloo they do not apply)."""
    dims = ParallelDims(tp=1, pp=pp, nccl=nccl)
    if nccl is not None and dist.get_backend() == "nccl":
        assert dims.options("pp").config.max_ctas == nccl["pp"]["max_ctas"]
    else:
        assert dims.options("pp") is None
    channels, seen, mine = _recorded(lambda: dims.pipeline_channels(chunks))
    _same_everywhere(seen)
    stage, position = dims.pp_rank, dims.stages[dims.pp_rank][0].index(dims.rank)
    expected = []
    for (pass_, b), group in sorted(channels.items(), reverse=True):  # an order no schedule has
        sends = channel(pass_, True, stage, pp) == (pass_, b)
        peer_stage = (stage + 1 if (pass_ == "F") == sends else stage - 1) % pp
        peer = dims.stages[peer_stage][0][position]
        sender, receiver = (dims.rank, peer) if sends else (peer, dims.rank)
        expected.append((tuple(sorted((sender, receiver))), ("p2p", sender, receiver)))
        value = torch.tensor([float(100 * b + sender)], device=comm.group_device(group))
        if sends:
            comm.batch_p2p([comm.send_op(value, receiver, group=group)]).wait()
        else:
            got = torch.zeros(1, device=value.device)
            comm.batch_p2p([comm.recv_op(got, sender, group=group)]).wait()
            assert got.item() == value.item()
    assert sorted(mine) == sorted(expected)


def check_routes(plan_name: str, strategy: str) -> None:
    plan = file_plan(*PLANS[plan_name])
    shape = (6, 2, 8)
    layouts = [stage_layout(stage, shape, False, dist.get_world_size())
               for stage in plan.stages]
    network, rate = nominal_network("gloo", dist.get_world_size(), 1)
    routes = boundary_routes(layouts[0], layouts[1], shape, torch.float32, strategy, network,
                             rate)
    ways, seen, mine = _recorded(lambda: [route_groups(route) for route in routes])
    _same_everywhere(seen)
    held = {ranks for way in ways for ranks, group in way.items() if _held(group)}
    assert held and held == {ranks for ranks, _ in mine}


def _setup(world: int) -> dict:
    return {}


SUITE = DistSuite(worlds=(2,))
SUITE.setup(_setup)
SUITE.case("channels-pp2-interleaved", check_channels, 2, 2)
SUITE.case("channels-pp2", check_channels, 2, 1)
SUITE.case("channels-pp4-interleaved", check_channels, 4, 2, worlds=(4,))
SUITE.case("channels-pp2-dp2-interleaved", check_channels, 2, 2, worlds=(4,))
NCCL_SETTINGS = {"pp": {"max_ctas": 2, "min_ctas": 1}, "dp": {"is_high_priority_stream": True},
                 "tp": {"cga_cluster_size": 2}}
SUITE.case("channels-pp2-nccl-settings", check_channels, 2, 1, NCCL_SETTINGS)
SUITE.case("channels-pp2-dp2-nccl-settings", check_channels, 2, 2, NCCL_SETTINGS, worlds=(4,))
for strategy in ("send-recv", "broadcast", "scatter-gather"):
    SUITE.case(f"routes-tp2-tp1-{strategy}", check_routes, "tp2_tp1", strategy, worlds=(3,))

test_links_open_in_one_order = SUITE.test()


@pytest.mark.usefixtures("single_process_group")
def test_an_unknown_link_kind_is_refused():
    with pytest.raises(ValueError, match="unknown link kind 'reduce'"):
        comm.open_links([("reduce", dist.group.WORLD)])
