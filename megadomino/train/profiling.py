"""--profile: Megatron-LM's profiling window. Iterations --profile-step-start up to (not
including) --profile-step-end are profiled on the ranks of --profile-ranks: with
--use-pytorch-profiler by torch.profiler (CPU and CUDA activities), whose Chrome trace is written
to --tensorboard-dir (or ./profile) as `profile_rank{R}_iters{START}-{END}.json` and named in
the log; without it, as Megatron-LM does, by the CUDA profiler API (cudaProfilerStart/Stop), for
`nsys profile --capture-range=cudaProfilerApi` (nothing on CPU)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from megadomino.config import LoggingConfig


class ProfileWindow:
    """`before(iteration)` and `after(iteration)` around each iteration; `close()` at the end
    (a run that stops inside the window still writes its trace)."""

    def __init__(self, config: LoggingConfig, rank: int, log: Callable[[str], None]):
        self.on = config.profile and rank in config.profile_ranks
        self.start, self.end = config.profile_step_start, config.profile_step_end
        self.torch_profiler, self.rank, self.log = config.use_pytorch_profiler, rank, log
        self.directory = config.tensorboard_dir or "profile"
        self.active: torch.profiler.profile | bool | None = None

    def before(self, iteration: int) -> None:
        if not self.on or iteration != self.start:
            return
        if self.torch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.active = torch.profiler.profile(activities=activities)
            self.active.__enter__()
        elif torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStart()
            self.active = True

    def after(self, iteration: int) -> None:
        if self.active is not None and iteration == self.end - 1:
            self.close()

    def close(self) -> None:
        if self.active is None:
            return
        active, self.active = self.active, None
        if active is True:
            torch.cuda.cudart().cudaProfilerStop()
            return
        active.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory,
                            f"profile_rank{self.rank}_iters{self.start}-{self.end}.json")
        active.export_chrome_trace(path)
        self.log(f" profile of iterations [{self.start}, {self.end}) on rank {self.rank}: {path}")
