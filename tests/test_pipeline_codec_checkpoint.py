"""The pipeline codecs' state in the training loop's checkpoints (train/checkpoint/
pipeline_codec.py), gloo, PP2, through `train`:

- adaptive (--pipeline-codec auto, every 2 steps; and with --async-save) and error feedback
  (int8, fixed): a run saved every 2 iterations and stopped at iteration 3, then resumed, gives
  the uninterrupted run's losses and grad norms bit for bit. The decision rule reads wall-clock
  timings, so here a scripted rule takes its place (each decision the next setting of a cycle)
  and records what each decision was handed (every rank's steps and timed sends in the window):
  that must be the same in both runs too, so a resume keeps the window and a save's probe
  forward times nothing (and, with error feedback, renews no residual: the losses after the
  save at 2 would differ);
- every rank wrote its codec file, listed in the manifest;
- a resume with another --pipeline-codec-interval, and one from a checkpoint without codec
  state, start the codecs afresh with one notice naming the reason (and then train otherwise
  than the uninterrupted run: the test of exactness above can fail); a run without a stateful
  codec says it leaves the checkpoint's codec state; a codec file the manifest lists that is
  missing is a ConfigError naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed as dist
from test_tp_equivalence import tiny_config

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.config import ConfigError
from megadomino.distributed import ParallelDims
from megadomino.pipeline.codec import Setting
from megadomino.train.checkpoint import latest_iteration
from megadomino.train.loop import train

ITERS, HALF = 8, 3
AUTO = dict(pipeline_codec="auto", pipeline_codec_interval=2)
FEEDBACK = dict(pipeline_codec="int8", pipeline_codec_interval=0,
                pipeline_codec_error_feedback=True)
CYCLE = (Setting("int8"), Setting("adatopk", 24), Setting("int4"), Setting("none"))


def _scripted(seen: list):
    """A decision rule (codec_rate.decide's signature) that takes the setting after the
    current one in CYCLE on every boundary and records each rank's (steps, timed sends)."""
    def decide(codec, fmt, density, boundaries, reports, current):
        seen.append([(report["steps"], len(report["sends"])) for report in reports])
        after = CYCLE[(CYCLE.index(current[0]) + 1) % len(CYCLE)] if current[0] in CYCLE \
            else CYCLE[0]
        return (after,) * boundaries
    return decide


def _train(dims, codec: dict, lines: list | None = None, **changes) -> dict:
    """A PP2 run of ITERS iterations (dropout on) with `codec`'s flags and the scripted rule;
    its history, with the decisions' inputs under 'seen'; rank 0's lines into `lines`."""
    model = tiny_config("gpt", num_layers=4, vocab_size=331, hidden_dropout=0.1)
    config = make_config(model, pipeline_model_parallel_size=dims.pp, micro_batch_size=2,
                         global_batch_size=8, train_iters=ITERS, lr=3e-3, lr_warmup_iters=2,
                         log_interval=4, eval_interval=ITERS, eval_iters=1, mock_data=True,
                         **codec, **changes)
    seen = []
    with mock.patch("megadomino.pipeline.codec_rate.decide", _scripted(seen)):
        history = train(config, dims, "gpt", log=(lines if lines is not None else []).append)
    return {**history, "seen": seen}


def check_exact_resume(dims, root: str, name: str, codec: dict, async_save: bool = False,
                       exact_windows: bool = True):
    """`exact_windows`: compare what each decision was handed (every send of a step is timed
    by the step's end on the CPU; on CUDA the watcher may time it later)."""
    directory = f"{root}/{name}"
    straight = _train(dims, codec)
    first = _train(dims, codec, save=directory, save_interval=2, exit_interval=HALF,
                   async_save=async_save)
    resumed = _train(dims, codec, load=directory)
    assert first["losses"] + resumed["losses"] == straight["losses"]
    assert first["grad_norms"] + resumed["grad_norms"] == straight["grad_norms"]
    if dims.rank == 0 and codec["pipeline_codec_interval"]:  # decided at iterations 3, 5, 7
        assert [len(s) for s in straight["seen"]] == [2, 2, 2], straight["seen"]
    if exact_windows:
        assert first["seen"] + resumed["seen"] == straight["seen"]
    if exact_windows and dims.rank == 0 and codec["pipeline_codec_interval"]:
        window = (2, 2 * 4)  # 2 steps of 4 micro-batches: 4 sends a step on either stage
        assert straight["seen"] == [[window, window]] * 3, straight["seen"]
    iteration_dir = Path(directory, f"iter_{HALF:07d}")
    files = sorted(p.relative_to(iteration_dir).as_posix()
                   for p in iteration_dir.glob("mp_rank_*/codec_dp_rank_*.pt"))
    assert files == ["mp_rank_00_000/codec_dp_rank_000.pt",
                     "mp_rank_00_001/codec_dp_rank_000.pt"], files
    listed = json.loads((iteration_dir / "manifest.json").read_text())["files"]
    assert set(files) <= set(listed)


def _saved(dims, root: str, name: str, codec: dict) -> str:
    """The directory of a run with `codec`'s flags saved at iteration HALF (made once)."""
    directory = f"{root}/{name}"
    dist.barrier()  # every rank asks before any rank's run writes the checkpoint
    if latest_iteration(directory) is None:
        _train(dims, codec, save=directory, exit_interval=HALF)
    return directory


def check_fresh_starts(dims, root: str):
    """Resumes that cannot continue the codecs: one notice each, and the codecs start afresh."""
    directory, plain = _saved(dims, root, "saved-auto", AUTO), _saved(dims, root, "plain", {})
    straight = _train(dims, AUTO, exit_interval=HALF + 1)
    cases = (({**AUTO, "pipeline_codec_interval": 3}, directory,
              "holds pipeline codec state saved with --pipeline-codec-interval 2, this run has "
              "--pipeline-codec-interval 3: the pipeline codecs start afresh"),
             (AUTO, plain, "holds no pipeline codec state (saved without --pipeline-codec"),
             ({}, directory, "holds pipeline codec state, which this run (without an adaptive "
                             "codec or --pipeline-codec-error-feedback) does not use"))
    for codec, load, notice in cases:
        lines = []
        resumed = _train(dims, codec, lines, load=load, exit_interval=HALF + 1)
        assert len(resumed["losses"]) == 1
        if dims.rank == 0:
            assert sum(notice in line for line in lines) == 1, (notice, lines)
        if codec:  # afresh: the floor at iteration 4, where the straight run had int8
            assert resumed["losses"][0] != straight["losses"][HALF]


def check_missing_file(dims, root: str):
    saved, directory = _saved(dims, root, "saved-auto", AUTO), f"{root}/missing"
    if dims.rank == 0:
        shutil.copytree(saved, directory)
        Path(directory, f"iter_{HALF:07d}", "mp_rank_00_001", "codec_dp_rank_000.pt").unlink()
    dist.barrier()
    with pytest.raises(ConfigError) as error:
        _train(dims, AUTO, load=directory)
    assert "checkpoint shard missing:" in str(error.value), error.value
    assert "mp_rank_00_001/codec_dp_rank_000.pt (listed in" in str(error.value), error.value


SUITE = DistSuite(worlds=(2,), timeout=400.0)


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("codec-checkpoints")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"pp2": ParallelDims(pp=2), "root": root}


SUITE.case("resume-auto", check_exact_resume, C.pp2, C.root, "auto", AUTO)
SUITE.case("resume-error-feedback", check_exact_resume, C.pp2, C.root, "feedback", FEEDBACK)
SUITE.case("resume-auto-async-save", check_exact_resume, C.pp2, C.root, "auto-async", AUTO,
           async_save=True)
SUITE.case("fresh-starts", check_fresh_starts, C.pp2, C.root)
SUITE.case("missing-file", check_missing_file, C.pp2, C.root)

test_pipeline_codec_checkpoints = SUITE.test(args_fixture="checkpoint_root")
