"""A boundary of a --pipeline-plan in training: what every rank sends, receives, broadcasts and
all-gathers to move one micro-batch's activation from stage b to stage b + 1 (a `Route`), and
its gradient back (another), under the strategy --pipeline-reshard names.

A route is planned once, on every rank alike (make_plan is a pure function), from the two
stages' layouts of the (seq, batch, hidden) tensor (`stage_layout`):
- same layout (same TP degree and rank count): each rank's tile to the rank at its position;
- send-recv (plan.py's send_recv): one message per (destination rank, overlapping source
  tile), from the holder the solver picks;
- broadcast: one collective per (destination tile, overlapping source tile) on the group of
  the picked holder and the tile's replicas: torch's broadcast, no forwarding code;
- scatter-gather (send_recv_allgather): each replica receives its part of the slice
  (part_range's rule), then the replicas all-gather it (`all_gather_into_tensor`, parts padded
  to the longest), as Megatron scatters an activation over TP and gathers it after the
  transfer;
- auto: per route, the one of the three whose plan cost.py predicts fastest on the nominal
  network of the backend (network.py's NOMINAL), senders balanced per NIC (--nics-per-node,
  --gpus-per-node). The gradient's route is its activation's plan.backward(), so `auto`
  chooses again for the other direction.

Groups (`route_groups`): per route, one process group per (sender, receiver) pair of its
messages, per broadcast and per set of replicas that gather; a forward and a backward route
never share a communicator (their two stages post them in different orders), nor do two
boundaries: NCCL runs a communicator's operations in posting order, one after the other, so a
prefetched receive on a communicator shared with later sends would hold those up (the reason
for P2PTransport's channels, ParallelDims.pipeline_channels). torch's new_group is collective
over the world, so every rank makes every route's groups in the same order, on the world's
backend (never a backend of its own: ParallelDims.stage_writers_group says why).

Order: a rank posts a micro-batch's pieces in the route's order; on every group the members
post its collectives in micro-batch order (the sender as the schedule posts the send, the
replicas as it posts the receive: the same order, tests/test_pipeline_schedules.py), and the
replicas of a gather are ranks of one stage, which run the same action list: every member of
every group posts its collectives in one order, what NCCL, which matches a communicator's
collectives by order, needs. The schedules' simulation with every boundary collective
(simulate.py's `collectives`) shows no schedule deadlocks on such boundaries.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megadomino.config.pipeline_plan import Stage
from megadomino.distributed import comm

from .layout import Box, Layout, Mesh, box_numel, part_range
from .network import Network
from .resharding import ReshardPlan, make_plan

STRATEGY_OF = {"send-recv": "send_recv", "broadcast": "broadcast",
               "scatter-gather": "send_recv_allgather"}
"""--pipeline-reshard's names -> plan.py's strategies (auto chooses among these)."""


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of `box` (full-tensor coordinates) flattened row-major."""

    box: Box
    start: int
    stop: int


@dataclass(frozen=True)
class Message:
    sender: int
    receiver: int
    piece: Piece


@dataclass(frozen=True)
class Broadcast:
    """The whole of `box` from `sender` to the other `ranks` (ascending, the sender among them)."""

    sender: int
    ranks: tuple[int, ...]
    box: Box


@dataclass(frozen=True)
class Gather:
    """The all-gather of `box` among its `replicas`: replica i holds elements parts[i]."""

    box: Box
    replicas: tuple[int, ...]
    parts: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Route:
    """One direction of one boundary: sending stage's layout `src`, receiving `dst`; `plan`
    None between same layouts. Per micro-batch, every message, broadcast and gather in the
    order each rank posts its own."""

    src: Layout
    dst: Layout
    plan: ReshardPlan | None
    messages: tuple[Message, ...]
    broadcasts: tuple[Broadcast, ...] = ()
    gathers: tuple[Gather, ...] = ()

    def describe(self) -> str:
        """The choice and its predicted time (cost.describe), or the rank-to-rank copy."""
        if self.plan is None:
            return (f"ranks {_ranks(self.src)} -> {_ranks(self.dst)}: same layout, rank to "
                    "rank")
        return self.plan.describe()


