"""Running a resharding plan, blocking, for the resharding benchmark (bench_reshard.py) and the
library's multi-rank tests: every rank of the source and destination meshes calls `run`.
Training does not use it: its transport (megadomino/pipeline/transport_reshard.py) posts a
boundary's plan asynchronously where the schedule posts and waits; this form also runs the
chained broadcast, which training leaves to NCCL's ring.

A source rank passes its tile (the shape `plan.src.tile` gives) and gets None back; a
destination rank passes None and gets its tile, bit-identical to slicing the full tensor.
Ordering: every rank walks the plan's steps in the same order; sends and receives between one
pair of ranks are posted in that order on both sides (gloo matches them in posting order). Sends
never block; a rank blocks only on a receive whose sender has walked the same steps before it,
so a plan cannot deadlock. A plan made for NCCL (network.py: rings) runs the all-gather exchange
as the chained broadcast of each part along the replicas' ring, from its owner: the data
movement of NCCL's ring all-gather, in point-to-point messages.

`broadcast` needs one process group per (sender + replicas) set. `torch.distributed.new_group`
is collective over the whole world, so a `Reshard` of that strategy must be built on every rank
of the world, in the same order, sharing one `GroupCache` (plans are the same everywhere, so
every rank asks for the same groups in the same order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadomino.distributed import comm
from megadomino.pipeline.reshard.layout import Box, Layout, box_numel, box_shape, box_slices
from megadomino.pipeline.reshard.resharding import ReshardPlan, Step


def tile_of(layout: Layout, shape: tuple[int, ...], rank: int) -> Box | None:
    """The rank's tile under `layout`, None when the rank is not in its mesh."""
    return layout.tile(shape, rank) if rank in layout.mesh.ranks else None


