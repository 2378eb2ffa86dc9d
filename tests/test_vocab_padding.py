"""The padded vocabulary takes no part: the loss is the cross-entropy of the logits the model
returns, at every TP degree and for vocabularies that pad differently per degree (GPT-2's 50257,
Llama's 32000, 320); padding rows get no gradient and stay zero through training; checkpoints
whose padding rows were trained load with those rows zeroed and a notice."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from configs import make_config
from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_model
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint import (
    TrainingState,
    load_checkpoint,
    load_optimizer_state,
    save_checkpoint,
)
from megadomino.train.loop import train
from megadomino.train.pad_rows import first_pad_row
from megadomino.zero import ZeroConfig, ZeroPlusPlus
from megadomino.zero.optimizer import build_engine

VOCABS = (50257, 32000, 320)
REL = 1e-6


def tiny(vocab: int, **overrides) -> ModelConfig:
    """A model small enough that GPT-2's vocabulary is the bulk of it; 8 heads for TP up to 8."""
    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=8, seq_length=6,
                  max_position_embeddings=6, vocab_size=vocab, make_vocab_size_divisible_by=128,
                  hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5)
    return ModelConfig(**{**fields, **overrides})


def pad_rows(weight: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """This rank's padding rows of a vocabulary-sharded weight (or of its gradient / moment)."""
    return weight[first_pad_row(weight, weight.shape[0], dims.tp_rank):]


def pad_rows_of(tensor: torch.Tensor, param: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    return tensor[first_pad_row(param, param.shape[0], dims.tp_rank):]


def check_loss_is_cross_entropy_of_logits(vocab: int, tp: ParallelDims,
                                          dense: ParallelDims) -> None:
    """model(tokens, labels) == F.cross_entropy(model(tokens)) per token, and == the TP=1
    model's loss from the same weights; the padding rows' gradient is exactly zero."""
    config = tiny(vocab)
    torch.manual_seed(0)
    model = build_model(config, tp)
    reference = build_model(config, dense)
    reference.load_full_state_dict(model.full_state_dict())
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (3, config.seq_length), generator=generator)
    labels = torch.randint(0, vocab, (3, config.seq_length), generator=generator)
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (3, config.seq_length, vocab)
    expected = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1),
                               reduction="none").view_as(labels)
    loss = model(tokens, labels=labels)
    assert_close(loss.detach(), expected, REL, f"loss vs cross-entropy of the logits, V={vocab}")
    assert_close(loss.detach(), reference(tokens, labels=labels).detach(), REL,
                 f"loss at TP={tp.tp} vs TP=1, V={vocab}")
    loss.sum().backward()
    weight = model.word_embeddings.weight
    first = first_pad_row(weight, weight.shape[0], tp.tp_rank)
    assert first == 0 or weight.grad[:first].count_nonzero(), "no gradient at all"
    padding = weight.grad[first:]
    assert not padding.count_nonzero(), f"padding rows got gradient {padding.abs().max()}"


def check_pad_rows_stay_zero(dims: ParallelDims, untied: bool, zero_stage: int) -> None:
    """Training (AdamW, weight decay, clipping) leaves every padding row exactly zero."""
    config = tiny(320, untie_embeddings_and_output_weights=untied, init_method_std=0.02)
    run = make_config(config, micro_batch_size=2, global_batch_size=2 * dims.dp, train_iters=4,
                      lr=1e-2, weight_decay=0.1, log_interval=2, eval_interval=0, eval_iters=0,
                      mock_data=True, tensor_model_parallel_size=dims.tp, stage=zero_stage)
    history = train(run, dims, "gpt", log=lambda line: None)
    assert all(math.isfinite(loss) for loss in history["losses"])
    model = history["model"]
    for weight in (model.word_embeddings.weight, model.output_weight):
        if weight is not None and weight.numel():
            assert not pad_rows(weight, dims).count_nonzero(), "padding rows moved"


def _step(model, optimizer_step, backward) -> None:
    tokens = torch.arange(12).view(2, 6) % 300
    loss = model(tokens, labels=(tokens + 1) % 300).mean()
    backward(loss)
    optimizer_step()


