"""On the GPU machine: tests/test_pipeline_codec_checkpoint.py's cases under NCCL, PP2 on 2 GPUs
(int8 through the ZeRO++ Triton kernel, adatopk's top-k on the GPU): the codecs' state saved
and resumed through the training loop gives the uninterrupted run's losses and grad norms bit
for bit (deterministic kernels), adaptive and with error feedback; the fresh starts and the
missing file as on the CPU. On CUDA a send is timed when the codec transport's watcher next
polls it, which may be after its step, so the windows' send counts are not compared here
(`exact_windows`). `python -m pytest tests --tier gpu -q
tests/gpu/test_gpu_pipeline_codec_checkpoint.py` runs it.
"""

from __future__ import annotations

import pytest
import test_pipeline_codec_checkpoint as twin
from gpu_twins import adopt, deterministic, rank_device

from dist_utils import DistSuite

LOOP = 180.0  # budget (s) of a case: a few short runs of the training loop

SUITE = DistSuite(worlds=(2,), backend="nccl", timeout=LOOP)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    rank_device()  # TF32 off, cuBLAS's workspace fixed for the deterministic cases
    return twin._setup(world, root)


for _name in ("resume-auto", "resume-auto-async-save"):
    adopt(SUITE, twin.SUITE, _name, 2, prefix="gpu", timeout=LOOP, wrap=deterministic,
          exact_windows=False)
adopt(SUITE, twin.SUITE, "resume-error-feedback", 2, prefix="gpu", timeout=LOOP,
      wrap=deterministic)
for _name in ("fresh-starts", "missing-file"):
    adopt(SUITE, twin.SUITE, _name, 2, prefix="gpu", timeout=LOOP)


@pytest.fixture(scope="module")
def gpu_codec_checkpoint_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("gpu-codec-checkpoints")),)


test_gpu_pipeline_codec_checkpoint = SUITE.test(args_fixture="gpu_codec_checkpoint_root")
