"""The plain pipeline transport (transport_protocol.py's `Transport`) between same-layout stages:
rank (stage s, dp d, tp t) talks to (s +- 1, d, t) with isend / irecv over the pipeline group.
`flush()` starts what was posted since the last flush, as one batch.
"""

from __future__ import annotations

import torch

from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.distributed import comm
from megadomino.pipeline.transport_protocol import Handle


class _Posted:
    """A posted operation, started by the transport's next flush (or its own wait)."""

    def __init__(self, transport: P2PTransport):
        self.transport, self.work = transport, None

    def wait(self) -> None:
        if self.work is None:
            self.transport.flush()
        self.work.wait()


class P2PTransport:
    """isend / irecv between the same position (dp, tp) of neighbouring stages of a plan whose
    stages share one layout, over the pipeline group (`pp_group`, whose rank i is stage i). The
    posts of one step go out as one `batch_isend_irecv`: NCCL runs a batch's sends and receives
    together (posted one by one, a send to a peer could wait behind a receive from it).
    shape, dtype, device: every activation's (one micro-batch: (s, b, h), or (s/tp, b, h) under
    sequence parallelism); micro: micro-batches per step (for the tags); stage: this rank's."""

    def __init__(self, plan: PipelinePlan, stage: Stage, pp_group, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, micro: int):
        if not plan.same_layout:
            raise ValueError("P2PTransport joins same-layout stages only; stages of different "
                             "layouts need a resharding transport")
        count = plan.size
        self.stage, self.stages, self.chunks = stage.index, count, plan.chunks
        self.next_stage, self.prev_stage = (stage.index + 1) % count, (stage.index - 1) % count
        self.group = pp_group
        self.shape, self.dtype, self.device, self.micro = shape, dtype, device, micro
        self._ops: list = []
        self._posted: list[_Posted] = []

    def _tag(self, forward: bool, micro: int, boundary: int) -> int:
        """Unique per message of a step, the same on both ends: keyed by the direction, the
        boundary (the virtual stage below it: the activation's producer) and the micro-batch."""
        return ((0 if forward else 1) * self.chunks * self.stages + boundary) * self.micro + micro

    def _post(self, op, tensor: torch.Tensor, stage: int, tag: int) -> _Posted:
        self._ops.append(op(tensor, group=self.group, tag=tag, group_peer=stage))
        self._posted.append(_Posted(self))
        return self._posted[-1]

    def flush(self) -> None:
        if not self._ops:
            return
        batch = comm.batch_p2p(self._ops)  # one work for the batch (NCCL) or one per op (gloo)
        for posted in self._posted:
            posted.work = batch
        self._ops, self._posted = [], []

    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        tag = self._tag(True, micro, chunk * self.stages + self.stage)
        return self._post(comm.send_op, tensor.contiguous(), self.next_stage, tag)

    def recv_activation(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        tag = self._tag(True, micro, chunk * self.stages + self.stage - 1)
        return self._post(comm.recv_op, buffer, self.prev_stage, tag), buffer

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        tag = self._tag(False, micro, chunk * self.stages + self.stage - 1)
        return self._post(comm.send_op, tensor.contiguous(), self.prev_stage, tag)

    def recv_grad(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        tag = self._tag(False, micro, chunk * self.stages + self.stage)
        return self._post(comm.recv_op, buffer, self.next_stage, tag), buffer
