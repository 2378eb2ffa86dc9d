"""On the GPU machine: tests/test_diloco.py's gloo cases under NCCL, each at its own world (2
GPUs: the outer step against DiLoCo's update in fp32, bf16 and int8 (the Triton quantizer), H = 1
against plain DP, the mid-round resume, the checksum stop; 4 GPUs: ZeRO 1 inside the sites, 2
pipeline stages, the stage-1 resume). The twin's cases build on the training loop's device; the
setup only turns TF32 off and fixes cuBLAS's workspace (gpu_twins.rank_device).
`python -m pytest tests --tier gpu -q` runs it.
"""

from __future__ import annotations

import test_diloco as twin
from gpu_twins import rank_device
from test_diloco import diloco_root  # noqa: F401 (the suite's fixture)


def _setup(world: int, root: str) -> dict:
    rank_device()
    return twin._setup(world, root)


SUITE = twin.SUITE.derived(backend="nccl", setup=_setup, worlds=None)
test_gpu_diloco = SUITE.test(args_fixture="diloco_root")
