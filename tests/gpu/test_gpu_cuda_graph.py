"""On the GPU machine: `--enable-cuda-graph` training equals eager training. A small GPT and a
small Llama train the same iterations with the layers captured in CUDA graphs and without, fp32
(TF32 off: same kernels, so the losses agree to rounding) and bf16 (bound: bf16 rounding), at
TP = 1 (one GPU) and at TP = each power-of-two GPU count from 2 up with sequence parallelism and
the fused symmetric-memory GEMM + communication (`--tp-comm-overlap`), and at TP = half the GPUs x
DP 2 (the DP gradient hooks then run on two streams: megadomino/parallel/streams.py), there also
with the distributed optimizer (ZeRO stage 1).
`python -m pytest tests/gpu -q`."""

from __future__ import annotations

import functools

import pytest
import torch

from dist_utils import CaseRunner, check_result, run_cases, with_fused_comm
from megadomino.config import ModelConfig, TrainConfig
from megadomino.parallel import ParallelDims
from megadomino.training.loop import train

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4, 8) if w <= GPUS]
ITERS = 12
DTYPES = {"fp32": ("float32", 1e-5), "bf16": ("bfloat16", 2e-2)}

pytestmark = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")


def _losses(family: str, dims: ParallelDims, dtype: str, graph: bool, sp: bool,
            zero_stage: int | None = None) -> list[float]:
    preset = "gpt-tiny" if family == "gpt" else "llama-tiny"
    extra = {} if family == "gpt" else {"num_query_groups": 2 if dims.tp <= 2 else dims.tp}
    model_config = ModelConfig.preset(preset, **extra, hidden_dropout=0.0, attention_dropout=0.0,
                                      seq_length=64, params_dtype=dtype, sequence_parallel=sp,
                                      tp_comm_overlap=sp, enable_cuda_graph=graph)
    train_config = TrainConfig(tensor_model_parallel_size=dims.tp, micro_batch_size=2,
                               global_batch_size=4 * dims.dp, train_iters=ITERS, lr=3e-3,
                               lr_warmup_iters=2, log_interval=ITERS, mock_data=True,
                               bf16=dtype == "bfloat16", zero_stage=zero_stage)
    history = train(model_config, train_config, dims, family, log=lambda _line: None)
    return history["losses"]


def check_graphed_equals_eager(family: str, dims: ParallelDims, dtype: str, rel: float,
                               sp: bool, zero_stage: int | None = None) -> None:
    eager = _losses(family, dims, dtype, False, sp, zero_stage)
    graphed = _losses(family, dims, dtype, True, sp, zero_stage)
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=rel, atol=0)
    assert eager[-1] < eager[0], f"did not learn: {eager[0]:.3f} -> {eager[-1]:.3f}"


def gpu_cases(tp_of_world) -> dict[str, str | None]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world = ParallelDims(tp=1).world_size
    runner = CaseRunner()
    for tp, sp in tp_of_world(world):
        dims = ParallelDims(tp=tp, dp=world // tp)
        for family in ("gpt", "llama"):
            for name, (dtype, rel) in DTYPES.items():
                runner.run(f"{family}-tp{tp}-sp{sp}-{name}", check_graphed_equals_eager, family,
                           dims, dtype, rel, sp)
            if sp and dims.dp == 1:  # our symmetric-memory protocols under capture too
                for mode in ("whole-dgrad", "ours"):
                    runner.run(f"{family}-tp{tp}-sp{sp}-fp32-{mode}", with_fused_comm, mode,
                               check_graphed_equals_eager, family, dims, "float32",
                               DTYPES["fp32"][1], sp)
            if dims.dp > 1:  # the distributed optimizer's reducer hooks too (fp32)
                runner.run(f"{family}-tp{tp}-sp{sp}-fp32-zero1", check_graphed_equals_eager,
                           family, dims, "float32", DTYPES["fp32"][1], sp, 1)
    return runner.results


def _layouts(world: int) -> list[tuple[int, bool]]:
    """(tp, sequence parallel) per world: TP alone, and TP x DP (DP 2 at TP world/2)."""
    if world == 1:
        return [(1, False)]
    return [(world, True), (world // 2, world > 2)]


@functools.cache
def results_for(world: int) -> dict[str, str | None]:
    return run_cases(world, gpu_cases, _layouts, backend="nccl")


def _case_names(world: int) -> list[str]:
    names = []
    for tp, sp in _layouts(world):
        for family in ("gpt", "llama"):
            names += [f"{family}-tp{tp}-sp{sp}-{name}" for name in DTYPES]
            if sp and tp == world:
                names += [f"{family}-tp{tp}-sp{sp}-fp32-{mode}"
                          for mode in ("whole-dgrad", "ours")]
            if tp < world:
                names.append(f"{family}-tp{tp}-sp{sp}-fp32-zero1")
    return names


@pytest.mark.parametrize("world, case", [(w, c) for w in [1, *WORLDS] for c in _case_names(w)])
def test_gpu_cuda_graph_matches_eager(world: int, case: str):
    check_result(results_for(world), case)
