"""The model is a stage: the whole model is a one-stage plan's stage's one chunk (build_model of
build_stage); a GPTModel part's forward embeds only with `pre_process` and computes the loss only
with `post_process`, so two parts chained through `decoder_input` equal the whole model (loss
and every gradient, fp32, exact: the same operations); every part names its parameters as the
whole model does (`checkpoint_parameters`), with the whole model's initial values. GPT (tied
embedding) and Llama; one process, TP=1 (a gloo world of one)."""

from __future__ import annotations

import pytest
import torch

from megadomino.build import build_model, build_stage
from megadomino.config import ModelConfig
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.distributed import ParallelDims
from megadomino.models import FAMILIES, StageChunks

pytestmark = pytest.mark.usefixtures("single_process_group")

SPLIT = 2
"""The first part holds layers [0, SPLIT), the second [SPLIT, num_layers)."""


def _config(family: str) -> ModelConfig:
    preset = "gpt-tiny" if family == "gpt" else "llama-tiny"
    return ModelConfig.preset(preset, hidden_dropout=0.0, attention_dropout=0.0, seq_length=8,
                              max_position_embeddings=8, num_layers=3, vocab_size=67)


def _parts(config: ModelConfig, family: str, dims) -> list:
    parts = []
    for pre, post, layers in ((True, False, (0, SPLIT)),
                              (False, True, (SPLIT, config.num_layers))):
        torch.manual_seed(5)
        parts.append(FAMILIES[family](config, dims, "cpu", layer_range=layers,
                                      pre_process=pre, post_process=post))
    return parts


def _same(named, others) -> bool:
    """The same names in the same order, each naming the same parameter object."""
    named, others = list(named), list(others)
    return (len(named) == len(others)
            and all(n == m and p is q for (n, p), (m, q) in zip(named, others)))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_chained_parts_equal_the_whole_model(family):
    config, dims = _config(family), ParallelDims(tp=1)
    torch.manual_seed(5)
    whole = build_model(config, dims, family, device="cpu")
    first, last = _parts(config, family, dims)
    held = dict(first.checkpoint_parameters()) | dict(last.checkpoint_parameters())
    reference = dict(whole.checkpoint_parameters())
    assert _same(whole.checkpoint_parameters(), whole.named_parameters())
    assert set(held) == set(reference)
    for name, param in held.items():
        assert torch.equal(param, reference[name]), name

    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    expected = whole(inputs, labels)
    hidden = first(inputs)
    assert hidden.shape == (inputs.shape[1], inputs.shape[0], config.hidden_size)
    received = hidden.detach().requires_grad_(True)
    loss = last(inputs, labels, decoder_input=received)
    assert torch.equal(loss, expected)
    expected.sum().backward()
    loss.sum().backward()
    hidden.backward(received.grad)
    grads = {name: param.grad for name, param in whole.named_parameters()}
    for part in (first, last):
        for name, param in part.checkpoint_parameters():
            if name == "word_embeddings.weight" and family == "gpt":
                continue  # tied: the whole model's gradient is the two copies' sum
            assert torch.equal(param.grad, grads[name]), name
    tied = first.word_embeddings.weight.grad
    if family == "gpt":
        tied = tied + last.word_embeddings.weight.grad
    torch.testing.assert_close(tied, grads["word_embeddings.weight"], rtol=1e-6, atol=1e-7)


def test_the_whole_model_is_a_one_stage_plans_stage():
    config, dims = _config("gpt"), ParallelDims(tp=1)
    torch.manual_seed(5)
    whole = build_model(config, dims, "gpt", device="cpu")
    torch.manual_seed(5)
    stage = build_stage(config, dims, uniform_plan(config.num_layers, 1, 1, 1), "gpt", "cpu")
    assert isinstance(stage, StageChunks) and len(stage) == 1
    assert stage.stage.layers == ((0, config.num_layers),)
    assert stage[0].pre_process and stage[0].post_process
    assert _same(stage.checkpoint_parameters(), stage[0].named_parameters())
    for (name, param), (other, reference) in zip(stage.checkpoint_parameters(),
                                                 whole.named_parameters(), strict=True):
        assert name == other and torch.equal(param, reference), name
