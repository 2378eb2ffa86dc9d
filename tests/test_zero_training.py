"""ZeRO in the training loop: `train` with the configs pretrain_gpt.py parses from its flags, on
gloo ranks, one spawn per world size.

2 ranks (DP=2): stage 1 and stage 3 repeat plain DP's losses (1e-5 relative, fp32, dropout on,
two micro-batches per step); fp16 at stage 3 trains with its loss scaler; checkpoints hold the
whole weights for model-only loads, and a missing optimizer shard or a ZeRO / plain mismatch is an
error naming the file or the flag. 4 ranks: the same equivalence at TP=2 x DP=2 (sequence
parallel; stage 1 with Domino too), full ZeRO++ (qwZ + hpZ + qgZ, blocks of 256) on 2 nodes x 2
trains, and resumes repeat the uninterrupted run exactly: stage 3 + ZeRO++ on 2 nodes x 2, stage
1 in bf16 at TP=2 x DP=2.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from dist_utils import C, DistSuite
from megadomino.build import build_model
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError
from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint import (
    CheckpointError,
    TrainingState,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
    shards,
)
from megadomino.train.loop import train
from megadomino.zero import ZeroPlusPlus

BASE = ["--model-preset", "gpt-tiny", "--seq-length", "32", "--mock-data", "--global-batch-size",
        "8", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters", "2", "--log-interval", "5",
        "--eval-interval", "5", "--eval-iters", "1"]
ZERO_PP = ("--zero-stage", "3", "--zeropp-quantized-weights", "--zeropp-hpz-partition-size", "2",
           "--zeropp-quantized-gradients", "--zeropp-block-size", "256", "--gpus-per-node", "2")


def _train(dims: ParallelDims, *flags: str, iters: int = 10, micro_batch_size: int = 2,
           log=None) -> dict:
    """pretrain_gpt.py's flags (BASE, then `flags`) through parse_args into `train`."""
    argv = [*BASE, "--train-iters", str(iters), "--micro-batch-size", str(micro_batch_size),
            "--tensor-model-parallel-size", str(dims.tp), *flags]
    config, _ = parse_args(argv, "gpt")
    return train(config, dims, "gpt", log=log or (lambda line: None))


def _check_same_losses(got: dict, want: dict, rel: float) -> None:
    for key, pick in (("losses", lambda h: h["losses"]),
                      ("eval", lambda h: [e["loss"] for e in h["eval"]])):
        a, b = pick(got), pick(want)
        assert len(a) == len(b) > 0, (key, a, b)
        worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        assert worst <= rel, f"{key}: relative difference {worst:.2e} > {rel:g}: {a} vs {b}"


def _case_matches_plain_dp(dims: ParallelDims, *flags: str) -> None:
    """Stage 1 and stage 3 give plain DP's losses over 10 steps (1e-5 relative); the engine is
    really the one stepping, and the curve really falls."""
    plain = _train(dims, *flags)
    assert plain["optimizer"].config.stage == 0
    assert plain["losses"][-1] < 0.9 * plain["losses"][0], plain["losses"]
    for stage in (1, 3):
        zero = _train(dims, "--zero-stage", str(stage), *flags)
        assert isinstance(zero["optimizer"], ZeroPlusPlus)
        assert zero["optimizer"].config.stage == stage
        _check_same_losses(zero, plain, 1e-5)


def _case_stage1_domino(dims: ParallelDims) -> None:
    """Stage 1 under the Domino schedule gives Domino's losses with plain DP."""
    domino = ("--sequence-parallel", "--domino-batch-slices", "2")
    _check_same_losses(_train(dims, "--zero-stage", "1", *domino), _train(dims, *domino), 1e-5)


def _case_fp16_stage3(dims: ParallelDims) -> None:
    """fp16 parameters, fp32 masters and the loss scaler (on the log line) at stage 3."""
    lines: list[str] = []
    run = _train(dims, "--zero-stage", "3", "--fp16", "--initial-loss-scale", "65536",
                 log=lines.append)
    engine = run["optimizer"]
    assert engine.loss_scaler is not None and engine.loss_scaler.scale >= 65536
    assert all(s.dtype == torch.float16 for s in engine.params.shards)
    assert all(m.dtype == torch.float32 for m in engine.optimizer.masters)
    assert run["losses"][-1] < 0.9 * run["losses"][0], run["losses"]
    if dims.rank == 0:
        first = next(i for i, line in enumerate(lines) if line.startswith(" iteration"))
        assert "loss scale 65536.0" in lines[first], lines[first]
        assert lines[first + 1].startswith(" ZeRO-3 per rank: held "), lines[first + 1]