class GroupCache:
    """Process groups by member ranks, created on first use (collective: see the module
    docstring)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def get(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        ranks = tuple(sorted(ranks))
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks))
        return self._groups[ranks]


class Reshard:
    """The transport of one plan between two stages (one instance per direction: build the
    gradient's with `Reshard(plan.backward(), groups)`).

    device: where the received tiles are allocated (the rank's GPU under NCCL); sent: bytes
    this rank has sent to each destination rank over its runs (for broadcast, the bytes of
    the backend's tree or ring edges out of this rank, as plan.py models them)."""

    def __init__(self, plan: ReshardPlan, groups: GroupCache | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.sent: dict[int, int] = {}
        self.groups: dict[Step, dist.ProcessGroup] = {}
        if plan.strategy == "broadcast":
            groups = groups if groups is not None else GroupCache()
            for step in plan.steps:
                self.groups[step] = groups.get((step.sender, *step.work.receivers))

    def run(self, local: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's part of the resharding: `local` is its source tile (None on a rank
        outside the source mesh); returns its destination tile (None outside that mesh)."""
        plan = self.plan
        src_tile = tile_of(plan.src, plan.shape, self.rank)
        dst_tile = tile_of(plan.dst, plan.shape, self.rank)
        if src_tile is not None:
            if local is None or tuple(local.shape) != box_shape(src_tile) \
                    or local.dtype != plan.dtype:
                raise ValueError(f"rank {self.rank}: expected its source tile of shape "
                                 f"{box_shape(src_tile)} and {plan.dtype}, got "
                                 f"{None if local is None else (tuple(local.shape), local.dtype)}")
        out = (torch.empty(box_shape(dst_tile), dtype=plan.dtype, device=self.device)
               if dst_tile is not None else None)
        buffers: dict = {}  # transfer -> its slice, flattened, on this receiver
        if plan.strategy == "chained_broadcast":
            self._chained(plan.steps, local, src_tile, buffers)
        elif plan.strategy == "broadcast":
            self._broadcast(local, src_tile, buffers)
        else:
            self._p2p(plan.steps, local, src_tile, buffers)
            if plan.network.rings:  # the all-gather's ring: each part chained from its owner
                self._chained(plan.exchanges, None, None, buffers)
            else:
                self._p2p(plan.exchanges, None, None, buffers)
        for transfer, flat in buffers.items():
            out[box_slices(transfer.box, transfer.tile)] = flat.view(box_shape(transfer.box))
        return out

    def _payload(self, step: Step, local: torch.Tensor, src_tile) -> torch.Tensor:
        box = step.work.transfer.box
        flat = local[box_slices(box, src_tile)].contiguous().view(-1)
        return flat[step.work.start:step.work.stop]

    def _buffer(self, step: Step, buffers: dict) -> torch.Tensor:
        """This receiver's flat buffer of the step's slice, elements [start, stop)."""
        transfer = step.work.transfer
        if transfer not in buffers:
            buffers[transfer] = torch.empty(box_numel(transfer.box), dtype=self.plan.dtype,
                                            device=self.device)
        return buffers[transfer][step.work.start:step.work.stop]

    def _count(self, peer: int, tensor: torch.Tensor) -> None:
        self.sent[peer] = self.sent.get(peer, 0) + tensor.numel() * tensor.element_size()

    def _send(self, tensor: torch.Tensor, peer: int):
        self._count(peer, tensor)
        return comm.isend(tensor, peer)

    def _p2p(self, steps: tuple[Step, ...], local, src_tile, buffers: dict) -> None:
        """Every edge a point-to-point message, posted as one batch, then waited. For exchanges
        (local None) the payload is the part this rank received in the first phase. One batch:
        on NCCL a pair's sends and receives share a stream, so posted one by one a send could
        wait behind a receive from the same peer."""
        ops = []
        for step in steps:
            for source, target in step.edges:
                if source == self.rank:
                    payload = (self._payload(step, local, src_tile) if local is not None
                               else self._buffer(step, buffers))
                    self._count(target, payload)
                    ops.append(comm.send_op(payload, target))
                elif target == self.rank:
                    ops.append(comm.recv_op(self._buffer(step, buffers), source))
        comm.batch_p2p(ops).wait()

    def _chained(self, steps: tuple[Step, ...], local, src_tile, buffers: dict) -> None:
        """Along each step's chain, chunk by chunk: a rank forwards chunk c as soon as it has
        it, while chunk c+1 is still arriving, so every edge streams at once. Every receive of
        every step is posted first: a rank still forwarding step t then already takes step
        t+1's data, so the plan's order does not serialize links that could run together.
        For exchanges (local None) a chain's head sends the part it received in the first
        phase."""
        steps = tuple(step for step in steps if step.edges)  # a part with no other replica
        receives: dict[Step, list] = {}
        for step in steps:
            chain = self._chain(step)
            if self.rank in chain[1:]:
                chunks = self._buffer(step, buffers).tensor_split(self._pieces(step))
                predecessor = chain[chain.index(self.rank) - 1]
                receives[step] = [(chunk, comm.irecv(chunk, predecessor)) for chunk in chunks]
        sends = []
        for step in steps:
            chain = self._chain(step)
            if self.rank not in chain or chain[-1] == self.rank:
                continue  # the chain's end only receives: waited for below
            successor = chain[chain.index(self.rank) + 1]
            if chain[0] == self.rank:
                data = (self._payload(step, local, src_tile) if local is not None
                        else self._buffer(step, buffers)).tensor_split(self._pieces(step))
                sends += [self._send(chunk, successor) for chunk in data]
                continue
            for chunk, receive in receives.pop(step):  # popped: a gloo work waits only once
                receive.wait()
                sends.append(self._send(chunk, successor))
        for work in [*sends, *(receive for pairs in receives.values() for _, receive in pairs)]:
            work.wait()

    @staticmethod
    def _chain(step: Step) -> list[int]:
        return [step.edges[0][0]] + [target for _, target in step.edges]

    def _pieces(self, step: Step) -> int:
        return min(self.plan.chunks, step.work.numel)  # no empty messages

    def _broadcast(self, local, src_tile, buffers: dict) -> None:
        """torch's broadcast per step on its group, all launched, then all waited."""
        pending = []
        for step in self.plan.steps:
            if self.rank == step.sender:
                data = self._payload(step, local, src_tile)
            elif self.rank in step.work.receivers:
                data = self._buffer(step, buffers)
            else:
                continue
            for source, target in step.edges:  # gloo's tree, as plan.binomial_edges models it
                if source == self.rank:
                    self._count(target, data)
            pending.append(comm.broadcast(data, step.sender, group=self.groups[step],
                                          async_op=True))
        for work in pending:
            work.wait()
