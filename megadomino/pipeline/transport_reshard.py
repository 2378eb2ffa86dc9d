"""The resharding transport: the pipeline's `Transport` (transport_protocol.py) between stages of
different layouts.

A micro-batch's activation is one (seq, batch, hidden) tensor of the whole micro-batch. Stage s
lays it out over its mesh of (dp, tp) ranks (Megatron's order, TP fastest): its DP ranks split
the batch dim (unevenly where they do not divide: `reshard.layout.part_range`, torch's
tensor_split rule), its TP ranks replicate it, or split the seq dim under sequence parallelism.
Each boundary moves it by the routes of reshard/boundary.py: rank to rank between stages of one
layout, else send/recv, broadcast or scatter + all-gather as --pipeline-reshard says (`auto`:
the cost model's choice per boundary and direction, `describe()` prints them).

Posting: a send or receive queues its point-to-point messages (tagged by direction, boundary and
micro-batch) and its broadcasts; `flush` starts them in posting order, each on its route's own
group: a message on the two-rank group of its (route, sender, receiver), a broadcast on the
group of its sender and replicas (asynchronous: on NCCL each runs on its process group's own
stream, which is the side stream; the executor's wait makes the current stream wait for it).
Never one communicator for the whole pipeline: NCCL runs a communicator's operations in posting
order, so a prefetched receive would hold up every later send on it (P2PTransport's channels,
ParallelDims.pipeline_channels, for the same reason). A receive's wait then runs its all-gathers
(every replica reaches that wait: its stage runs the same action list) and copies the pieces
into the rank's tile. Every receive is still posted before the rank blocks, and each route's
groups run in posting order, which the schedules' simulation with every boundary collective
shows cannot deadlock (reshard/boundary.py on the order).

Gradient scale: stage s's DP ranks average their gradients (the data-parallel engine divides by
its dp), so each rank's parameter gradients must be dp_s times its share of the whole
micro-batch's. The last stage weighs its loss so (runtime.py); an activation gradient crossing
back from stage s + 1 to stage s is multiplied by dp_s / dp_{s+1} on the way.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass

import torch

from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.distributed import comm
from megadomino.pipeline.reshard.boundary import (
    Gather,
    Message,
    Piece,
    Route,
    boundary_routes,
    route_groups,
    stage_layout,
)
from megadomino.pipeline.reshard.layout import Box, box_numel, box_shape, box_slices
from megadomino.pipeline.reshard.network import nominal_network
from megadomino.pipeline.transport_protocol import Handle


@dataclass(frozen=True)
class _Way:
    """One direction of one boundary: its route and the route's groups (by member ranks)."""

    route: Route
    groups: dict


class _Receive:
    """A receive's tile `out` and the flat buffers its pieces land in (by box; a box that is
    the whole tile is `out` itself); `gathers`: the all-gathers to run once they are in."""

    def __init__(self, rank: int, out: torch.Tensor, tile: Box):
        self.rank, self.out, self.tile = rank, out, tile
        self.flats: dict[Box, torch.Tensor] = {}
        self.gathers: list[tuple[Gather, object]] = []

    def flat(self, box: Box) -> torch.Tensor:
        if box not in self.flats:
            self.flats[box] = (self.out.view(-1) if box == self.tile else
                               torch.empty(box_numel(box), dtype=self.out.dtype,
                                           device=self.out.device))
        return self.flats[box]

    def finish(self) -> None:
        """All-gather each gathered slice (parts padded to the longest: all_gather_into_tensor
        takes equal inputs), then copy every piece into the tile."""
        running = []
        for gather, group in self.gathers:
            flat, index = self.flat(gather.box), gather.replicas.index(self.rank)
            width = max(stop - start for start, stop in gather.parts)
            mine = flat.new_zeros(width)
            start, stop = gather.parts[index]
            mine[:stop - start] = flat[start:stop]
            gathered = flat.new_empty(width * len(gather.replicas))
            work = comm.all_gather_single(gathered, mine, group=group, async_op=True)
            running.append((gather, flat, gathered, width, mine, work))
        for gather, flat, gathered, width, _, work in running:
            work.wait()
            for index, (start, stop) in enumerate(gather.parts):
                flat[start:stop] = gathered[index * width:index * width + stop - start]
        for box, flat in self.flats.items():
            if box != self.tile:
                self.out[box_slices(box, self.tile)] = flat.view(box_shape(box))


class _Pending:
    """One send or receive: the works of its messages and broadcasts (once flushed), the
    tensors kept until it is waited, and for a receive what its wait completes."""

    def __init__(self, transport: ReshardTransport, kept: list, receive: _Receive | None):
        self.transport, self.kept, self.receive = transport, kept, receive
        self.started = False
        self.works: list = []

    def wait(self) -> None:
        if not self.started:
            self.transport.flush()
        for work in self.works:
            work.wait()
        if self.receive is not None:
            self.receive.finish()