def stage_layout(stage: Stage, shape: tuple[int, ...], sequence_parallel: bool,
                 gpus_per_node: int) -> Layout:
    """The activation's layout on `stage`: batch (dim 1) over DP, seq (dim 0) over TP under
    sequence parallelism (else replicated over TP); hosts of gpus_per_node consecutive ranks."""
    hosts = tuple(f"node{rank // gpus_per_node}" for rank in stage.ranks)
    mesh = Mesh(stage.ranks, hosts, (stage.dp, stage.tp))
    seq_axes = (1,) if sequence_parallel and stage.tp > 1 else ()
    return Layout(mesh, (seq_axes, (0,), ()) + ((),) * (len(shape) - 3))


def boundary_routes(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype,
                    strategy: str, network: Network, nic_rate: float) -> tuple[Route, Route]:
    """(the activation's route src -> dst, the gradient's dst -> src) under `strategy` (one of
    STRATEGY_OF or "auto"), planned for `network` with every NIC at `nic_rate` bytes/s."""
    if src.mesh.shape == dst.mesh.shape and src.dims == dst.dims:
        pairs = list(zip(src.mesh.ranks, dst.mesh.ranks))
        whole = [Piece(src.tile(shape, a), 0, box_numel(src.tile(shape, a))) for a, _ in pairs]
        return (Route(src, dst, None, tuple(Message(a, b, p) for (a, b), p in zip(pairs, whole))),
                Route(dst, src, None, tuple(Message(b, a, p) for (a, b), p in zip(pairs, whole))))
    rates = dict.fromkeys(src.mesh.hosts + dst.mesh.hosts, nic_rate)
    if strategy == "auto":
        plan = make_plan(shape, dtype, src, dst, "auto", rates=rates, network=network,
                         candidates=tuple(STRATEGY_OF.values()))
    else:
        plan = make_plan(shape, dtype, src, dst, STRATEGY_OF[strategy], rates=rates,
                         network=network)
    return route_of(plan), route_of(plan.backward())


def route_of(plan: ReshardPlan) -> Route:
    """The pieces of a send_recv, broadcast or send_recv_allgather plan (module docstring)."""
    if plan.strategy not in STRATEGY_OF.values():
        raise ValueError(f"strategy {plan.strategy!r}: training runs "
                         f"{', '.join(STRATEGY_OF.values())}")
    messages, broadcasts, gathers = [], [], {}
    for step in plan.steps:
        work, box = step.work, step.work.transfer.box
        if plan.strategy == "broadcast":
            ranks = tuple(sorted((step.sender, *work.receivers)))
            broadcasts.append(Broadcast(step.sender, ranks, box))
            continue
        messages.append(Message(step.sender, work.receivers[0], Piece(box, work.start,
                                                                     work.stop)))
        replicas = work.transfer.receivers
        if plan.strategy == "send_recv_allgather" and len(replicas) > 1:
            numel = box_numel(box)
            gathers[box] = Gather(box, replicas, tuple(part_range(numel, len(replicas), index)
                                                       for index in range(len(replicas))))
    return Route(plan.src, plan.dst, plan, tuple(messages), tuple(broadcasts),
                 tuple(gathers.values()))


def route_groups(route: Route, timeout: datetime.timedelta | None = None
                 ) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The route's groups by member ranks (ascending): one per pair of a message's ends, per
    broadcast and per set of replicas that gather. Collective over the world (module
    docstring): every rank calls it for every route, in the same order; a rank outside a group
    gets torch's non-member value for it. Each group's connections are opened here, in that
    order on every rank (comm.open_links says why)."""
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    members = ([tuple(sorted((m.sender, m.receiver))) for m in route.messages]
               + [b.ranks for b in route.broadcasts] + [g.replicas for g in route.gathers])
    for ranks in members:
        if ranks not in groups:
            groups[ranks] = dist.new_group(list(ranks), timeout=timeout)
    links = list(dict.fromkeys(
        [("p2p", groups[tuple(sorted((m.sender, m.receiver)))], m.sender, m.receiver)
         for m in route.messages]
        + [("broadcast", groups[b.ranks], b.sender) for b in route.broadcasts]
        + [("all_gather", groups[g.replicas]) for g in route.gathers]))
    comm.open_links(links)
    return groups


def _ranks(layout: Layout) -> str:
    return ",".join(map(str, layout.mesh.ranks))
