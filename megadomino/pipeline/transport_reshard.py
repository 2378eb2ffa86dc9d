"""The resharding transport: the pipeline's `Transport` (transport_protocol.py) between stages of
different layouts.

A micro-batch's activation is one (seq, batch, hidden) tensor of the whole micro-batch. Stage s
lays it out over its mesh of (dp, tp) ranks (Megatron's order, TP fastest): its DP ranks split
the batch dim (unevenly where they do not divide: `reshard.layout.part_range`, torch's
tensor_split rule), its TP ranks replicate it, or split the seq dim under sequence parallelism.
At a boundary whose stages differ in layout, the messages are those of the cross-mesh
resharding plan (`reshard.make_plan`, strategy send_recv: one message per (destination rank,
overlapping source tile), the sender of each replicated source tile chosen by the solver to
balance the hosts' links); the gradient goes back by `plan.backward()`. A boundary between
stages of one layout sends each rank's tile to the rank at the same position, as P2P does.

Every message is posted asynchronously (isend / irecv on the world group, tagged by direction,
boundary and micro-batch, started together at `flush`), so the executor's rule "post every
receive before blocking" keeps every schedule deadlock-free. The strategies that forward data
through the destination's ranks (all-gather, broadcasts) would need a rank to act inside its
peer's wait; they are not used here.

Gradient scale: stage s's DP ranks average their gradients (the data-parallel engine divides by
its dp), so each rank's parameter gradients must be dp_s times its share of the whole
micro-batch's. The last stage weighs its loss so (runtime.py); an activation gradient crossing
back from stage s + 1 to stage s is multiplied by dp_s / dp_{s+1} on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.distributed import comm
from megadomino.pipeline.reshard import Layout, Mesh, make_plan
from megadomino.pipeline.reshard.layout import Box, box_shape, box_slices
from megadomino.pipeline.transport_protocol import Handle


@dataclass(frozen=True)
class Message:
    """`box` (full-tensor coordinates) of one micro-batch's tensor, sender -> receiver."""

    sender: int
    receiver: int
    box: Box


def stage_layout(stage: Stage, shape: tuple[int, ...], sequence_parallel: bool,
                 gpus_per_node: int) -> Layout:
    """The activation's layout on `stage`: batch (dim 1) over DP, seq (dim 0) over TP under
    sequence parallelism (else replicated over TP); hosts of gpus_per_node consecutive ranks."""
    hosts = tuple(f"node{rank // gpus_per_node}" for rank in stage.ranks)
    mesh = Mesh(stage.ranks, hosts, (stage.dp, stage.tp))
    seq_axes = (1,) if sequence_parallel and stage.tp > 1 else ()
    return Layout(mesh, (seq_axes, (0,), ()) + ((),) * (len(shape) - 3))


def boundary_messages(src: Layout, dst: Layout, shape: tuple[int, ...], dtype: torch.dtype,
                      solver: str = "least_bytes") -> tuple[list[Message], list[Message]]:
    """(forward messages, backward messages) between two stages' layouts."""
    if src.mesh.shape == dst.mesh.shape and src.dims == dst.dims:
        pairs = list(zip(src.mesh.ranks, dst.mesh.ranks))
        return ([Message(a, b, src.tile(shape, a)) for a, b in pairs],
                [Message(b, a, src.tile(shape, a)) for a, b in pairs])
    plan = make_plan(shape, dtype, src, dst, "send_recv", solver)
    back = plan.backward()
    return ([Message(s.sender, s.work.receivers[0], s.work.transfer.box) for s in plan.steps],
            [Message(s.sender, s.work.receivers[0], s.work.transfer.box) for s in back.steps])


class _Pending:
    """The works of one send or receive; a receive copies its slices into `out` at wait."""

    def __init__(self, transport: ReshardTransport, pieces: list, out: torch.Tensor | None,
                 tile: Box | None):
        self.transport, self.pieces, self.out, self.tile = transport, pieces, out, tile
        self.batch: comm.P2PBatch | None = None

    def wait(self) -> None:
        if self.batch is None:
            self.transport.flush()
        self.batch.wait()
        if self.out is not None:
            for box, buffer in self.pieces:
                self.out[box_slices(box, self.tile)] = buffer


class ReshardTransport:
    """The `Transport` (transport_protocol.py) of one rank, of Stage `stage`, under a plan of
    one chunk a stage.

    shape: one micro-batch's whole activation (seq, batch, hidden); every rank builds the same
    boundaries (pure functions of the plan). gpus_per_node: which ranks share a host's link."""

    def __init__(self, plan: PipelinePlan, stage: Stage, rank: int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, micro: int,
                 sequence_parallel: bool, gpus_per_node: int):
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
        self.forward, self.backward = [], []
        for b in range(plan.size - 1):
            forward, backward = boundary_messages(layouts[b], layouts[b + 1], self.shape, dtype)
            self.forward.append(forward)
            self.backward.append(backward)
        self.grad_factor = (plan.stages[self.stage - 1].dp / plan.stages[self.stage].dp
                            if self.stage > 0 else 1.0)
        self._ops: list = []
        self._posted: list[_Pending] = []

    def _tag(self, forward: bool, boundary: int, micro: int) -> int:
        return ((0 if forward else 1) * self.stages + boundary) * self.micro + micro

    def _send(self, messages: list[Message], tensor: torch.Tensor, tile: Box,
              tag: int) -> _Pending:
        pieces = [tensor[box_slices(m.box, tile)].contiguous()
                  for m in messages if m.sender == self.rank]
        receivers = [m.receiver for m in messages if m.sender == self.rank]
        pending = _Pending(self, pieces, None, None)  # pieces kept until the sends are waited
        for piece, receiver in zip(pieces, receivers):
            self._ops.append(comm.send_op(piece, receiver, tag=tag))
        self._posted.append(pending)
        return pending

    def _recv(self, messages: list[Message], tile: Box, tag: int
              ) -> tuple[Handle, torch.Tensor]:
        out = torch.empty(box_shape(tile), dtype=self.dtype, device=self.device)
        pieces = []
        for m in messages:
            if m.receiver == self.rank:
                buffer = torch.empty(box_shape(m.box), dtype=self.dtype, device=self.device)
                pieces.append((m.box, buffer))
                self._ops.append(comm.recv_op(buffer, m.sender, tag=tag))
        pending = _Pending(self, pieces, out, tile)
        self._posted.append(pending)
        return pending, out

    def flush(self) -> None:
        """Start the posts since the last flush (a rank may have no message of a post: a TP
        replica the solver did not pick sends nothing)."""
        batch = comm.batch_p2p(self._ops)  # one work for the batch (NCCL) or one per op (gloo)
        for pending in self._posted:
            pending.batch = batch
        self._ops, self._posted = [], []

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
