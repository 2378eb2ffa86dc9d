"""Checkpoints that load as saved, or not at all: the committed format-1 fixture loads and
resumes bit-exactly at every format change."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_utils import C, DistSuite
from megadomino.config import ModelConfig, TrainConfig
from megadomino.parallel import ParallelDims
from megadomino.training.loop import train

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1"


def fixture_configs(kind: str, **overrides) -> tuple[ModelConfig, TrainConfig, list[float]]:
    """The model and training configs the fixture `kind` was written with, and its run's losses."""
    expected = json.loads((FIXTURE / "expected.json").read_text())
    model = ModelConfig(**expected["model_config"])
    config = TrainConfig(**expected[kind]["train_config"], log_interval=1, eval_interval=0,
                         eval_iters=0, mock_data=True)
    return model, dataclasses.replace(config, **overrides), expected[kind]["losses"]


def shared_copy(source: Path, target: str) -> str:
    """`source` copied to `target` by rank 0, seen by every rank on return."""
    if dist.get_rank() == 0:
        shutil.copytree(source, target)
    dist.barrier()
    return target


def check_fixture_resumes(kind: str, root: str) -> None:
    """The fixture's iteration-2 checkpoint resumed at its TP=2 x DP=2 gives the losses of
    iterations 3 and 4 of the run that wrote it, bit for bit."""
    directory = shared_copy(FIXTURE / kind, f"{root}/resume-{kind}")
    model, config, losses = fixture_configs(kind, tensor_model_parallel_size=2, load=directory)
    history = train(model, config, ParallelDims(tp=2), "gpt", log=lambda line: None)
    assert history["losses"] == losses[2:], (history["losses"], losses)


def check_fixture_other_tp(root: str) -> None:
    """The plain fixture loads at TP=1 x DP=4 (weights and AdamW state re-sharded) and trains on
    with finite losses near the original run's."""
    directory = shared_copy(FIXTURE / "plain", f"{root}/tp1")
    model, config, losses = fixture_configs("plain", load=directory)
    history = train(model, config, ParallelDims(tp=1), "gpt", log=lambda line: None)
    assert all(math.isfinite(loss) for loss in history["losses"]), history["losses"]
    assert abs(history["losses"][-1] - losses[-1]) < 0.05, (history["losses"], losses)


SUITE = DistSuite(worlds=(4,))


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"root": root}


for kind in ("plain", "zero1"):
    SUITE.case(f"fixture-resumes-{kind}", check_fixture_resumes, kind, C.root)
SUITE.case("fixture-other-tp", check_fixture_other_tp, C.root)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("integrity")),)


test_checkpoint_integrity = SUITE.test(args_fixture="root")
