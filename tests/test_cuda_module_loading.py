"""--cuda-module-loading: launch sets CUDA_MODULE_LOADING=EAGER before CUDA starts when the run
has pipeline stages (auto) or when asked (eager), and leaves CUDA's own choice otherwise. A
first launch of a lazily loaded kernel waits for the device's queued work; a pipeline's
prefetched receive stays queued until its peer sends, and the peer may wait on this rank (the
interleaved schedule's first step hung on 2 and 4 GPUs; with EAGER it trained)."""

from __future__ import annotations

import os

import pytest

from megadomino.cli import launch

BASE = ["--model-preset", "gpt-tiny", "--num-layers", "4", "--mock-data", "--train-iters", "1",
        "--micro-batch-size", "1", "--global-batch-size", "2"]


class _Started(Exception):
    pass


@pytest.mark.parametrize("flags, expected", [
    (("--pipeline-model-parallel-size", "2"), "EAGER"),
    ((), "untouched"),
    (("--cuda-module-loading", "eager"), "EAGER"),
    (("--pipeline-model-parallel-size", "2", "--cuda-module-loading", "lazy"), "untouched"),
])
def test_launch_loads_kernels_eagerly_with_pipeline_stages(monkeypatch, flags, expected):
    seen = []

    def init(*args, **kwargs) -> None:
        seen.append(os.environ["CUDA_MODULE_LOADING"])
        raise _Started

    monkeypatch.setattr(launch.dist, "init_process_group", init)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "untouched")
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29999")):
        monkeypatch.setenv(name, value)
    with pytest.raises(_Started):
        launch.main("gpt", [*BASE, *flags])
    assert seen == [expected]
