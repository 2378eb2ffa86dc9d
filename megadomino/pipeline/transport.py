"""Stage-to-stage transports: how an activation goes forward and its gradient back.

A transport serves one rank and knows its neighbours from the plan. The executor calls four
methods, each posting an asynchronous operation and returning a handle with `wait()`:

    send_activation(tensor, micro, chunk)   to the stage holding the next virtual stage
    recv_activation(micro, chunk)            -> (handle, buffer) from the previous one
    send_grad(tensor, micro, chunk)          to the previous virtual stage
    recv_grad(micro, chunk)                  -> (handle, buffer) from the next one

`chunk` is the local model chunk the tensor belongs to (virtual stage chunk * P + stage); the
last stage's chunk v feeds the first stage's chunk v + 1. `P2PTransport` is the plain one between
same-layout stages: rank (stage s, dp d, tp t) talks to (s +- 1, d, t) with isend / irecv.
A resharding transport (pipeline/reshard/) implements the same four methods between stages of
different layouts.

Every message has its own tag (direction, chunk, micro-batch), so gloo matches them whatever the
posting order; backends that ignore tags (NCCL) match in posting order, which the schedules keep
the same on both sides of every pair.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from megadomino.pipeline.plan import PipelinePlan


class Handle(Protocol):
    def wait(self) -> object: ...


class Transport(Protocol):
    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle: ...

    def recv_activation(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]: ...

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle: ...

    def recv_grad(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]: ...


class P2PTransport:
    """isend / irecv between the same position (dp, tp) of neighbouring stages of a uniform
    plan. shape, dtype, device: every activation's (one micro-batch: (s, b, h), or (s/tp, b, h)
    under sequence parallelism)."""

    def __init__(self, plan: PipelinePlan, rank: int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, micro: int):
        if not plan.same_layout:
            raise ValueError("P2PTransport joins same-layout stages only; stages of different "
                             "layouts need a resharding transport")
        stage = plan.stage_of(rank)
        position = stage.ranks.index(rank)
        count = plan.size
        self.stage, self.stages, self.chunks = stage.index, count, plan.chunks
        self.next_rank = plan.stages[(stage.index + 1) % count].ranks[position]
        self.prev_rank = plan.stages[(stage.index - 1) % count].ranks[position]
        self.shape, self.dtype, self.device, self.micro = shape, dtype, device, micro

    def _tag(self, forward: bool, micro: int, chunk: int) -> int:
        """Unique per message of a step, the same on both ends: keyed by the direction, the
        boundary (the virtual stage below it: the activation's producer) and the micro-batch."""
        return ((0 if forward else 1) * self.chunks * self.stages + chunk) * self.micro + micro

    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        tag = self._tag(True, micro, chunk * self.stages + self.stage)
        return dist.isend(tensor.contiguous(), self.next_rank, tag=tag)

    def recv_activation(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        producer = chunk * self.stages + self.stage - 1
        return dist.irecv(buffer, self.prev_rank, tag=self._tag(True, micro, producer)), buffer

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        tag = self._tag(False, micro, chunk * self.stages + self.stage - 1)
        return dist.isend(tensor.contiguous(), self.prev_rank, tag=tag)

    def recv_grad(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        tag = self._tag(False, micro, chunk * self.stages + self.stage)
        return dist.irecv(buffer, self.next_rank, tag=tag), buffer
