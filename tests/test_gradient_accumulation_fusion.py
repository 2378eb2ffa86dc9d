"""Gradient-accumulation fusion (`parallel.gradient_accumulation_fusion`, Megatron's default;
`--no-gradient-accumulation-fusion` off): at ZeRO stages 0 and 1 the layers' weight gradients
accumulate into the engine's fp32 buffers inside their GEMM (tp/layers.py `weight_grad`) and
autograd gets a placeholder that the engine's hook does not add. Over two micro-batches (one
accumulated under no_sync, one synced) every accumulated gradient equals the unfused engine's
(fp32: up to the GEMM's reassociation); in bf16 the fused weights' gradients are nearer an fp32
reference than the unfused ones, which round each micro-batch's product to bf16. Paths whose
backward is not the linears' own (Domino, FP8) keep returning gradients. One process (gloo)."""

from __future__ import annotations

import pytest
import torch

from configs import make_config
from megadomino.build import build_model
from megadomino.config import FP8Recipe, ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.zero.optimizer import build_engine

pytestmark = pytest.mark.usefixtures("single_process_group")

MODEL = ModelConfig.preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0, seq_length=16,
                           max_position_embeddings=16, num_layers=2, vocab_size=331)


def _grads(dtype: str, stage: int, fused: bool, full: dict, batches) -> dict:
    model_config = MODEL.replace(params_dtype=dtype)
    config = make_config(model_config, stage=stage, gradient_accumulation_fusion=fused,
                         micro_batch_size=2, global_batch_size=4)
    dims = ParallelDims(tp=1)
    model = build_model(model_config, dims, "gpt", parallel=config.parallel)
    model.load_full_state_dict(full)
    engine = build_engine(model, dims, config)
    engine.zero_grad()
    with engine.no_sync():
        engine.backward(model(batches[0][:, :-1], labels=batches[0][:, 1:]).mean())
    engine.backward(model(batches[1][:, :-1], labels=batches[1][:, 1:]).mean())
    assert all(p.grad is None for p in model.parameters())
    weights = {name for name, p in model.named_parameters() if getattr(p, "fused_wgrad", False)}
    assert bool(weights) == fused, weights
    return {name: engine.accumulated_grad(p).clone() for name, p in model.named_parameters()}


def _setup():
    torch.manual_seed(0)
    full = build_model(MODEL, ParallelDims(tp=1), "gpt").full_state_dict()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, MODEL.vocab_size, (3, 17), generator=generator)
               for _ in range(2)]
    return full, batches


@pytest.mark.parametrize("stage", [0, 1])
def test_fused_equals_unfused_in_fp32(stage: int) -> None:
    full, batches = _setup()
    fused = _grads("float32", stage, True, full, batches)
    plain = _grads("float32", stage, False, full, batches)
    for name, grad in plain.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fused_bf16_weights_are_nearer_fp32() -> None:
    full, batches = _setup()
    reference = _grads("float32", 0, False, full, batches)
    fused = _grads("bfloat16", 0, True, full, batches)
    plain = _grads("bfloat16", 0, False, full, batches)
    for name in (n for n in reference if "linear" in n and n.endswith("weight")):
        fused_error = (fused[name] - reference[name]).norm()
        plain_error = (plain[name] - reference[name]).norm()
        assert fused_error <= plain_error * 1.05, (name, fused_error, plain_error)


@pytest.mark.parametrize("fields", [dict(batch_slices=2, explicit_backward=True),
                                    dict(gradient_accumulation_fusion=False)])
def test_paths_that_return_their_gradients_are_not_marked(fields: dict) -> None:
    config = make_config(MODEL, **fields)
    model = build_model(MODEL, ParallelDims(tp=1), "gpt", parallel=config.parallel)
    assert not any(getattr(p, "fused_wgrad", False) for p in model.parameters())


def test_fp8_linears_are_not_marked() -> None:
    config = make_config(MODEL)
    model = build_model(MODEL, ParallelDims(tp=1), "gpt", parallel=config.parallel,
                        fp8=FP8Recipe())
    assert not any(getattr(p, "fused_wgrad", False) for p in model.parameters())
