"""On the GPU machine: under NCCL (launch.py's backend whenever CUDA is available), a rank that
stops answering (SIGSTOP) is named too. No exception reaches the surviving rank's main thread,
which waits inside NCCL; its heartbeat prints the one line and ends it with status 1 at half of
the timeout plus 2 intervals, before NCCL's watchdog would end it at the timeout with no line.
`python -m pytest --tier gpu tests/gpu/test_gpu_stalled_rank.py -q`."""

from __future__ import annotations

import re

import pytest
import torch
from test_stalled_rank import GRACE, error_lines, stalled_line, stop_rank_1_in_training

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

TIMEOUT_MINUTES = 0.2  # 12 s: room for NCCL's first communicator; the line comes after 7 s


def test_a_stopped_rank_ends_an_nccl_job_naming_it(tmp_path):
    code, took, output = stop_rank_1_in_training(tmp_path, TIMEOUT_MINUTES)
    assert code == 1, output[-3000:]
    assert took <= TIMEOUT_MINUTES * 60 + GRACE, f"rank 0 took {took:.1f} s to exit"
    lines = error_lines(output)
    assert len(lines) == 1, output[-3000:]
    assert re.fullmatch(stalled_line(1, 0, TIMEOUT_MINUTES), lines[0]), lines[0]
