"""On the GPU machine: `--enable-cuda-graph` with a Domino plan (its schedule captured through the
runner's capture mode, overlap/cuda_graph.py) trains like eager Domino. A small GPT and a small
Llama train the same iterations graphed and eager; the losses and the weights after them agree,
fp32 (TF32 off: same kernels, so they agree to rounding; also with dropout 0.1, whose masks
the graphs draw as the eager schedule does) and bf16 (bound: bf16 rounding): at TP 1 (one GPU),
and with two GPUs at TP 2 with and without sequence parallelism and at TP 1 x DP 2 with the
distributed optimizer (ZeRO stage 1). Skipped without enough GPUs.
The gpu tier: `python -m pytest tests --tier gpu -q`; this file alone:
`python -m pytest -q tests/gpu/test_gpu_cuda_graph_domino.py --tier gpu`."""

from __future__ import annotations

import torch

from configs import make_config
from dist_utils import C, DistSuite, assert_close
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.overlap.cuda_graph import GraphedRunner
from megadomino.train.loop import train

ITERS = 6
DTYPES = {"fp32": ("float32", 1e-5), "bf16": ("bfloat16", 2e-2)}


def _train(family: str, dims: ParallelDims, dtype: str, graph: bool, plan: tuple[int, int],
           sp: bool, zero_stage: int, dropout: float) -> tuple[list[float], dict]:
    preset = "gpt-tiny" if family == "gpt" else "llama-tiny"
    model_config = ModelConfig.preset(preset, hidden_dropout=dropout, attention_dropout=dropout,
                                      seq_length=64, params_dtype=dtype)
    config = make_config(model_config, sequence_parallel=sp, batch_slices=plan[0],
                         hidden_slices=plan[1], enable_cuda_graph=graph,
                         tensor_model_parallel_size=dims.tp, micro_batch_size=4,
                         global_batch_size=8 * dims.dp, train_iters=ITERS, lr=3e-3,
                         lr_warmup_iters=2, log_interval=ITERS, mock_data=True,
                         bf16=dtype == "bfloat16", stage=zero_stage)
    lines: list[str] = []
    history = train(config, dims, family, log=lines.append)
    if graph and dims.rank == 0:
        assert any("through Domino's schedule" in line for line in lines), lines
    # the graphs are freed before the run returns, while the process group they captured exists
    assert not isinstance(history["model"].decoder.runner, GraphedRunner)
    return history["losses"], history["optimizer"].full_state_dict()


def check_graphed_domino_equals_eager(family: str, dims: ParallelDims, dtype: str, rel: float,
                                      plan: tuple[int, int], sp: bool,
                                      zero_stage: int = 0, dropout: float = 0.0) -> None:
    eager_losses, eager_weights = _train(family, dims, dtype, False, plan, sp, zero_stage,
                                         dropout)
    losses, weights = _train(family, dims, dtype, True, plan, sp, zero_stage, dropout)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=rel,
                               atol=0)
    assert eager_losses[-1] < eager_losses[0], eager_losses
    assert weights.keys() == eager_weights.keys()
    for name, weight in weights.items():
        assert_close(weight.float(), eager_weights[name].float(), rel, f"weight {name}")


SUITE = DistSuite(worlds=(1, 2), backend="nccl")


@SUITE.setup
def _setup(world: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {"tp": ParallelDims(tp=world), "dp": ParallelDims(tp=1, dp=world)}


for family in ("gpt", "llama"):
    for name, (dtype, rel) in DTYPES.items():
        for plan in ((2, 1), (3, 2)):
            SUITE.case(f"{family}-tp1-N{plan[0]}-K{plan[1]}-{name}",
                       check_graphed_domino_equals_eager, family, C.tp, dtype, rel, plan, False,
                       worlds=(1,))
        for plan, sp in (((2, 1), False), ((2, 2), True)):
            SUITE.case(f"{family}-tp2-sp{sp}-N{plan[0]}-K{plan[1]}-{name}",
                       check_graphed_domino_equals_eager, family, C.tp, dtype, rel, plan, sp,
                       worlds=(2,))
    SUITE.case(f"{family}-tp1-N2-K1-fp32-dropout", check_graphed_domino_equals_eager, family,
               C.tp, "float32", DTYPES["fp32"][1], (2, 1), False, 0, 0.1, worlds=(1,))
    SUITE.case(f"{family}-tp2-spTrue-N2-K2-fp32-dropout", check_graphed_domino_equals_eager,
               family, C.tp, "float32", DTYPES["fp32"][1], (2, 2), True, 0, 0.1, worlds=(2,))
    SUITE.case(f"{family}-dp2-N2-K1-fp32-zero1", check_graphed_domino_equals_eager, family,
               C.dp, "float32", DTYPES["fp32"][1], (2, 1), False, 1, worlds=(2,))

test_gpu_cuda_graph_domino_matches_eager = SUITE.test()
