"""Per-phase timers for the log line: data, forward, backward, optimizer; with pipeline stages
also wait, the time a stage is blocked on communication (pipeline/executor.py).

On a GPU a phase's time is the GPU time between two CUDA events recorded on the current stream at
its start and end (the stream's view: queued work and waits included); recording an event does not
synchronize, and the times are read once per log line, after the one synchronize the log line
already pays. The `data` phase is host work (indexing, collation, the copy's launch) and is timed
on the host clock. On the CPU every phase is timed on the host clock.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

HOST_PHASES = ("data",)


class Timers:
    """`with timers("forward"): ...` accumulates; `flush()` returns and resets the totals."""

    def __init__(self, device: torch.device):
        self.use_events = device.type == "cuda"
        self.host_seconds: dict[str, float] = defaultdict(float)
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.use_events and phase not in HOST_PHASES:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            stop.record()
            self.events[phase].append((start, stop))
        else:
            began = time.perf_counter()
            yield
            self.host_seconds[phase] += time.perf_counter() - began

    def flush(self) -> dict[str, float]:
        """Seconds per phase since the last flush. Synchronizes on the last event of each phase."""
        totals = dict(self.host_seconds)
        for phase, pairs in self.events.items():
            pairs[-1][1].synchronize()
            totals[phase] = sum(start.elapsed_time(stop) for start, stop in pairs) / 1e3
        self.host_seconds.clear()
        self.events.clear()
        return totals
