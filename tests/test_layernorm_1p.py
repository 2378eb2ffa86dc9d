"""--apply-layernorm-1p: norms whose weight holds gamma - 1 are the plain norms with gamma = weight
+ 1 (LayerNorm for GPT, RMSNorm for Llama; forward and gradients, fp32), start as gamma = 1, keep
gamma - 1 in their state dicts (as Megatron-LM does), and a Hugging Face export writes gamma:
the exported directory loads into a plain model with the same logits."""

from __future__ import annotations

import pytest
import torch

from dist_utils import assert_close
from megadomino.build import build_model
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.interop.hf import load_llama, save_llama

pytestmark = pytest.mark.usefixtures("single_process_group")


def _models(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(a zero-centred model, the plain model with the same weights, norms' gamma = weight + 1)."""
    config = ModelConfig.preset(f"{family}-tiny", seq_length=16, vocab_size=301,
                                hidden_dropout=0.0, attention_dropout=0.0)
    dims = ParallelDims(tp=1)
    torch.manual_seed(3)
    one_p = build_model(config.replace(apply_layernorm_1p=True), dims, family, device="cpu")
    plain = build_model(config, dims, family, device="cpu")
    state = one_p.full_state_dict()
    norms = [name for name in state if name.endswith("layernorm.weight")]
    assert norms and all(torch.equal(state[n], torch.zeros_like(state[n])) for n in norms)
    with torch.no_grad():
        for name in norms:  # away from the initial gamma = 1, so that the offset shows
            state[name].normal_(0.0, 0.3)
    one_p.load_full_state_dict(state)
    plain.load_full_state_dict({name: value + 1 if name in norms else value
                                for name, value in state.items()})
    return one_p, plain


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_zero_centred_norms_are_plain_norms_of_weight_plus_one(family):
    one_p, plain = _models(family)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 301, (3, 16), generator=gen)
    labels = torch.randint(0, 301, (3, 16), generator=gen)
    losses = []
    for model in (one_p, plain):
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        losses.append(loss)
    assert_close(losses[0], losses[1], 1e-5, "loss")
    grads, plain_grads = one_p.full_grad_dict(), plain.full_grad_dict()
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, plain_grads[name], 1e-5, f"gradient of {name}")


def test_hf_export_writes_gamma(tmp_path):
    one_p, plain = _models("llama")
    save_llama(one_p, str(tmp_path))
    reloaded = load_llama(str(tmp_path), ParallelDims(tp=1), device="cpu", seq_length=16,
                          hidden_dropout=0.0, attention_dropout=0.0)
    again = load_llama(str(tmp_path), ParallelDims(tp=1), device="cpu", seq_length=16,
                       hidden_dropout=0.0, attention_dropout=0.0, apply_layernorm_1p=True)
    tokens = torch.randint(0, 301, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = plain(tokens)
        assert_close(reloaded(tokens), want, 1e-5, "logits of the exported model")
        assert_close(again(tokens), want, 1e-5, "logits of the export loaded zero-centred")
    weights = again.full_state_dict()
    for name, value in one_p.full_state_dict().items():
        assert_close(weights[name], value, 1e-6, name)