def _case_zeropp_trains(dims: ParallelDims) -> None:
    """qwZ + hpZ + qgZ (int4, blocks of 256) on 2 nodes x 2: the loss falls as ZeRO-3's does, and
    the log says what crossed the nodes."""
    lines: list[str] = []
    zeropp = _train(dims, *ZERO_PP, iters=20, micro_batch_size=1, log=lines.append)
    zero3 = _train(dims, "--zero-stage", "3", iters=20, micro_batch_size=1)
    engine = zeropp["optimizer"]
    assert engine.config.quantized_weights and engine.config.hpz
    assert engine.config.quantized_gradients and engine.config.block_size == 256
    first, last = zeropp["losses"][0], sum(zeropp["losses"][-5:]) / 5
    assert last < 0.8 * first, zeropp["losses"]
    assert abs(last - sum(zero3["losses"][-5:]) / 5) < 0.05 * last
    metrics = zeropp["metrics"]
    assert metrics["zero_inter_mb_per_iter"] > 0 and metrics["zero_intra_mb_per_iter"] > 0
    assert metrics["zero_inter_mb_per_iter"] < 0.5 * zero3["metrics"]["zero_inter_mb_per_iter"]
    if dims.rank == 0:
        assert any(line.endswith(" MB inter-node") for line in lines), lines


def _case_resume(dims: ParallelDims, directory: str, *flags: str) -> None:
    """6 iterations straight == 3 (stopped by --exit-interval, saved) + resume + 3, exactly; every
    (TP, DP) rank wrote its optimizer shard."""
    straight = _train(dims, *flags, iters=6)
    first = _train(dims, *flags, "--save", directory, "--exit-interval", "3", iters=6)
    assert latest_iteration(directory) == 3
    shard = (f"{directory}/iter_0000003/mp_rank_{dims.tp_rank:02d}/"
             f"optim_dp_rank_{dims.dp_rank:03d}.pt")
    assert os.path.exists(shard), shard
    resumed = _train(dims, *flags, "--load", directory, iters=6)
    assert first["losses"] + resumed["losses"] == straight["losses"]
    assert first["eval"] + resumed["eval"] == straight["eval"]


def _expect_error(match: str, dims: ParallelDims, *flags: str) -> None:
    """The ConfigError naming --load (a CheckpointError while loading) matching `match` (an
    AssertionError otherwise: pytest.raises' failure is no Exception, and would end the spawned
    rank rather than the case)."""
    try:
        _train(dims, *flags, iters=6)
    except ConfigError as err:
        assert str(err).startswith("--load=") and re.search(match, str(err)), str(err)
    else:
        raise AssertionError(f"no ConfigError matching {match!r}")


def _check_failed_optimizer_shard_blocks_the_save(run: dict, dims: ParallelDims,
                                                  directory: str) -> None:
    """One rank failing to write its optimizer shard fails the save on every rank, and the
    iteration file keeps naming the previous checkpoint."""
    real_save = shards.atomic_save

    def fail_on_rank1(obj: dict, path) -> None:
        if dims.rank == 1 and path.name.startswith("optim_dp_rank_"):
            raise OSError("disk full")
        real_save(obj, path)

    shards.atomic_save = fail_on_rank1
    try:
        save_checkpoint(directory, TrainingState(iteration=9), run["model"], run["optimizer"],
                        dims)
    except CheckpointError as err:
        assert re.search("rank 1 could not write .*optim_dp_rank_001.pt: .*disk full", str(err))
    else:
        raise AssertionError("the save did not fail")
    finally:
        shards.atomic_save = real_save
    assert latest_iteration(directory) == 3


