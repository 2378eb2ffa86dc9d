"""On the GPU machine: the TP equivalence of tests/test_tp_equivalence.py with NCCL, in fp32
(TF32 off) and bf16, at TP = every GPU count from 2 up to what the machine has (powers of two).
Skipped without CUDA; `python -m pytest tests/gpu -q` runs it."""

from __future__ import annotations

import functools

import pytest
import torch
from test_tp_equivalence import FAMILIES, check_model

from dist_utils import CaseRunner, check_result, run_cases, with_fused_comm
from megadomino.parallel import ParallelDims

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4, 8) if w <= GPUS]
# bf16 against the fp32 TP=1 model: bf16 rounding, not TP, sets these bounds.
BF16_REL = (3e-2, 6e-2)

pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2+ CUDA GPUs")


def gpu_cases() -> dict[str, str | None]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dims_ref = ParallelDims(tp=1)
    dims_tp = ParallelDims(tp=dims_ref.world_size)
    runner = CaseRunner()
    for family in FAMILIES:
        for sp in (False, True):
            runner.run(f"{family}-sp{sp}-fp32", check_model, family, sp, dims_ref, dims_tp,
                       False, device="cuda", rel=(1e-4, 1e-4))
            runner.run(f"{family}-sp{sp}-bf16", check_model, family, sp, dims_ref, dims_tp,
                       False, device="cuda", params_dtype="bfloat16", rel=BF16_REL)
        runner.run(f"{family}-comm-overlap-fp32", check_model, family, True, dims_ref, dims_tp,
                   False, device="cuda", rel=(1e-4, 1e-4), tp_comm_overlap=True)
        runner.run(f"{family}-comm-overlap-bf16", check_model, family, True, dims_ref, dims_tp,
                   False, device="cuda", params_dtype="bfloat16", rel=BF16_REL,
                   tp_comm_overlap=True)
        # Our symmetric-memory protocols (parallel/async_tp.fused_comm_mode).
        for mode in ("whole-dgrad", "ours"):
            runner.run(f"{family}-comm-overlap-{mode}-fp32", with_fused_comm, mode, check_model,
                       family, True, dims_ref, dims_tp, False, device="cuda", rel=(1e-4, 1e-4),
                       tp_comm_overlap=True)
            runner.run(f"{family}-comm-overlap-{mode}-bf16", with_fused_comm, mode, check_model,
                       family, True, dims_ref, dims_tp, False, device="cuda",
                       params_dtype="bfloat16", rel=BF16_REL, tp_comm_overlap=True)
    return runner.results


CASES = [f"{family}-sp{sp}-{dtype}" for family in FAMILIES for sp in (False, True)
         for dtype in ("fp32", "bf16")] + [
             f"{family}-comm-overlap{mode}-{dtype}" for family in FAMILIES
             for mode in ("", "-whole-dgrad", "-ours") for dtype in ("fp32", "bf16")]


@functools.cache
def results_for(world: int) -> dict[str, str | None]:
    return run_cases(world, gpu_cases, backend="nccl")


@pytest.mark.parametrize("world", WORLDS or [2])
@pytest.mark.parametrize("case", CASES)
def test_gpu_tensor_parallel_matches_dense(world: int, case: str):
    check_result(results_for(world), case)
