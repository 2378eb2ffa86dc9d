"""On the GPU machine: what the training loop does between enqueueing one step and the next
never waits for work already queued behind it, so that the host stays ahead of the GPU: reading
the last step's pending skip flag (StepResult) waits for that step only, and a micro-batch's copy
to the device does not wait for the stream (from pageable memory it would, and the GPU would
idle at each step's start while the host enqueued its first kernels).
`python -m pytest --tier gpu tests/gpu/test_gpu_host_ahead.py -q`."""

from __future__ import annotations

import pytest
import torch

from megadomino.distributed import ParallelDims
from megadomino.train.step import Stepper
from megadomino.train.timers import Timers
from megadomino.zero.loss_scaler import StepResult

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _spin() -> torch.cuda.Event:
    """About a second of the GPU's time queued on the current stream; an event behind it."""
    torch.cuda._sleep(2_000_000_000)
    later = torch.cuda.Event()
    later.record()
    return later


def test_pending_skip_is_read_without_waiting_for_later_work():
    flag = torch.ones((), dtype=torch.bool, device="cuda")
    result = StepResult(skipped=flag, grad_norm=None, loss_scale=None)
    later = _spin()  # the next step's forward and backward
    assert not result.settled
    assert result.skipped is True and result.settled
    assert not later.query(), "reading the flag waited for the work enqueued after it"
    torch.cuda.synchronize()


@pytest.mark.usefixtures("single_process_group")
def test_micro_batch_copy_does_not_wait_for_the_stream():
    device = torch.device("cuda")
    stepper = Stepper(torch.nn.Identity(), None, ParallelDims(tp=1), micro_batch_size=2,
                      num_micro=1, device=device, timers=Timers(device))
    dataset = [torch.arange(i, i + 9) for i in range(4)]
    stepper._micro_batch(dataset, 0, 0)  # the first pinned blocks are allocated (a device sync)
    torch.cuda.synchronize()  # ... and return to the host allocator's cache, as between steps
    later = _spin()  # the last step's optimizer pass
    tokens, labels, mask = stepper._micro_batch(dataset, 0, 0)
    assert not later.query(), "the batch's copy waited for the work queued before it"
    torch.cuda.synchronize()
    assert torch.equal(tokens.cpu(), torch.stack(dataset[:2])[:, :-1])
    assert torch.equal(labels.cpu(), torch.stack(dataset[:2])[:, 1:])
    assert mask.shape == (2, 8) and mask.min().item() == 1.0
