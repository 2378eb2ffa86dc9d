"""On the GPU machine: Domino against plain TP with NCCL, fp32 (TF32 off) and bf16, at TP = each
power-of-two GPU count from 2 up. Skipped without 2+ GPUs; `python -m pytest tests/gpu -q`."""

from __future__ import annotations

import functools

import pytest
import torch
from test_domino import check_equal
from test_tp_equivalence import FAMILIES

from dist_utils import CaseRunner, check_result, run_cases
from megadomino.parallel import ParallelDims

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4, 8) if w <= GPUS]
PLANS = [(2, 1, False), (3, 2, True), (4, 4, False), (2, 2, True)]
# bf16: Domino sums slices' weight gradients in fp32 and rounds once, plain TP's GEMM does too,
# but the partial sums differ in order; the bound is bf16 rounding.
DTYPES = {"fp32": ("float32", 1e-4), "bf16": ("bfloat16", 3e-2)}

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2+ CUDA GPUs")


def gpu_cases() -> dict[str, str | None]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dims = ParallelDims(tp=ParallelDims(tp=1).world_size)
    runner = CaseRunner()
    for family in FAMILIES:
        for n, k, sp in PLANS:
            for name, (dtype, rel) in DTYPES.items():
                runner.run(f"{family}-N{n}-K{k}-sp{sp}-{name}", check_equal, family, dims, n, k,
                           sp, False, device="cuda", params_dtype=dtype, rel=rel)
        runner.run(f"{family}-recompute-bf16", check_equal, family, dims, 2, 2, True, True,
                   device="cuda", params_dtype="bfloat16", rel=3e-2)
    return runner.results


CASES = [f"{family}-N{n}-K{k}-sp{sp}-{name}" for family in FAMILIES for n, k, sp in PLANS
         for name in DTYPES] + [f"{family}-recompute-bf16" for family in FAMILIES]


@functools.cache
def results_for(world: int) -> dict[str, str | None]:
    return run_cases(world, gpu_cases, backend="nccl")


@pytest.mark.parametrize("world", WORLDS or [2])
@pytest.mark.parametrize("case", CASES)
def test_gpu_domino_matches_plain_tp(world: int, case: str):
    check_result(results_for(world), case)
