"""On the GPU machine: `--enable-cuda-graph` training equals eager training. A small GPT and a
small Llama train the same iterations with the layers captured in CUDA graphs and without, fp32
(TF32 off: same kernels, so the losses agree to rounding; also with dropout 0.1, whose masks
the graphs draw as eager calls do) and bf16 (bound: bf16 rounding), at
TP = 1 (one GPU) and at TP = each power-of-two GPU count from 2 up with sequence parallelism and
the fused symmetric-memory GEMM + communication (`--tp-comm-overlap`), and at TP = half the GPUs x
DP 2 (the DP gradient hooks then run on two streams: megadomino/distributed/streams.py), there also
with the distributed optimizer (ZeRO stage 1); and with FP8 linears (hybrid, delayed and
tensorwise scaling; fp32, whose graphed losses must be the eager run's, and bf16; the fused
communication off, which FP8 refuses).
The gpu tier: `python -m pytest tests --tier gpu -q`."""

from __future__ import annotations

import torch

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train

ITERS = 12
DTYPES = {"fp32": ("float32", 1e-5), "bf16": ("bfloat16", 2e-2)}


def _losses(family: str, dims: ParallelDims, dtype: str, graph: bool, sp: bool,
            zero_stage: int = 0, dropout: float = 0.0, fp8: str | None = None) -> list[float]:
    preset = "gpt-tiny" if family == "gpt" else "llama-tiny"
    extra = {} if family == "gpt" else {"num_query_groups": 2 if dims.tp <= 2 else dims.tp}
    model_config = ModelConfig.preset(preset, **extra, hidden_dropout=dropout,
                                      attention_dropout=dropout,
                                      seq_length=64, params_dtype=dtype)
    recipe = {"format": "hybrid", "recipe": fp8} if fp8 else {}
    config = make_config(model_config, sequence_parallel=sp, tp_comm_overlap=sp and not fp8,
                         enable_cuda_graph=graph, tensor_model_parallel_size=dims.tp,
                         micro_batch_size=2, global_batch_size=4 * dims.dp, train_iters=ITERS,
                         lr=3e-3, lr_warmup_iters=2, log_interval=ITERS, mock_data=True,
                         bf16=dtype == "bfloat16", stage=zero_stage, **recipe)
    history = train(config, dims, family, log=lambda _line: None)
    return history["losses"]


def check_graphed_equals_eager(family: str, dims: ParallelDims, dtype: str, rel: float,
                               sp: bool, zero_stage: int = 0, dropout: float = 0.0,
                               fp8: str | None = None) -> None:
    eager = _losses(family, dims, dtype, False, sp, zero_stage, dropout, fp8)
    graphed = _losses(family, dims, dtype, True, sp, zero_stage, dropout, fp8)
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=rel, atol=0)
    assert eager[-1] < eager[0], f"did not learn: {eager[0]:.3f} -> {eager[-1]:.3f}"


def _layouts(world: int) -> list[tuple[int, bool]]:
    """(tp, sequence parallel) per world: TP alone, and TP x DP (DP 2 at TP world/2)."""
    if world == 1:
        return [(1, False)]
    return [(world, True), (world // 2, world > 2)]


SUITE = DistSuite(backend="nccl")


@SUITE.setup
def _setup(world: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return {f"tp{tp}": ParallelDims(tp=tp, dp=world // tp) for tp, _ in _layouts(world)}


def _cases() -> dict[str, tuple]:
    """{name: (fn, args, worlds)}: a name appears at every world whose layouts make it (`C.tpN`
    is TP=N with the rest of that world as DP)."""
    cases: dict[str, tuple] = {}

    def add(name: str, world: int, *call) -> None:
        fn, args, worlds = cases.get(name, (call[0], call[1:], ()))
        assert (fn, args) == (call[0], call[1:]), name
        cases[name] = (fn, args, (*worlds, world))

    for world in (1, 2, 4, 8):
        for tp, sp in _layouts(world):
            dims = getattr(C, f"tp{tp}")
            for family in ("gpt", "llama"):
                for name, (dtype, rel) in DTYPES.items():
                    add(f"{family}-tp{tp}-sp{sp}-{name}", world, check_graphed_equals_eager,
                        family, dims, dtype, rel, sp)
                # dropout: the graphs draw the eager run's masks (generators registered, the
                # warm-up's draws undone)
                add(f"{family}-tp{tp}-sp{sp}-fp32-dropout", world, check_graphed_equals_eager,
                    family, dims, "float32", DTYPES["fp32"][1], sp, 0, 0.1)
                # FP8 linears (hybrid): the replays cast each weight; the warm-up's advance of
                # the delayed scaling state undone (fp32: the eager run's numbers)
                for recipe in ("delayed", "tensorwise"):
                    add(f"{family}-tp{tp}-sp{sp}-fp32-fp8-{recipe}", world,
                        check_graphed_equals_eager, family, dims, "float32",
                        DTYPES["fp32"][1], sp, 0, 0.0, recipe)
                add(f"{family}-tp{tp}-sp{sp}-bf16-fp8-delayed", world, check_graphed_equals_eager,
                    family, dims, "bfloat16", DTYPES["bf16"][1], sp, 0, 0.0, "delayed")
                if tp < world:  # the distributed optimizer's reducer hooks too (fp32)
                    add(f"{family}-tp{tp}-sp{sp}-fp32-zero1", world, check_graphed_equals_eager,
                        family, dims, "float32", DTYPES["fp32"][1], sp, 1)
    return cases


for _name, (_fn, _args, _worlds) in _cases().items():
    SUITE.case(_name, _fn, *_args, worlds=_worlds)

test_gpu_cuda_graph_matches_eager = SUITE.test()
