"""benchmarks/peers.py builds the peers' layers so that they compute our layer's math: at TP=2 on
CPU (fp32, gloo), with our layer's local weight shards copied in, megatron-core's block (GPT and
Llama with GQA and RoPE) and DeepSpeed's Domino layer (GPT) match our TransformerLayer stack's
output and input gradient: the peers tier, skipped where the packages are not installed."""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest
import torch
from test_tp_equivalence import tiny_config

from dist_utils import C, DistSuite, assert_close
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.models.blocks import rotary_tables
from megadomino.models.transformer import TransformerLayer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from peers import LayerShape, build_deepspeed_domino, build_megatron_block  # noqa: E402

TP = 2
REL = 1e-5
NUM_LAYERS = 2
MICRO_BATCH = 4


def ours_and_input(family: str, dims):
    """Our layer stack at this rank's TP shard, its shape as a LayerShape, an input (the same on
    every rank) and rotary tables (None for GPT)."""
    config = tiny_config(family, num_layers=NUM_LAYERS)
    model_parallel_seed(1234, dims)
    layers = torch.nn.ModuleList(TransformerLayer(config, dims) for _ in range(NUM_LAYERS))
    shape = LayerShape(f"{family}-tiny", family, config.hidden_size, config.num_attention_heads,
                       config.num_query_groups, config.ffn_hidden_size, config.seq_length,
                       MICRO_BATCH)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape.seq, MICRO_BATCH, shape.hidden, generator=gen)
    rotary = None
    if family == "llama":
        cos, sin = rotary_tables(shape.seq, shape.head_dim, config.rotary_base)
        # (s, d) -> (s, 1, 1, d)
        rotary = cos[:, None, None, :], sin[:, None, None, :]
    return layers, shape, x, rotary


def output_and_input_grad(forward, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = forward(x)
    # A fixed, non-uniform upstream gradient: every output element matters.
    weights = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), x.grad


def check_against_ours(family: str, peer: str, dims) -> None:
    layers, shape, x, rotary = ours_and_input(family, dims)

    def ours(x):
        for layer in layers:
            x = layer(x, rotary)
        return x

    if peer == "megatron":
        # megatron-core 0.16.1's RoPE moves its table to torch.cuda.current_device() when built.
        with mock.patch("torch.cuda.current_device", return_value="cpu"):
            module, forward = build_megatron_block(shape, TP, NUM_LAYERS, torch.float32,
                                                   device=torch.device("cpu"))
        # Same parameter names and the same local layouts (QKV per query group, [gate; up]).
        ours_state = {f"layers.{name}": value for name, value in layers.state_dict().items()}
        result = module.load_state_dict(ours_state, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
    else:
        module, forward = build_deepspeed_domino(shape, TP, NUM_LAYERS, torch.float32,
                                                 tp_group=dims.tp_group)
        with torch.no_grad():
            for theirs, mine in zip(module.layers, layers):
                pairs = [(theirs.input_layernorm, mine.input_layernorm),
                         (theirs.self_attention.query_key_value, mine.self_attention.linear_qkv),
                         (theirs.self_attention.dense, mine.self_attention.linear_proj),
                         (theirs.post_attention_layernorm, mine.pre_mlp_layernorm),
                         (theirs.linear_fc1, mine.mlp.linear_fc1),
                         (theirs.linear_fc2, mine.mlp.linear_fc2)]
                for dst, src in pairs:
                    dst.weight.copy_(src.weight)
                    dst.bias.copy_(src.bias)
                # Its GELU is the exact (erf) one; ours is tanh. Same everything else.
                theirs.mlp_activation_func = mine.mlp.activation
    assert module is not None, forward
    expected_out, expected_grad = output_and_input_grad(ours, x)
    out, grad = output_and_input_grad(forward, x)
    assert_close(out, expected_out, REL, f"{peer} {family} output")
    assert_close(grad, expected_grad, REL, f"{peer} {family} input gradient")


SUITE = DistSuite(worlds=(TP,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"dims": ParallelDims(tp=TP)}


for family in ("gpt", "llama"):
    SUITE.case(f"megatron-{family}", check_against_ours, family, "megatron", C.dims,
               requires="megatron")
SUITE.case("deepspeed-gpt", check_against_ours, "gpt", "deepspeed", C.dims, requires="deepspeed")

test_peers_match_ours = SUITE.test(marks=(pytest.mark.peers,))


@pytest.mark.parametrize("shape", [LayerShape("llama", "llama", 64, 8, 4, 160, 16, 4),
                                   LayerShape("odd-batch", "gpt", 64, 4, 4, 256, 16, 3)])
def test_deepspeed_domino_refuses_what_it_lacks(shape):
    module, reason = build_deepspeed_domino(shape, TP, 1)
    assert module is None and "Domino layer" in reason, reason


def test_layer_shape_refuses_bad_shapes():
    with pytest.raises(ValueError, match="family"):
        LayerShape("x", "bert", 64, 4, 4, 256, 16, 4)
    with pytest.raises(ValueError, match="divide"):
        LayerShape("x", "llama", 64, 8, 3, 160, 16, 4)
    assert LayerShape("x", "gpt", 4096, 32, 32, 16384, 2048, 4).head_dim == 128
