"""On the GPU machine: tests/test_zero_fp8_gather.py's gloo cases under NCCL, each at its own
world (2 GPUs: ZeRO 3 and ZeRO 1 with the overlapped gather, bytes, training against the run
without the gather, exact resume; 4 GPUs: TP=2 x DP=2, hpZ on 2 nodes x 2), the FP8 GEMMs
through torch._scaled_mm. The twin's cases build on the rank's device themselves (the training
loop's, the engine test's `comm.group_device()`); the setup only turns TF32 off
(gpu_twins.rank_device). `python -m pytest tests --tier gpu -q` runs it.
"""

from __future__ import annotations

import test_zero_fp8_gather as twin
from gpu_twins import rank_device
from test_zero_fp8_gather import fp8_root  # noqa: F401 (the suite's fixture)


def _setup(world: int, root: str) -> dict:
    rank_device()
    return twin._setup(world, root)


SUITE = twin.SUITE.derived(backend="nccl", setup=_setup, worlds=None)
test_gpu_zero_fp8_gather = SUITE.test(args_fixture="fp8_root")
