"""Checkpoints: exact resume at TP=2, at DP=2 (bf16, stopped by SIGTERM) and with the cyclic
data loader, loading at TP=1 what TP=2 saved, a crash during a save, missing / truncated shards
and config mismatches, --finetune / --no-load-optim / --no-load-rng, --exit-duration-in-mins,
the NaN stop. All in one 2-rank spawn."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from configs import make_config, with_leaves
from dist_utils import C, DistSuite, shared_copy
from megadomino.build import build_model
from megadomino.config import Config, ModelConfig
from megadomino.data.mock import MockDataset
from megadomino.distributed import ParallelDims
from megadomino.train import checkpoint
from megadomino.train.checkpoint import (
    CheckpointError,
    TrainingState,
    latest_iteration,
    load_checkpoint,
    load_optimizer_state,
    save_checkpoint,
)
from megadomino.train.loop import train
from megadomino.train.report import NonFiniteLossError
from megadomino.zero.optimizer import build_engine

MODEL = ModelConfig.preset("gpt-tiny", seq_length=32)  # dropout 0.1: resume must restore RNGs
TRAIN = make_config(MODEL, micro_batch_size=2, global_batch_size=4, train_iters=20, lr=5e-3,
                    lr_warmup_iters=2, log_interval=5, eval_interval=10, eval_iters=1,
                    mock_data=True)


def _train(dims: ParallelDims, model_config: ModelConfig = MODEL, log=None, model_init=None,
           train_data=None, **overrides) -> dict:
    config = with_leaves(dataclasses.replace(TRAIN, model=model_config),
                         tensor_model_parallel_size=dims.tp, **overrides)
    return train(config, dims, "gpt", log=log or (lambda line: None), model_init=model_init,
                 train_data=train_data)


def _case_resume_tp2(dims: ParallelDims, root: str) -> None:
    """20 iterations straight == 10 (stopped by --exit-interval, saved) + resume + 10, exactly;
    without the RNG states (dropout) the resumed losses differ, so the test can tell."""
    straight = _train(dims)
    first = _train(dims, save=f"{root}/tp2", exit_interval=10)
    assert first["exit_reason"].startswith("--exit-interval=10") and latest_iteration(
        f"{root}/tp2") == 10
    resumed = _train(dims, load=f"{root}/tp2")
    assert first["losses"] + resumed["losses"] == straight["losses"]
    assert [e["loss"] for e in first["eval"] + resumed["eval"]] == [
        e["loss"] for e in straight["eval"]]
    fresh_rng = _train(dims, load=f"{root}/tp2", no_load_rng=True, exit_interval=12)
    assert fresh_rng["losses"] != straight["losses"][10:12]


def _case_resume_dp2_sigterm(dims: ParallelDims, root: str) -> None:
    """bf16 at DP=2: SIGTERM to rank 0 at the iteration-10 log line stops both ranks with a
    checkpoint (--exit-signal-handler); resuming reproduces the straight run exactly."""
    straight = _train(dims, bf16=True)

    def log(line: str) -> None:
        if "iteration       10/" in line:
            os.kill(os.getpid(), signal.SIGTERM)

    handler = signal.getsignal(signal.SIGTERM)
    first = _train(dims, log=log, bf16=True, save=f"{root}/dp2", exit_signal_handler=True)
    stopped = first["state"].iteration
    assert first["exit_reason"].startswith("SIGTERM") and 10 <= stopped < 20, first["exit_reason"]
    assert latest_iteration(f"{root}/dp2") == stopped
    assert signal.getsignal(signal.SIGTERM) == handler
    resumed = _train(dims, bf16=True, load=f"{root}/dp2")
    assert first["losses"] + resumed["losses"] == straight["losses"]


def _case_resume_cyclic(dims: ParallelDims, root: str) -> None:
    """--dataloader-type cyclic at DP=2 over 26 samples, fewer than the run's 80: epochs of 24
    wrap three times and iteration 10 (40 samples) ends mid-epoch. With and without data
    sharding, 20 iterations straight == 10 (stopped, saved) + resume + 10, exactly; the two
    orders differ from each other and from the single loader's."""
    samples = [MockDataset(MODEL.seq_length, MODEL.vocab_size, seed=7)[i] for i in range(26)]
    first_losses = [_train(dims, train_data=samples, exit_interval=2)["losses"]]
    for sharding in (True, False):
        cyclic = dict(train_data=samples, dataloader_type="cyclic", data_sharding=sharding)
        straight = _train(dims, **cyclic)
        first = _train(dims, save=f"{root}/cyclic{sharding}", exit_interval=10, **cyclic)
        resumed = _train(dims, load=f"{root}/cyclic{sharding}", **cyclic)
        assert first["losses"] + resumed["losses"] == straight["losses"]
        first_losses.append(straight["losses"][:2])
    assert len({tuple(losses) for losses in first_losses}) == 3, first_losses


