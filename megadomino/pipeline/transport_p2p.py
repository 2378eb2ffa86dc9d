"""The plain pipeline transport (transport_protocol.py's `Transport`) between same-layout stages:
rank (stage s, dp d, tp t) talks to (s +- 1, d, t) with isend / irecv, each (pass, boundary) on
its own two-rank channel (ParallelDims.pipeline_channels says why: on one communicator NCCL runs
a prefetched receive ahead of the sends posted after it). `flush()` starts what was posted since
the last flush, each operation on its channel.
"""

from __future__ import annotations

import torch

from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.distributed import comm
from megadomino.pipeline.transport_protocol import Handle


def channel(pass_: str, sends: bool, stage: int, stages: int) -> tuple[str, int]:
    """The channel (pass, boundary) of a message `stage` sends (`sends`) or receives: an
    activation (F) goes up across the boundary above its sender, a gradient (B) down across the
    boundary below it; boundary b joins stages b and b + 1 (mod `stages`)."""
    below = (pass_ == "F") != sends
    return pass_, (stage - 1 if below else stage) % stages


class _Posted:
    """A posted operation, started by the transport's next flush (or its own wait)."""

    def __init__(self, transport: P2PTransport):
        self.transport, self.work = transport, None

    def wait(self) -> None:
        if self.work is None:
            self.transport.flush()
        self.work.wait()

    def done(self) -> bool:
        """Started and completed (comm.P2PBatch.done), without waiting."""
        return self.work is not None and self.work.done()


class P2PTransport:
    """isend / irecv between the same position (dp, tp) of neighbouring stages of a plan whose
    stages share one layout: a message of pass F (activations) or B (gradients) across the
    boundary between stages b and b + 1 goes over `channels[(pass, b)]`
    (ParallelDims.pipeline_channels), so that each channel carries one direction's messages of
    one pass, posted in the same order on both ends (tests/test_pipeline_schedules.py checks
    the order and that no schedule deadlocks when each channel runs its operations in posting
    order, as an NCCL communicator does). rank: this rank's global rank; peers are the same
    position of the neighbouring stages.
    shape, dtype, device: every activation's (one micro-batch: (s, b, h), or (s/tp, b, h) under
    sequence parallelism); micro: micro-batches per step (for the tags); stage: this rank's."""

    def __init__(self, plan: PipelinePlan, stage: Stage, rank: int, channels: dict,
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, micro: int):
        if not plan.same_layout:
            raise ValueError("P2PTransport joins same-layout stages only; stages of different "
                             "layouts need a resharding transport")
        count = plan.size
        self.stage, self.stages, self.chunks = stage.index, count, plan.chunks
        position = stage.ranks.index(rank)
        self.next_rank = plan.stages[(stage.index + 1) % count].ranks[position]
        self.prev_rank = plan.stages[(stage.index - 1) % count].ranks[position]
        self.channels = channels
        self.shape, self.dtype, self.device, self.micro = shape, dtype, device, micro
        self._ops: list = []
        self._posted: list[_Posted] = []

    def _tag(self, forward: bool, micro: int, boundary: int) -> int:
        """Unique per message of a step, the same on both ends: keyed by the direction, the
        boundary (the virtual stage below it: the activation's producer) and the micro-batch."""
        return ((0 if forward else 1) * self.chunks * self.stages + boundary) * self.micro + micro

    def _post(self, op, tensor: torch.Tensor, pass_: str, peer: int, tag: int) -> _Posted:
        group = self.channels[channel(pass_, op is comm.send_op, self.stage, self.stages)]
        self._ops.append(op(tensor, peer, group=group, tag=tag))
        self._posted.append(_Posted(self))
        return self._posted[-1]

    def flush(self) -> None:
        # each on its own channel: a batch spans one group (and one communicator's stream)
        for op, posted in zip(self._ops, self._posted, strict=True):
            posted.work = comm.batch_p2p([op])
        self._ops, self._posted = [], []

    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        tag = self._tag(True, micro, chunk * self.stages + self.stage)
        return self._post(comm.send_op, tensor.contiguous(), "F", self.next_rank, tag)

    def recv_activation(self, micro: int, chunk: int, buffer: torch.Tensor | None = None
                        ) -> tuple[Handle, torch.Tensor]:
        """`buffer`: receive into it (a codec's message, transport_codec.py) instead of a new
        activation; so for recv_grad."""
        if buffer is None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        tag = self._tag(True, micro, chunk * self.stages + self.stage - 1)
        return self._post(comm.recv_op, buffer, "F", self.prev_rank, tag), buffer

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        tag = self._tag(False, micro, chunk * self.stages + self.stage - 1)
        return self._post(comm.send_op, tensor.contiguous(), "B", self.prev_rank, tag)

    def recv_grad(self, micro: int, chunk: int, buffer: torch.Tensor | None = None
                  ) -> tuple[Handle, torch.Tensor]:
        if buffer is None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        tag = self._tag(False, micro, chunk * self.stages + self.stage)
        return self._post(comm.recv_op, buffer, "B", self.next_rank, tag), buffer