def check_old_checkpoint_pad_rows(tp: ParallelDims, dense: ParallelDims, root: str) -> None:
    """A checkpoint with trained padding rows (and AdamW moments there) loads with them zeroed,
    at the saved TP degree and at TP=1, and rank 0 says so in one line."""
    config = tiny(320)
    model = build_model(config, tp)
    engine = build_engine(model, tp, make_config(config, lr=1e-2))
    _step(model, engine.step, engine.backward)
    weight = model.word_embeddings.weight
    state = engine.state_by_parameter()[id(weight)]
    with torch.no_grad():
        for tensor in (weight, state["exp_avg"], state["exp_avg_sq"]):
            pad_rows_of(tensor, weight, tp).fill_(0.5)
    save_checkpoint(f"{root}/old", TrainingState(iteration=1), model, engine, tp)
    for dims in (tp, dense):
        fresh = build_model(config, dims)
        lines: list[str] = []
        load_checkpoint(f"{root}/old", fresh, dims, log=lines.append)
        fresh_engine = build_engine(fresh, dims, make_config(config, lr=1e-2))
        load_optimizer_state(f"{root}/old", 1, fresh_engine, dims, log=lines.append)
        loaded = fresh.word_embeddings.weight
        assert not pad_rows(loaded, dims).count_nonzero()
        for moment in fresh_engine.state_by_parameter()[id(loaded)].values():
            if moment.ndim:
                assert not pad_rows_of(moment, loaded, dims).count_nonzero()
        notices = [line for line in lines if "padded vocabulary rows" in line]
        if dist.get_rank() == 0:
            assert len(notices) == 1 and "word_embeddings.weight" in notices[0], lines
        else:
            assert not notices, lines


def check_old_zero_checkpoint_pad_rows(dims: ParallelDims, root: str) -> None:
    """The same for a ZeRO-1 checkpoint, whose fp32 masters (in optim_dp_rank files) hold
    trained padding rows: the model that resumes from it has zero padding rows."""
    config = tiny(320)
    factory = functools.partial(torch.optim.AdamW, lr=1e-2)

    def engine_of(model):
        return ZeroPlusPlus(model, dims, factory, ZeroConfig(stage=1))

    model = build_model(config, dims)
    with torch.no_grad():
        pad_rows(model.word_embeddings.weight, dims).fill_(0.5)
    engine = engine_of(model)
    _step(model, engine.step, engine.backward)
    save_checkpoint(f"{root}/old-zero", TrainingState(iteration=1), model, engine, dims)
    fresh = build_model(config, dims)
    lines: list[str] = []
    state = load_checkpoint(f"{root}/old-zero", fresh, dims, log=lines.append)
    fresh_engine = engine_of(fresh)
    load_optimizer_state(f"{root}/old-zero", state.iteration, fresh_engine, dims,
                         log=lines.append)
    assert not pad_rows(fresh.word_embeddings.weight, dims).count_nonzero()
    if dist.get_rank() == 0:
        assert any("ZeRO optimizer state" in line for line in lines), lines


SUITE = DistSuite(worlds=(2, 4))


@SUITE.setup
def _setup(world: int, root: str = "") -> dict:
    return {"tp": ParallelDims(tp=world), "dense": ParallelDims(tp=1),
            "half": ParallelDims(tp=world // 2), "root": root}


for vocab in VOCABS:
    SUITE.case(f"loss-is-ce-V{vocab}", check_loss_is_cross_entropy_of_logits, vocab, C.tp,
               C.dense)
for untied in (False, True):
    SUITE.case(f"pad-rows-stay-zero-untied{untied}", check_pad_rows_stay_zero, C.tp, untied, 0)
SUITE.case("pad-rows-stay-zero-zero1", check_pad_rows_stay_zero, C.half, False, 1)
SUITE.case("old-checkpoint-pad-rows", check_old_checkpoint_pad_rows, C.tp, C.dense, C.root)
SUITE.case("old-zero-checkpoint-pad-rows", check_old_zero_checkpoint_pad_rows, C.half, C.root)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("vocab_padding")),)


test_vocab_padding = SUITE.test(args_fixture="root")

SUITE_TP8 = DistSuite(worlds=(8,))
SUITE_TP8.setup(_setup)
for vocab in VOCABS:
    SUITE_TP8.case(f"loss-is-ce-V{vocab}", check_loss_is_cross_entropy_of_logits, vocab, C.tp,
                   C.dense)
test_vocab_padding_tp8 = pytest.mark.slow(SUITE_TP8.test())
