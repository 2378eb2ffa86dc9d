"""The layer's math exists once: every execution of the layer stack (plain, full recompute,
Domino's schedule sliced and unsliced) drives the same pieces of TransformerLayer (its norms,
the attention core, the MLP activation, the residual add), so replacing one piece changes all of
them identically. One process, TP=1 (gloo world of one), fp32, dropout 0; GPT and Llama.
(CUDA-graphed execution replays the plain layers: tests/gpu/test_gpu_cuda_graph.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from configs import EXECUTIONS, parallel_config
from dist_utils import assert_close
from megadomino.build import build_model
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.overlap.domino.schedule import DominoRunner
from megadomino.overlap.recompute import FullRecompute

pytestmark = pytest.mark.usefixtures("single_process_group")

RUNNERS = {"plain": type(None), "recompute": FullRecompute, "domino 2x2": DominoRunner,
           "domino unsliced": DominoRunner}


class _Scaled(nn.Module):
    def __init__(self, inner: nn.Module, factor: float):
        super().__init__()
        self.inner, self.factor = inner, factor

    def forward(self, x):
        return self.factor * self.inner(x)


def _replace(model, piece: str) -> None:
    """Change `piece` in every layer of `model` (a different function of the same inputs)."""
    for layer in model.decoder.layers:
        if piece in ("input_layernorm", "pre_mlp_layernorm"):
            setattr(layer, piece, _Scaled(getattr(layer, piece), 1.5))
        elif piece == "attention core":
            core = layer.self_attention.core
            layer.self_attention.core = lambda q, k, v, core=core: 1.5 * core(q, k, v)
        elif piece == "activation":
            act = layer.mlp.activation
            layer.mlp.activation = lambda h, up=None, bias=None, act=act: 1.5 * act(h, up, bias)
        elif piece == "residual":
            residual = layer.residual
            layer.residual = lambda x, y, bias=None, residual=residual: residual(
                x, 0.5 * y, None if bias is None else 0.5 * bias)
        else:
            raise ValueError(piece)


PIECES = ["input_layernorm", "attention core", "pre_mlp_layernorm", "activation", "residual"]



def _config(family: str) -> ModelConfig:
    preset = "gpt-tiny" if family == "gpt" else "llama-tiny"
    return ModelConfig.preset(preset, hidden_dropout=0.0, attention_dropout=0.0, seq_length=16,
                              max_position_embeddings=16, num_layers=3)


def _run(family: str, execution: str, piece: str | None, full: dict, tokens: torch.Tensor):
    model = build_model(_config(family), ParallelDims(tp=1), family, device="cpu",
                        parallel=parallel_config(**EXECUTIONS[execution]))
    assert isinstance(model.decoder.runner, RUNNERS[execution])
    model.load_full_state_dict(full)
    if piece is not None:
        _replace(model, piece)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("piece", PIECES)
def test_replacing_a_piece_changes_every_execution_alike(family, piece):
    torch.manual_seed(3)
    config = _config(family)
    full = build_model(config, ParallelDims(tp=1), family, device="cpu").full_state_dict()
    tokens = torch.randint(0, config.vocab_size, (4, 17),
                           generator=torch.Generator().manual_seed(5))
    results = {name: _run(family, name, piece, full, tokens) for name in EXECUTIONS}
    unchanged = _run(family, "plain", None, full, tokens)
    loss, grads = results["plain"]
    assert abs(loss - unchanged[0]) > 1e-4, "the replacement changed nothing: the test is blind"
    for name, (other_loss, other_grads) in results.items():
        assert_close(other_loss, loss, 1e-5, f"{name} loss with {piece} replaced")
        for param, grad in grads.items():
            assert_close(other_grads[param], grad, 1e-5, f"{name} grad {param}, {piece}")
