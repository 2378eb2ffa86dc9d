"""On the GPU machine: the TP equivalence of tests/test_tp_equivalence.py with NCCL, in fp32
(TF32 off) and bf16, at TP = every GPU count from 2 up to what the machine has (powers of two).
The gpu tier: a world needs as many GPUs (`python -m pytest tests --tier gpu -q`)."""

from __future__ import annotations

import torch
from test_tp_equivalence import FAMILIES, check_model

from dist_utils import C, DistSuite
from megadomino.distributed import ParallelDims

# bf16 against the fp32 TP=1 model: bf16 rounding, not TP, sets these bounds.
BF16_REL = (3e-2, 6e-2)


SUITE = DistSuite(worlds=(2, 4, 8), backend="nccl")


@SUITE.setup
def _setup(world: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {"ref": ParallelDims(tp=1), "tp": ParallelDims(tp=world)}


FP32 = dict(device="cuda", rel=(1e-4, 1e-4))
BF16 = dict(device="cuda", params_dtype="bfloat16", rel=BF16_REL)
for family in FAMILIES:
    for sp in (False, True):
        SUITE.case(f"{family}-sp{sp}-fp32", check_model, family, sp, C.ref, C.tp, False, **FP32)
        SUITE.case(f"{family}-sp{sp}-bf16", check_model, family, sp, C.ref, C.tp, False, **BF16)
    SUITE.case(f"{family}-comm-overlap-fp32", check_model, family, True, C.ref, C.tp, False,
               tp_comm_overlap=True, **FP32)
    SUITE.case(f"{family}-comm-overlap-bf16", check_model, family, True, C.ref, C.tp, False,
               tp_comm_overlap=True, **BF16)

test_gpu_tensor_parallel_matches_dense = SUITE.test()
