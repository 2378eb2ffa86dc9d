"""When a run stops early, as Megatron-LM decides it: --exit-signal-handler, --exit-duration-in-mins
and --exit-interval, checked after every iteration. The loop saves a checkpoint (with --save) and
returns normally, so a SLURM job pre-empted with SIGTERM leaves a checkpoint to resume from.

A signal reaches some ranks and not others, and clocks differ: the ranks agree with one all-reduce
(MAX) of two flags per iteration, only when either option is on.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

import torch

from megadomino.config import RuntimeConfig
from megadomino.distributed import comm


class StopConditions:
    """`with StopConditions(config, device) as stop:` installs the SIGTERM handler (if asked) and
    restores the previous one on exit; `stop.reason(iteration)` says why to stop, or None."""

    def __init__(self, config: RuntimeConfig, device: torch.device):
        self.config, self.device = config, device
        self.started = time.monotonic()
        self.signalled = False
        self._previous = None

    def __enter__(self) -> StopConditions:
        if self.config.exit_signal_handler:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.config.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def reason(self, iteration: int) -> str | None:
        """The same answer on every rank (collective when a signal or duration limit is set)."""
        config = self.config
        limit = config.exit_duration_in_mins
        if config.exit_signal_handler or limit is not None:
            elapsed = (time.monotonic() - self.started) / 60.0
            flags = torch.tensor([float(self.signalled), float(limit is not None
                                                               and elapsed > limit)],
                                 device=self.device)
            comm.all_reduce(flags, op=comm.ReduceOp.MAX)
            signalled, timed_out = flags.tolist()
            if signalled:
                return f"SIGTERM received (--exit-signal-handler) by iteration {iteration}"
            if timed_out:
                return f"--exit-duration-in-mins={limit} reached at iteration {iteration}"
        if config.exit_interval and iteration % config.exit_interval == 0:
            return f"--exit-interval={config.exit_interval} reached at iteration {iteration}"
        return None
