"""The plain pipeline transport (transport_protocol.py's `Transport`) between same-layout stages:
rank (stage s, dp d, tp t) talks to the same (d, t) of the stages holding the virtual stages
next to its chunks' ((s +- 1) mod P under the loop placement; under ZBV's V placement chunk 0's
neighbours are s +- 1 and chunk 1's s -+ 1) with isend / irecv, each (pass, boundary) on its own
two-rank channel (ParallelDims.pipeline_channels says why: on one communicator NCCL runs a
prefetched receive ahead of the sends posted after it). `flush()` starts what was posted since
the last flush, each operation on its channel.
"""

from __future__ import annotations

import torch

from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.config.pipeline_split import virtual_stage
from megadomino.distributed import comm
from megadomino.pipeline.transport_protocol import Handle


def channel(pass_: str, sends: bool, stage: int, stages: int, chunk: int = 0,
            placement: str = "loop") -> tuple[str, int]:
    """The channel (pass, boundary) of a message chunk `chunk` of `stage` sends (`sends`) or
    receives: an activation (F) goes across the virtual boundary after its sender's virtual
    stage, a gradient (B) across the one before it. Under the loop placement boundary b joins
    stages b and b + 1 (mod `stages`: the virtual boundaries b + k P share it, one direction);
    under the V placement each virtual boundary is its own channel (both arms of the V join the
    same stages, in opposite directions)."""
    below = (pass_ == "F") != sends
    boundary = virtual_stage(stage, chunk, stages, placement) - (1 if below else 0)
    return pass_, boundary % stages if placement == "loop" else boundary


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
    stages share one layout: a message of pass F (activations) or B (gradients) goes over
    `channels[channel(...)]` (its (pass, boundary); ParallelDims.pipeline_channels), so that
    each channel carries one direction's messages of one pass, posted in the same order on both ends
    (tests/test_pipeline_schedules.py checks the order and that no schedule deadlocks when each
    channel runs its operations in posting order, as an NCCL communicator does). rank: this rank's
    global rank; peers are the same position of the neighbouring stages.
    shape, dtype, device: every activation's (one micro-batch: (s, b, h), or (s/tp, b, h) under
    sequence parallelism); micro: micro-batches per step (for the tags); stage: this rank's."""

    def __init__(self, plan: PipelinePlan, stage: Stage, rank: int, channels: dict,
                 shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, micro: int):
        if not plan.same_layout:
            raise ValueError("P2PTransport joins same-layout stages only; stages of different "
                             "layouts need a resharding transport")
        self.plan, self.stage, self.stages, self.chunks = plan, stage.index, plan.size, plan.chunks
        self.position = stage.ranks.index(rank)
        self.channels = channels
        self.shape, self.dtype, self.device, self.micro = shape, dtype, device, micro
        self._ops: list = []
        self._posted: list[_Posted] = []

    def _tag(self, forward: bool, micro: int, boundary: int) -> int:
        """Unique per message of a step, the same on both ends: keyed by the direction, the
        boundary (the virtual stage below it: the activation's producer) and the micro-batch."""
        return ((0 if forward else 1) * self.chunks * self.stages + boundary) * self.micro + micro

    def _post(self, op, tensor: torch.Tensor, pass_: str, chunk: int, micro: int) -> _Posted:
        """Post `op` of chunk `chunk`'s message of pass `pass_` for micro-batch `micro`, to or
        from the same position of the stage holding the virtual stage across its boundary."""
        sends = op is comm.send_op
        virtual = self.plan.virtual_stage(self.stage, chunk)
        below = (pass_ == "F") != sends
        boundary = virtual - 1 if below else virtual
        peer = self.plan.stages[self.plan.holder(virtual + (-1 if below else 1))[0]]
        group = self.channels[channel(pass_, sends, self.stage, self.stages, chunk,
                                      self.plan.placement)]
        tag = self._tag(pass_ == "F", micro, boundary)
        self._ops.append(op(tensor, peer.ranks[self.position], group=group, tag=tag))
        self._posted.append(_Posted(self))
        return self._posted[-1]

    def flush(self) -> None:
        # each on its own channel: a batch spans one group (and one communicator's stream)
        for op, posted in zip(self._ops, self._posted, strict=True):
            posted.work = comm.batch_p2p([op])
        self._ops, self._posted = [], []

    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        return self._post(comm.send_op, tensor.contiguous(), "F", chunk, micro)

    def recv_activation(self, micro: int, chunk: int, buffer: torch.Tensor | None = None
                        ) -> tuple[Handle, torch.Tensor]:
        """`buffer`: receive into it (a codec's message, transport_codec.py) instead of a new
        activation; so for recv_grad."""
        if buffer is None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._post(comm.recv_op, buffer, "F", chunk, micro), buffer

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        return self._post(comm.send_op, tensor.contiguous(), "B", chunk, micro)

    def recv_grad(self, micro: int, chunk: int, buffer: torch.Tensor | None = None
                  ) -> tuple[Handle, torch.Tensor]:
        if buffer is None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._post(comm.recv_op, buffer, "B", chunk, micro), buffer