def _case_tp2_to_tp1(tp2: ParallelDims, tp1: ParallelDims, root: str) -> None:
    """The TP=2 checkpoint loaded at TP=1 x DP=2 (model and optimizer re-sharded) trains on with
    the losses of the TP=2 run loading it; without its optimizer state they differ."""
    quiet = MODEL.replace(hidden_dropout=0.0, attention_dropout=0.0)
    runs = [_train(dims, quiet, load=f"{root}/tp2", exit_interval=13, **extra)["losses"]
            for dims, extra in ((tp2, {}), (tp1, {}), (tp1, {"no_load_optim": True}))]
    torch.testing.assert_close(torch.tensor(runs[1]), torch.tensor(runs[0]), rtol=1e-5, atol=0)
    assert abs(runs[2][-1] - runs[0][-1]) > 1e-3, runs


def _fresh(dims: ParallelDims, model_config: ModelConfig = MODEL):
    model = build_model(model_config, dims, "gpt")
    return model, build_engine(model, dims, TRAIN)


def _case_crash_during_save(dims: ParallelDims, root: str) -> None:
    """A save that dies before the iteration file is replaced, or while a shard is half written,
    leaves the previous checkpoint the one that loads."""
    directory = shared_copy(f"{root}/tp2", f"{root}/crash")
    model, optimizer = _fresh(dims)
    real_replace, real_save = os.replace, torch.save

    def die_before_tracker(src, dst):
        if Path(dst).name == checkpoint.TRACKER:
            raise OSError("killed")
        real_replace(src, dst)

    def die_half_written(obj, file):
        real_save(obj, file)
        file.truncate(file.tell() // 2)
        raise OSError("killed")

    for target, name, iteration in ((os, "replace", 20), (torch, "save", 30)):
        setattr(target, name, die_before_tracker if name == "replace" else die_half_written)
        try:
            with pytest.raises(CheckpointError, match="killed"):
                save_checkpoint(directory, TrainingState(iteration=iteration), model, optimizer,
                                dims)
        finally:
            os.replace, torch.save = real_replace, real_save
        assert latest_iteration(directory) == 10
        state = load_checkpoint(directory, model, dims)
        assert state.iteration == 10
    shard = Path(directory) / "iter_0000030" / f"mp_rank_{dims.tp_rank:02d}" / checkpoint.SHARD
    assert not shard.exists() and shard.with_name(shard.name + ".tmp").exists()


def _case_bad_checkpoints(dims: ParallelDims, root: str) -> None:
    """A missing or truncated shard, a different architecture, or a missing optimizer state is a
    CheckpointError on every rank naming the file or field."""
    model, optimizer = _fresh(dims)
    shard = "iter_0000010/mp_rank_01/model_optim_rng.pt"
    missing = shared_copy(f"{root}/tp2", f"{root}/missing")
    truncated = shared_copy(f"{root}/tp2", f"{root}/truncated")
    if dist.get_rank() == 0:
        os.remove(f"{missing}/{shard}")
        with open(f"{truncated}/{shard}", "r+b") as file:
            file.truncate(os.path.getsize(f"{truncated}/{shard}") // 2)
    dist.barrier()
    with pytest.raises(CheckpointError, match=f"shard missing: .*{shard}"):
        load_checkpoint(missing, model, dims)
    with pytest.raises(CheckpointError, match=f"{shard} is unreadable"):
        load_checkpoint(truncated, model, dims)
    wide, _ = _fresh(dims, MODEL.replace(hidden_size=128))
    with pytest.raises(CheckpointError, match="hidden_size=64 differs from this run's 128"):
        load_checkpoint(f"{root}/tp2", wide, dims)
    other_vocab, _ = _fresh(dims, MODEL.replace(vocab_size=MODEL.vocab_size + 3))
    with pytest.raises(CheckpointError, match="vocab_size=.* the tokenizer's vocabulary: was the "
                                              "checkpoint trained with another tokenizer"):
        load_checkpoint(f"{root}/tp2", other_vocab, dims)
    save_checkpoint(f"{root}/no_optim", TrainingState(iteration=3), model, None, dims)
    with pytest.raises(CheckpointError, match="no optimizer state .* --no-load-optim"):
        load_optimizer_state(f"{root}/no_optim", 3, optimizer, dims)
    assert load_checkpoint(f"{root}/no_optim", model, dims).iteration == 3
    sgd = build_engine(build_model(MODEL, dims, "gpt"), dims, with_leaves(TRAIN, optimizer="sgd"))
    with pytest.raises(CheckpointError, match="holds AdamW state, this run's optimizer is SGD"):
        load_optimizer_state(f"{root}/tp2", 10, sgd, dims)


def _case_load_semantics(dims: ParallelDims, root: str) -> None:
    """--finetune: weights only, iteration 0; without load_optimizer_state (--no-load-optim) the
    engine built on the loaded model starts fresh; a full load sets every generator to the saved
    states, and load_optimizer_state the engine's AdamW state."""
    saved = torch.load(f"{root}/tp2/iter_0000010/mp_rank_{dims.tp_rank:02d}/{checkpoint.SHARD}",
                       weights_only=True)
    reference = build_model(MODEL, dims, "gpt")
    assert load_checkpoint(f"{root}/tp2", reference, dims).iteration == 10
    assert torch.equal(torch.get_rng_state(), saved["rng"][0]["torch"])
    reference_engine = build_engine(reference, dims, TRAIN)
    assert not reference_engine.optimizer.optimizer.state
    load_optimizer_state(f"{root}/tp2", 10, reference_engine, dims)
    assert reference_engine.optimizer.optimizer.state
    for kwargs, iteration in (({"finetune": True}, 0), ({}, 10)):
        torch.manual_seed(99)
        model = build_model(MODEL, dims, "gpt")
        state = load_checkpoint(f"{root}/tp2", model, dims, **kwargs)
        engine = build_engine(model, dims, TRAIN)
        assert state.iteration == iteration and not engine.optimizer.optimizer.state
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(param, expected), name
        rng_loaded = torch.equal(torch.get_rng_state(), saved["rng"][0]["torch"])
        assert rng_loaded == (iteration == 10), kwargs


def _case_exit_duration_and_missing_load(dims: ParallelDims, root: str) -> None:
    run = _train(dims, save=f"{root}/duration", exit_duration_in_mins=0.0,
                 load=f"{root}/empty")
    assert run["exit_reason"].startswith("--exit-duration-in-mins=0.0") and len(run["losses"]) == 1
    assert latest_iteration(f"{root}/duration") == 1
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint"):
        _train(dims, load=f"{root}/empty", exit_on_missing_checkpoint=True)


def _case_nan_stops(dims: ParallelDims, root: str) -> None:
    """A NaN loss stops the run on every rank before any checkpoint is written."""
    def poisoned(config: Config, model_dims: ParallelDims):
        model = build_model(config.model, model_dims, "gpt")
        with torch.no_grad():
            model.decoder.final_layernorm.weight.fill_(float("nan"))
        return model

    with pytest.raises(NonFiniteLossError, match="the loss is nan at iteration 1"):
        _train(dims, model_init=poisoned, save=f"{root}/nan", save_interval=1, log_interval=10)
    assert latest_iteration(f"{root}/nan") is None


def _case_skipped_step_holds_the_schedule(dims: ParallelDims, root: str) -> None:
    """An inf gradient on one rank at iteration 3 skips that step on both ranks; the LR schedule
    does not advance for it, although the loop reads a step's skip only once the next step's
    passes are enqueued: the LRs are the clean run's, held for one iteration, and the saved
    state counts 5 steps of 6 iterations."""
    def poisoned(config: Config, model_dims: ParallelDims):
        model = build_model(config.model, model_dims, "gpt")
        calls = []

        def hook(grad):
            calls.append(1)
            return grad * math.inf if len(calls) == 3 and dims.rank == 1 else grad
        model.word_embeddings.weight.register_hook(hook)
        return model

    common = dict(train_iters=6, lr_warmup_iters=0, lr_decay_style="linear", log_interval=2,
                  eval_interval=100)
    clean = _train(dims, **common)
    run = _train(dims, model_init=poisoned, save=f"{root}/skip", save_interval=6, **common)
    assert run["skipped_iterations"] == 1 and clean["skipped_iterations"] == 0
    assert math.isnan(run["grad_norms"][2]) and not math.isnan(run["grad_norms"][3])
    assert run["lrs"][:3] == clean["lrs"][:3] and run["lrs"][3:] == clean["lrs"][2:5]
    state = run["state"]
    assert (state.iteration, state.scheduler_steps, state.scheduler_samples) == (6, 5, 20)


SUITE = DistSuite(worlds=(2,))


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("checkpoints")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"tp2": ParallelDims(tp=2), "dp2": ParallelDims(tp=1), "root": root}


SUITE.case("resume_tp2", _case_resume_tp2, C.tp2, C.root)
SUITE.case("resume_dp2_sigterm", _case_resume_dp2_sigterm, C.dp2, C.root)
SUITE.case("resume_cyclic", _case_resume_cyclic, C.dp2, C.root)
SUITE.case("tp2_to_tp1", _case_tp2_to_tp1, C.tp2, C.dp2, C.root)
SUITE.case("crash_during_save", _case_crash_during_save, C.tp2, C.root)
SUITE.case("bad_checkpoints", _case_bad_checkpoints, C.tp2, C.root)
SUITE.case("load_semantics", _case_load_semantics, C.tp2, C.root)
SUITE.case("exit_duration_and_missing_load", _case_exit_duration_and_missing_load, C.dp2, C.root)
SUITE.case("nan_stops", _case_nan_stops, C.dp2, C.root)
SUITE.case("skipped_step_holds_the_schedule", _case_skipped_step_holds_the_schedule, C.dp2,
           C.root)

test_checkpoint = SUITE.test(args_fixture="checkpoint_root")
