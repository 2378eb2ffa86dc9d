"""The leaner Domino executor changes no bit (one process, TP=1, GPT and Llama): linking units
(one `autograd.grad` call per pair of units, DominoRunner.links) gives the outputs and gradients
of the unlinked executor exactly, in fp32 and bf16, for uneven slices, hidden chunks, full
recompute and dropout; the backward makes 2 calls per layer and slice (+1 per slice for layer
0); the slice sums of WgradSink equal the zero-started fp32 sum rounded once; every parameter's
post-accumulate hook fires once per backward."""

from __future__ import annotations

import itertools

import pytest
import torch

from megadomino.config import DominoPlan, ModelConfig, ParallelConfig
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.models.blocks import rotary_tables
from megadomino.models.transformer import TransformerBlock
from megadomino.overlap.domino.schedule import DominoRunner
from megadomino.overlap.domino.units import WgradSink

pytestmark = pytest.mark.usefixtures("single_process_group")

CASES = [  # (family, N, K, recompute method, dropout, dtype)
    ("gpt", 2, 1, None, 0.0, "float32"), ("gpt", 3, 2, "block", 0.3, "float32"),
    ("gpt", 2, 2, "uniform", 0.0, "bfloat16"), ("llama", 2, 1, None, 0.3, "bfloat16"),
    ("llama", 3, 1, "uniform", 0.3, "float32"), ("llama", 1, 1, None, 0.0, "float32")]


def _block(family: str, n: int, k: int, recompute: str | None, dropout: float, dtype: str):
    preset = "gpt3-6.7b" if family == "gpt" else "llama2-7b"
    config = ModelConfig.preset(preset, num_layers=3, hidden_size=32, num_attention_heads=4,
                                ffn_hidden_size=64, seq_length=8, max_position_embeddings=8,
                                hidden_dropout=dropout, attention_dropout=dropout,
                                params_dtype=dtype)
    fields = dict(domino=DominoPlan(n, k, explicit_backward=True))
    if recompute:
        fields.update(recompute_granularity="full", recompute_method=recompute,
                      recompute_num_layers=1)
    dims = ParallelDims(tp=1)
    model_parallel_seed(3, dims)
    block = TransformerBlock(config, dims, ParallelConfig(**fields))
    rotary = None
    if config.position_embedding_type == "rope":
        cos, sin = rotary_tables(8, config.kv_channels, config.rotary_base)
        rotary = (cos[:, None, None, :], sin[:, None, None, :])
    return block, DominoRunner(block, block.parallel.domino), rotary, dims


def _run(case, steps: int = 2) -> list[torch.Tensor]:
    """Outputs of `steps` forward + backward passes (gradients accumulating), then every
    gradient."""
    block, runner, rotary, dims = _block(*case)
    dtype = next(block.parameters()).dtype
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 5, 32, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(8, 5, 32, generator=gen).to(dtype)
    model_parallel_seed(11, dims)
    results = []
    for _ in range(steps):
        out = runner(x, rotary)
        out.backward(grad_out)
        results.append(out.detach())
    return results + [x.grad] + [p.grad for p in block.layers.parameters()]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_linked_units_change_no_bit(case, monkeypatch):
    linked = _run(case)
    monkeypatch.setattr(DominoRunner, "links", lambda self: False)
    unlinked = _run(case)
    assert len(linked) == len(unlinked)
    for n, (a, b) in enumerate(zip(linked, unlinked)):
        assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit()), n


def test_two_grad_calls_per_layer_and_slice(monkeypatch):
    calls = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: (calls.append(1), grad(*a, **k))[1])
    _run(("gpt", 2, 1, None, 0.0, "float32"), steps=1)
    assert len(calls) == 2 * 3 * 2 + 2


def test_every_parameter_accumulates_once_per_backward():
    block, runner, rotary, _ = _block("llama", 3, 2, "block", 0.0, "float32")
    fired: dict[str, int] = {}
    for name, param in block.layers.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: fired.__setitem__(name, fired.get(name, 0) + 1))
    x = torch.randn(8, 5, 32).requires_grad_()
    runner(x, rotary).sum().backward()
    assert fired == {name: 1 for name, _ in block.layers.named_parameters()}


@pytest.mark.parametrize("dtype, slices, chunked", itertools.product(
    (torch.float32, torch.bfloat16), (1, 2, 3), (False, True)))
def test_sink_sum_is_the_fp32_sum_rounded_once(dtype, slices, chunked):
    param = torch.nn.Parameter(torch.zeros(6, 4, dtype=dtype))
    gen = torch.Generator().manual_seed(slices)
    parts = [torch.randn(6, 4, generator=gen).to(dtype) for _ in range(slices)]
    sink = WgradSink(slices > 1)
    anchor = sink.anchor([param])
    for part in parts:
        if chunked:  # two hidden chunks of 3 rows each
            sink.add(param, part[:3], 0, 0)
            sink.add(param, part[3:], 0, 3)
        else:
            sink.add(param, part)
    sink.flush(anchor)
    expected = torch.zeros(6, 4, dtype=torch.float32)
    for part in parts:
        expected += part
    assert torch.equal(param.grad, expected.to(dtype))
