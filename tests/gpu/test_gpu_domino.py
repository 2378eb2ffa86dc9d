"""On the GPU machine: Domino against plain TP with NCCL, fp32 (TF32 off) and bf16, at TP = each
power-of-two GPU count from 2 up: the gpu tier (`python -m pytest tests --tier gpu -q`)."""

from __future__ import annotations

import torch
from test_domino import check_equal
from test_tp_equivalence import FAMILIES

from dist_utils import C, DistSuite
from megadomino.distributed import ParallelDims

PLANS = [(2, 1, False), (3, 2, True), (4, 4, False), (2, 2, True)]
# bf16: Domino sums slices' weight gradients in fp32 and rounds once, plain TP's GEMM does too,
# but the partial sums differ in order; the bound is bf16 rounding.
DTYPES = {"fp32": ("float32", 1e-4), "bf16": ("bfloat16", 3e-2)}


SUITE = DistSuite(worlds=(2, 4, 8), backend="nccl")


@SUITE.setup
def _setup(world: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {"dims": ParallelDims(tp=world)}


for family in FAMILIES:
    for n, k, sp in PLANS:
        for name, (dtype, rel) in DTYPES.items():
            SUITE.case(f"{family}-N{n}-K{k}-sp{sp}-{name}", check_equal, family, C.dims, n, k, sp,
                       False, device="cuda", params_dtype=dtype, rel=rel)
    SUITE.case(f"{family}-recompute-bf16", check_equal, family, C.dims, 2, 2, True, True,
               device="cuda", params_dtype="bfloat16", rel=3e-2)

test_gpu_domino_matches_plain_tp = SUITE.test()