class ReshardTransport:
    """The `Transport` (transport_protocol.py) of one rank, of Stage `stage`, under a plan of
    one chunk a stage.

    shape: one micro-batch's whole activation (seq, batch, hidden); every rank builds every
    boundary's routes and groups alike (collective over the world: every rank constructs it).
    gpus_per_node, nics_per_node: the hosts and the NICs the cost model balances senders over;
    strategy: --pipeline-reshard's value; timeout: the groups' (ParallelDims.timeout)."""

    def __init__(self, plan: PipelinePlan, stage: Stage, rank: int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, micro: int,
                 sequence_parallel: bool, gpus_per_node: int, strategy: str = "auto",
                 nics_per_node: int = 1, timeout: datetime.timedelta | None = None):
        if plan.chunks != 1:
            raise ValueError("the resharding transport runs one chunk a stage (no virtual "
                             "stages)")
        self.rank, self.shape, self.dtype, self.device, self.micro = (
            rank, tuple(shape), dtype, device, micro)
        self.stage, self.stages = stage.index, plan.size
        layouts = [stage_layout(stage, self.shape, sequence_parallel, gpus_per_node)
                   for stage in plan.stages]
        self.tiles = [layout.tile(self.shape, rank) if rank in layout.mesh.ranks else None
                      for layout in layouts]
        network, nic_rate = nominal_network("nccl" if device.type == "cuda" else "gloo",
                                            gpus_per_node, nics_per_node)
        self.forward: list[_Way] = []  # boundary b: stage b -> b + 1
        self.backward: list[_Way] = []  # boundary b: stage b + 1 -> b
        for b in range(plan.size - 1):  # every rank makes the groups in this order
            routes = boundary_routes(layouts[b], layouts[b + 1], self.shape, dtype, strategy,
                                     network, nic_rate)
            self.forward.append(_Way(routes[0], route_groups(routes[0], timeout)))
            self.backward.append(_Way(routes[1], route_groups(routes[1], timeout)))
        for way in (way for pair in zip(self.forward, self.backward) for way in pair):
            for ranks, group in way.groups.items():
                if rank in ranks:  # NCCL: each communicator set up now, in one order
                    comm.barrier(group=group)
        self.grad_factor = (plan.stages[self.stage - 1].dp / plan.stages[self.stage].dp
                            if self.stage > 0 else 1.0)
        self._posted: list[_Pending] = []
        self._launches: list[tuple[_Pending, functools.partial]] = []

    def describe(self) -> list[str]:
        """One line per boundary and direction: the strategy and its predicted time."""
        return [f"boundary {b} -> {b + 1} {what}: {route.describe()}"
                for b in range(self.stages - 1)
                for what, route in (("activation", self.forward[b].route),
                                    ("gradient", self.backward[b].route))]

    def _tag(self, forward: bool, boundary: int, micro: int) -> int:
        return ((0 if forward else 1) * self.stages + boundary) * self.micro + micro

    def _send(self, way: _Way, tensor: torch.Tensor, tile: Box, tag: int) -> _Pending:
        def payload(piece: Piece) -> torch.Tensor:
            flat = tensor[box_slices(piece.box, tile)].contiguous().view(-1)
            return flat[piece.start:piece.stop]

        pending = _Pending(self, [], None)  # payloads kept until the sends are waited
        for message in way.route.messages:
            if message.sender == self.rank:
                pending.kept.append(payload(message.piece))
                self._message(pending, way, comm.send_op, pending.kept[-1], message, tag)
        for cast in way.route.broadcasts:
            if cast.sender == self.rank:
                pending.kept.append(payload(Piece(cast.box, 0, box_numel(cast.box))))
                self._launch(pending, way, cast.ranks, pending.kept[-1], cast.sender)
        self._posted.append(pending)
        return pending

    def _recv(self, way: _Way, tile: Box, tag: int) -> tuple[Handle, torch.Tensor]:
        receive = _Receive(self.rank, torch.empty(box_shape(tile), dtype=self.dtype,
                                                  device=self.device), tile)
        pending = _Pending(self, [], receive)
        for message in way.route.messages:
            if message.receiver == self.rank:
                piece = message.piece
                buffer = receive.flat(piece.box)[piece.start:piece.stop]
                self._message(pending, way, comm.recv_op, buffer, message, tag)
        for cast in way.route.broadcasts:
            if self.rank in cast.ranks and cast.sender != self.rank:
                self._launch(pending, way, cast.ranks, receive.flat(cast.box), cast.sender)
        receive.gathers = [(gather, way.groups[gather.replicas])
                           for gather in way.route.gathers if self.rank in gather.replicas]
        self._posted.append(pending)
        return pending, receive.out

    def _message(self, pending: _Pending, way: _Way, op, tensor: torch.Tensor,
                 message: Message, tag: int) -> None:
        """Queue a send or receive (`op`) of `message` on its pair's group, alone in its batch
        (a batch spans one group)."""
        pair = tuple(sorted((message.sender, message.receiver)))
        peer = message.receiver if op is comm.send_op else message.sender
        self._launches.append((pending, functools.partial(
            comm.batch_p2p, [op(tensor, peer, group=way.groups[pair], tag=tag)])))

    def _launch(self, pending: _Pending, way: _Way, ranks: tuple[int, ...],
                tensor: torch.Tensor, sender: int) -> None:
        group = way.groups[ranks]
        self._launches.append((pending, functools.partial(comm.broadcast, tensor, sender,
                                                          group=group, async_op=True)))

    def flush(self) -> None:
        """Start the posts since the last flush, messages and broadcasts, in posting order (a
        rank may have none of a post: a TP replica the solver did not pick sends nothing)."""
        for pending, launch in self._launches:
            pending.works.append(launch())
        for pending in self._posted:
            pending.started = True
        self._posted, self._launches = [], []

    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        return self._send(self.forward[self.stage], tensor, self.tiles[self.stage],
                          self._tag(True, self.stage, micro))

    def recv_activation(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        return self._recv(self.forward[self.stage - 1], self.tiles[self.stage],
                          self._tag(True, self.stage - 1, micro))

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        return self._send(self.backward[self.stage - 1], tensor * self.grad_factor,
                          self.tiles[self.stage], self._tag(False, self.stage - 1, micro))

    def recv_grad(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        return self._recv(self.backward[self.stage], self.tiles[self.stage],
                          self._tag(False, self.stage, micro))
