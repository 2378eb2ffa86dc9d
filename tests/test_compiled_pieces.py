"""--compile-layer-pieces: each element-wise piece of the layers compiled by torch.compile equals
the eager piece (fp32, 1e-5 relative: the compiled kernels may reassociate), forward and every
gradient, under every execution of the layer stack on CPU (plain, full recompute, Domino sliced
and unsliced), GPT and Llama, a vocabulary that pads; and a training run with evaluation
compiles everything in its first training and first evaluation steps, never after (dynamo's
counters). One process, TP=1 (a gloo world of one). CUDA-graphed and bf16 execution:
tests/gpu/test_gpu_compiled_pieces.py."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from configs import EXECUTIONS, make_config, parallel_config
from dist_utils import assert_close
from megadomino.build import build_model
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.models import elementwise
from megadomino.train.loop import train

pytestmark = pytest.mark.usefixtures("single_process_group")



def _config(family: str, **overrides) -> ModelConfig:
    preset = "gpt-tiny" if family == "gpt" else "llama-tiny"
    fields = dict(hidden_dropout=0.0, attention_dropout=0.0, seq_length=16,
                  max_position_embeddings=16, num_layers=3, vocab_size=331)
    return ModelConfig.preset(preset, **{**fields, **overrides})


def _run(family: str, execution: str, compiled: bool, full: dict, tokens: torch.Tensor):
    parallel = parallel_config(compile_layer_pieces=compiled, **EXECUTIONS[execution])
    model = build_model(_config(family), ParallelDims(tp=1), family, device="cpu",
                        parallel=parallel)
    model.load_full_state_dict(full)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_compiled_pieces_equal_eager_ones_in_every_execution(family):
    torch.manual_seed(3)
    config = _config(family)
    full = build_model(config, ParallelDims(tp=1), family, device="cpu").full_state_dict()
    # 5 sequences: Domino's two batch slices are uneven (3 + 2)
    tokens = torch.randint(0, config.vocab_size, (5, 17),
                           generator=torch.Generator().manual_seed(5))
    for execution in EXECUTIONS:
        loss, grads = _run(family, execution, False, full, tokens)
        compiled_loss, compiled_grads = _run(family, execution, True, full, tokens)
        assert_close(compiled_loss, loss, 1e-5, f"{execution} loss")
        for name, grad in grads.items():
            assert_close(compiled_grads[name], grad, 1e-5, f"{execution} grad {name}")


def test_compiled_dropout_is_dropout():
    """With p > 0 the compiled residual drops (and rescales) about p of the elements."""
    x, y = torch.zeros(64, 64), torch.ones(64, 64)
    out = elementwise.compiled().bias_dropout_add(x, y, None, 0.25)
    kept = (out != 0).float().mean().item()
    assert 0.65 < kept < 0.85, kept
    assert torch.all((out == 0) | (out == 1 / 0.75))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_loss_is_cross_entropy_of_the_real_columns(dtype):
    """The loss's compiled pieces (tp/cross_entropy.py) give F.cross_entropy of the unpadded
    logits and its gradient, 0 in the padding columns, in the logits' dtype."""
    from megadomino.tp.cross_entropy import vocab_parallel_cross_entropy
    generator = torch.Generator().manual_seed(11)
    vocab, padded = 331, 384
    logits = torch.randn(7, 3, padded, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (7, 3), generator=generator)
    reference = logits.detach().float()[..., :vocab].requires_grad_()
    expected = torch.nn.functional.cross_entropy(reference.view(-1, vocab), labels.view(-1),
                                                 reduction="none").view(7, 3)
    weights = torch.rand(7, 3, generator=generator)
    (expected * weights).sum().backward()
    for compile_pieces in (False, True):
        logits.grad = None
        loss = vocab_parallel_cross_entropy(logits, labels, None, 0, vocab, compile_pieces)
        (loss * weights).sum().backward()
        assert_close(loss, expected.detach(), 1e-5, f"loss compiled={compile_pieces}")
        assert logits.grad.dtype == dtype
        assert torch.all(logits.grad[..., vocab:] == 0)
        assert_close(logits.grad[..., :vocab].float(), reference.grad.to(dtype).float(),
                     1e-5 if dtype == torch.float32 else 1e-2, f"grad compiled={compile_pieces}")


def _train(iters: int) -> tuple[dict, list[str]]:
    # the model and batch shape of the plain execution above: a run after that test finds the
    # pieces' compiled code in inductor's cache (dynamo still traces, and counts, every graph)
    config = make_config(_config("llama"), compile_layer_pieces=True, micro_batch_size=5,
                         global_batch_size=10, train_iters=iters, lr=1e-3, log_interval=50,
                         eval_interval=10, eval_iters=2, mock_data=True)
    lines: list[str] = []
    history = train(config, ParallelDims(tp=1), "llama", log=lines.append)
    return history, lines


def test_a_training_run_compiles_only_in_its_first_steps():
    """The first run (one training step, then evaluation) compiles every piece; a 100-step run of
    the same configuration with evaluation every 10 steps compiles nothing more."""
    torch._dynamo.reset()
    _, lines = _train(iters=1)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0
    assert any("compiled the layer pieces (torch.compile)" in line for line in lines), lines
    assert any("compiled layer pieces" in line for line in lines[:4]), lines[:4]
    history, _ = _train(iters=100)
    assert len(history["eval"]) == 10
    assert counters["stats"]["unique_graphs"] == compiled, "a piece was compiled again"