def _case_checkpoint_mismatches(dims: ParallelDims, root: str) -> None:
    """Stage 3's model shard holds the whole weights (a model-only load gets the engine's); a
    save is complete only with every optimizer shard; loading across ZeRO and plain DP works with
    --no-load-optim / --finetune, else it is an error naming the flag, as is another stage or a
    missing optimizer shard (plain DP is stage 0: the same rules)."""
    zero = _train(dims, "--zero-stage", "3", "--save", f"{root}/zero3", "--exit-interval", "3",
                  iters=6)
    _check_failed_optimizer_shard_blocks_the_save(zero, dims, f"{root}/zero3")
    _train(dims, "--save", f"{root}/plain", "--exit-interval", "3", iters=6)
    weights = zero["optimizer"].full_state_dict()
    model = build_model(zero["model"].config, dims, "gpt")
    load_checkpoint(f"{root}/zero3", model, dims, load_rng=False)
    loaded = model.full_state_dict()
    assert loaded.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(loaded[name], value), name

    _expect_error(r"saved at --zero-stage 3 \(0: plain data parallelism\), this run has "
                  "--zero-stage 0: resume it at --zero-stage 3 .* --no-load-optim or --finetune",
                  dims, "--load", f"{root}/zero3")
    assert len(_train(dims, "--load", f"{root}/zero3", "--no-load-optim", iters=6)["losses"]) == 3
    _expect_error("saved at --zero-stage 0 .* this run has --zero-stage 1: resume it at "
                  "--zero-stage 0, or load the weights only", dims,
                  "--zero-stage", "1", "--load", f"{root}/plain")
    tuned = _train(dims, "--zero-stage", "1", "--load", f"{root}/plain", "--finetune", iters=6)
    assert len(tuned["losses"]) == 6
    _expect_error("saved at --zero-stage 3 .* this run has --zero-stage 1: resume it at "
                  "--zero-stage 3 at tensor-parallel 1 x data-parallel 2", dims,
                  "--zero-stage", "1", "--load", f"{root}/zero3")
    # saved with the default units (one layer each for the tiny model), loaded two layers a unit
    _expect_error(r"units are not this engine's: saved 3 \(<root>, decoder.layers.0, "
                  r"decoder.layers.1\), here 2 \(<root>, decoder.layers.0-1\).*pass the "
                  r"--zero-layers-per-unit \(or --zero-unit-params\) it was saved with",
                  dims, "--zero-stage", "3", "--zero-layers-per-unit", "2", "--load",
                  f"{root}/zero3")
    if dist.get_rank() == 0:
        shutil.copytree(f"{root}/zero3", f"{root}/missing")
        os.remove(f"{root}/missing/iter_0000003/mp_rank_00/optim_dp_rank_001.pt")
    dist.barrier()
    _expect_error("checkpoint shard missing: .*iter_0000003/mp_rank_00/optim_dp_rank_001.pt",
                  dims, "--zero-stage", "3", "--load", f"{root}/missing")


SUITE = DistSuite()


@pytest.fixture(scope="module")
def zero_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("zero_checkpoints")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    if world == 2:
        return {"dp2": ParallelDims(tp=1), "root": root}
    return {"tp2_dp2": ParallelDims(tp=2), "nodes": ParallelDims(tp=1, gpus_per_node=2),
            "zeropp_dir": f"{root}/zeropp", "stage1_dir": f"{root}/stage1"}


SUITE.case("dp2_matches_plain", _case_matches_plain_dp, C.dp2, worlds=(2,))
SUITE.case("dp2_fp16_stage3", _case_fp16_stage3, C.dp2, worlds=(2,))
SUITE.case("dp2_checkpoint_mismatches", _case_checkpoint_mismatches, C.dp2, C.root, worlds=(2,))
SUITE.case("tp2_dp2_matches_plain", _case_matches_plain_dp, C.tp2_dp2, "--sequence-parallel",
           worlds=(4,))
SUITE.case("tp2_dp2_stage1_domino", _case_stage1_domino, C.tp2_dp2, worlds=(4,))
SUITE.case("nodes_zeropp_trains", _case_zeropp_trains, C.nodes, worlds=(4,))
SUITE.case("nodes_zeropp_resume", _case_resume, C.nodes, C.zeropp_dir, *ZERO_PP, worlds=(4,))
SUITE.case("tp2_dp2_stage1_bf16_resume", _case_resume, C.tp2_dp2, C.stage1_dir, "--zero-stage",
           "1", "--bf16", worlds=(4,))

test_zero_training = SUITE.test(args_fixture="zero_root")
