"""On the GPU machine: `--compile-layer-pieces` training equals eager training. A small GPT and a
small Llama train the same iterations with the layers' element-wise pieces compiled and eager,
fp32 (TF32 off; the compiled kernels may reassociate, so 1e-4) and bf16 (bf16 rounding), eager
and under CUDA graphs (the compiled kernels captured in the graphs), at TP = 1, and at TP = 2 with
sequence parallelism where there are two GPUs; and with FP8 linears, whose casts compile too.
The CPU tier compares the pieces themselves under every execution (tests/test_compiled_pieces.py).
The gpu tier: `python -m pytest tests --tier gpu -q`."""

from __future__ import annotations

import torch

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train

ITERS = 12
DTYPES = {"fp32": ("float32", 1e-4), "bf16": ("bfloat16", 2e-2)}


def _losses(family: str, dims: ParallelDims, dtype: str, compiled: bool, graph: bool,
            sp: bool, fp8: bool = False) -> list[float]:
    preset = "gpt-tiny" if family == "gpt" else "llama-tiny"
    model_config = ModelConfig.preset(preset, hidden_dropout=0.0, attention_dropout=0.0,
                                      seq_length=64, params_dtype=dtype)
    config = make_config(model_config, compile_layer_pieces=compiled, enable_cuda_graph=graph,
                         sequence_parallel=sp, tensor_model_parallel_size=dims.tp,
                         micro_batch_size=2, global_batch_size=4 * dims.dp, train_iters=ITERS,
                         lr=3e-3, lr_warmup_iters=2, log_interval=ITERS, mock_data=True,
                         bf16=dtype == "bfloat16", **({"format": "hybrid"} if fp8 else {}))
    return train(config, dims, family, log=lambda _line: None)["losses"]


def check_compiled_equals_eager(family: str, dims: ParallelDims, dtype: str, rel: float,
                                graph: bool, sp: bool, fp8: bool = False) -> None:
    eager = _losses(family, dims, dtype, False, False, sp, fp8)
    compiled = _losses(family, dims, dtype, True, graph, sp, fp8)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=rel, atol=0)
    assert eager[-1] < eager[0], f"did not learn: {eager[0]:.3f} -> {eager[-1]:.3f}"


SUITE = DistSuite(backend="nccl")


@SUITE.setup
def _setup(world: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    layouts = {"tp1": ParallelDims(tp=1, dp=world)}
    if world % 2 == 0:
        layouts["tp2"] = ParallelDims(tp=2, dp=world // 2)
    return layouts


for _family in ("gpt", "llama"):
    for _name, (_dtype, _rel) in DTYPES.items():
        for _graph in (False, True):
            SUITE.case(f"{_family}-tp1-{_name}-graph{_graph}", check_compiled_equals_eager,
                       _family, C.tp1, _dtype, _rel, _graph, False, worlds=(1,), timeout=300)
    SUITE.case(f"{_family}-tp2-sp-bf16", check_compiled_equals_eager, _family, C.tp2,
               "bfloat16", DTYPES["bf16"][1], False, True, worlds=(2,), timeout=300)

    # FP8 linears (delayed scaling): the compiled casts write the same FP8 bytes
    SUITE.case(f"{_family}-tp1-fp8", check_compiled_equals_eager, _family, C.tp1, "bfloat16",
               DTYPES["bf16"][1], False, False, True, worlds=(1,), timeout=300)

test_gpu_compiled_pieces_match_eager = SUITE.test()
