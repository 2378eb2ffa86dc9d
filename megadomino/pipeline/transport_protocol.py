"""The pipeline's transport: how an activation goes forward to the next stage and its gradient
back, as the executor (executor.py) sees it.

A transport serves one rank and is handed that rank's Stage of the plan (its neighbours follow
from the plan). The executor calls four methods, each posting an asynchronous operation and
returning a handle with `wait()`:

    send_activation(tensor, micro, chunk)   to the stage holding the next virtual stage
    recv_activation(micro, chunk)            -> (handle, buffer) from the previous one
    send_grad(tensor, micro, chunk)          to the previous virtual stage
    recv_grad(micro, chunk)                  -> (handle, buffer) from the next one

`chunk` is the local model chunk the tensor belongs to (virtual stage chunk * P + stage, or
under ZBV's V placement stage and 2 P - 1 - stage: config/pipeline_split.py); under the loop
placement the last stage's chunk v feeds the first stage's chunk v + 1, under the V chunk 1 of
stage s feeds chunk 1 of stage s - 1 (the V's turn on the last stage moves no message).
`flush()` starts what was posted since the last flush, as one batch. Two implement it:
transport_p2p.py's `P2PTransport` between stages of one layout, transport_reshard.py's
`ReshardTransport` between stages of different layouts (--pipeline-plan), on the cross-mesh
resharding plans of reshard/.

Every message has its own tag (direction, chunk, micro-batch), so gloo matches them whatever the
posting order; backends that ignore tags (NCCL) match in posting order, which the schedules keep
the same on both sides of every pair.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Handle(Protocol):
    def wait(self) -> object: ...


class Transport(Protocol):
    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle: ...

    def recv_activation(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]: ...

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle: ...

    def recv_grad(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]: ...

    def flush(self) -> None:
        """Start what was posted since the last flush (the executor calls it before anything
        that is not a post: the posts of one step go out together)."""
