"""On the GPU machine: FP8 linears under tensor parallelism on NCCL, at TP 2 and 4, the cases of
tests/test_fp8.py's distributed suite: a TP model's logits over three forwards against the TP=1
FP8 model built from the same weights (delayed scaling: the amaxes max-reduced over TP, but
cuBLAS sums TP=1's and TP=2's GEMMs in other orders, an ulp can move an activation across an FP8
rounding boundary, and a moved amax moves the next step's scale (test_fp8.DELAYED_FLIPS), so
within 1.5x FP8's own error, as tensorwise, where each rank scales its own shards), and a TP run
whose loss falls. The models are built on the rank's
GPU (build_model's default), where the GEMMs are `torch._scaled_mm`'s; the twin's tokens are
drawn on the CPU, as it draws them, then moved. The gpu tier: `python -m pytest tests --tier gpu
-q`."""

from __future__ import annotations

import test_fp8
from gpu_twins import FP32_REL, TorchDrawingOnCpu, patch, rank_device

from dist_utils import C, DistSuite
from megadomino.distributed import ParallelDims

SUITE = DistSuite(worlds=(2, 4), backend="nccl", timeout=120.0)


@SUITE.setup
def _setup(world: int) -> dict:
    patch(test_fp8, REL_DELAYED=FP32_REL, DELAYED_FLIPS=1.5,
          torch=TorchDrawingOnCpu(rank_device()))
    return {"ref": ParallelDims(tp=1), "tp": ParallelDims(tp=world)}


for recipe in ("delayed", "tensorwise"):
    SUITE.case(f"forward-{recipe}", test_fp8._case_tp2_forward_matches_tp1, C.ref, C.tp, recipe)
SUITE.case("learns", test_fp8._case_learns, C.tp)

test_gpu_fp8_tensor_parallel = SUITE.test()
