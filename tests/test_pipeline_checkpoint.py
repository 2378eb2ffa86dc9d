"""Checkpoints of pipeline stages (Megatron's layout, one shard per TP x PP rank:
mp_rank_TT_PPP): a PP2 run stopped and resumed gives the straight run's losses exactly (dropout
on: the stages' RNG states resume too); a checkpoint loads at another pipeline degree, and at
another pipeline and tensor degree at once (stage 0 optimizer state included): PP2 -> PP1 x DP2,
PP1 x DP2 -> PP2, PP2 x TP2 -> PP4 and -> TP2 x DP2, each resumed run within 1e-5 of the straight
run's losses."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tp_equivalence import tiny_config

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint import latest_iteration
from megadomino.train.loop import train

REL = 1e-5
ITERS, HALF = 8, 4


def _train(dims, layers: int = 4, dropout: float = 0.0, **changes) -> dict:
    model = tiny_config("gpt", num_layers=layers, vocab_size=331, hidden_dropout=dropout)
    config = make_config(model, tensor_model_parallel_size=dims.tp,
                         pipeline_model_parallel_size=dims.pp, micro_batch_size=2,
                         global_batch_size=8, train_iters=ITERS, lr=3e-3, lr_warmup_iters=2,
                         log_interval=4, eval_interval=ITERS, eval_iters=1, mock_data=True,
                         **changes)
    return train(config, dims, "gpt", log=lambda line: None)


def check_resume(dims, root: str):
    directory = f"{root}/resume-pp{dims.pp}"
    straight = _train(dims, dropout=0.1)
    first = _train(dims, dropout=0.1, save=directory, exit_interval=HALF)
    assert latest_iteration(directory) == HALF
    shards = sorted(p.name for p in Path(directory, f"iter_{HALF:07d}").glob("mp_rank_*"))
    assert shards == [f"mp_rank_{t:02d}_{p:03d}" for t in range(dims.tp) for p in range(dims.pp)]
    resumed = _train(dims, dropout=0.1, load=directory)
    assert first["losses"] + resumed["losses"] == straight["losses"]


def check_across(saver, loader, root: str, name: str):
    """Save at `saver`'s degrees, resume at `loader`'s: the straight run's losses (1e-5)."""
    directory = f"{root}/{name}"
    straight = _train(saver)
    _train(saver, save=directory, exit_interval=HALF)
    resumed = _train(loader, load=directory)
    assert len(resumed["losses"]) == ITERS - HALF
    for step, (a, b) in enumerate(zip(resumed["losses"], straight["losses"][HALF:],
                                      strict=True)):
        assert abs(a - b) <= REL * abs(b), (step, a, b)


SUITE = DistSuite(worlds=(2, 4), timeout=400.0)


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("pipeline-checkpoints")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    if world == 2:
        return {"pp2": ParallelDims(pp=2), "dp2": ParallelDims(), "root": root}
    return {"pp2tp2": ParallelDims(tp=2, pp=2), "pp4": ParallelDims(pp=4),
            "tp2dp2": ParallelDims(tp=2), "root": root}


SUITE.case("resume-pp2", check_resume, C.pp2, C.root, worlds=(2,))
SUITE.case("pp2-to-pp1", check_across, C.pp2, C.dp2, C.root, "pp2-to-pp1", worlds=(2,))
SUITE.case("pp1-to-pp2", check_across, C.dp2, C.pp2, C.root, "pp1-to-pp2", worlds=(2,))
SUITE.case("pp2tp2-to-pp4", check_across, C.pp2tp2, C.pp4, C.root, "pp2tp2-to-pp4",
           worlds=(4,))
SUITE.case("pp2tp2-to-tp2dp2", check_across, C.pp2tp2, C.tp2dp2, C.root, "pp2tp2-to-tp2dp2",
           worlds=(4,))

test_pipeline_checkpoints = SUITE.test(args_fixture="checkpoint_root")
