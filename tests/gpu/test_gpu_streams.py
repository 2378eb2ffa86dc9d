"""On the GPU machine: `distributed.streams.HookStreams.join` makes the current stream wait for
work a gradient hook queued on another stream (the --enable-cuda-graph DP race: the graphed
layers' hooks run on the capture's side stream). `python -m pytest tests/gpu -q`."""

from __future__ import annotations

import pytest
import torch

from megadomino.distributed.streams import HookStreams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("joined", [True, False])
def test_join_waits_for_the_side_stream(joined):
    x = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    side, streams = torch.cuda.Stream(), HookStreams()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms on the side stream before the write
        x.add_(1.0)
        streams.note("bucket", x)
    streams.note("bucket", x)  # a hook of the same bucket on the main stream
    if joined:
        streams.join("bucket")
    seen = x.clone()  # main stream: what a collective enqueued here would read
    torch.cuda.synchronize()
    if joined:
        assert seen.min().item() == 1.0
    else:  # the race the join removes (the side stream is still sleeping)
        assert seen.max().item() == 0.0


def test_note_keeps_one_entry_per_stream():
    x, side, streams = torch.zeros(4, device="cuda"), torch.cuda.Stream(), HookStreams()
    for _ in range(3):
        streams.note("bucket", x)
    with torch.cuda.stream(side):
        streams.note("bucket", x)
    seen = streams._seen["bucket"]
    assert sorted(seen) == sorted(s.cuda_stream for s in seen.values())
    assert sorted(seen) == sorted([torch.cuda.current_stream().cuda_stream, side.cuda_stream])
