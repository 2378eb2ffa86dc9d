"""Checkpoints of a heterogeneous plan (--pipeline-plan, a TP=2 stage feeding a TP=1 stage on 3
ranks): each stage writes its own shards (mp_rank_TT_PPP at its own TP degree: stage 0 two,
stage 1 one) and every shard records the plan's stages; a run stopped and resumed at the plan
gives the straight run's losses; the checkpoint loads into the run without PP (DP 3) and into
Megatron's uniform PP3, and checkpoints of those load into the plan (stage 0 optimizer state
included), each resumed run within 1e-5 of the straight run's losses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_pipeline_hetero import file_plan
from test_tp_equivalence import tiny_config

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint import latest_iteration
from megadomino.train.loop import train

REL = 1e-5
ITERS, HALF = 8, 4
STAGES = [((0, 1), 2, (0, 4)), ((2,), 1, (4, 7))]


def _train(dims, root: str, **changes) -> dict:
    """8 AdamW steps of 6 sequences (mock data: every label counts, so the plan's micro-batch
    of 3, PP3's of 3 and DP3's of 1 give the same loss)."""
    if dims.uniform and dims.pp == 1:
        mbs = 1
    elif dims.uniform:
        mbs, changes = 3, dict(changes, pipeline_model_parallel_size=3,
                               decoder_first_pipeline_num_layers=3)
    else:
        mbs, changes = 3, dict(changes, pipeline_model_parallel_size=2,
                               pipeline_plan=_plan_file(root))
    model = tiny_config("gpt", num_layers=7, vocab_size=331,
                        untie_embeddings_and_output_weights=True)
    config = make_config(model, micro_batch_size=mbs, global_batch_size=6, train_iters=ITERS,
                         lr=3e-3, lr_warmup_iters=2, log_interval=4, eval_interval=ITERS,
                         eval_iters=1, mock_data=True, **changes)
    return train(config, dims, "gpt", log=lambda line: None)


def _plan_file(root: str) -> str:
    path = os.path.join(root, f"plan-rank{torch.distributed.get_rank()}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"stages": [{"ranks": list(r), "tp": t, "layers": list(la)}
                              for r, t, la in STAGES]}, handle)
    return path


def check_resume(plan, root: str):
    directory = f"{root}/resume-plan"
    straight = _train(plan, root)
    first = _train(plan, root, save=directory, exit_interval=HALF)
    assert latest_iteration(directory) == HALF
    shards = sorted(p.name for p in Path(directory, f"iter_{HALF:07d}").glob("mp_rank_*"))
    assert shards == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000"]
    saved = torch.load(Path(directory, f"iter_{HALF:07d}", "mp_rank_01_000",
                            "model_optim_rng.pt"), weights_only=True)["parallel"]
    assert saved["stages"] == [[[0, 1], 2], [[2], 1]] and saved["tp"] == 2
    resumed = _train(plan, root, load=directory)
    assert first["losses"] + resumed["losses"] == straight["losses"]


def check_across(saver, loader, root: str, name: str):
    """Save at `saver`'s layout, resume at `loader`'s: the straight run's losses (1e-5)."""
    directory = f"{root}/{name}"
    straight = _train(saver, root)
    _train(saver, root, save=directory, exit_interval=HALF)
    resumed = _train(loader, root, load=directory)
    assert len(resumed["losses"]) == ITERS - HALF
    for step, (a, b) in enumerate(zip(resumed["losses"], straight["losses"][HALF:],
                                      strict=True)):
        assert abs(a - b) <= REL * abs(b), (step, a, b)


SUITE = DistSuite(worlds=(3,), timeout=400.0)


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("hetero-checkpoints")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"plan": ParallelDims(plan=file_plan(STAGES, 7)),
            "dp3": ParallelDims(), "pp3": ParallelDims(pp=3), "root": root}


SUITE.case("resume-plan", check_resume, C.plan, C.root)
SUITE.case("plan-to-dp3", check_across, C.plan, C.dp3, C.root, "plan-to-dp3")
SUITE.case("dp3-to-plan", check_across, C.dp3, C.plan, C.root, "dp3-to-plan")
SUITE.case("plan-to-pp3", check_across, C.plan, C.pp3, C.root, "plan-to-pp3")
SUITE.case("pp3-to-plan", check_across, C.pp3, C.plan, C.root, "pp3-to-plan")

test_hetero_pipeline_checkpoints = SUITE.test(args_fixture="checkpoint_root")
