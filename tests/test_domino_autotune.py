"""`--domino`'s start-up timing (megadomino/overlap/domino/autotune.py): the candidates fit the
shape; the start-up line names the chosen plan and every candidate with its time; and at TP=2
(gloo) the timing gives every rank the same times and choice, the fastest, leaves the model as
its config asks, and autotune_domino installs and logs that choice (no timing assertions: the
times are whatever they are, only their bookkeeping is checked)."""

from __future__ import annotations

import re

from test_tp_equivalence import tiny_config

from configs import parallel_config
from dist_utils import C, DistSuite
from megadomino.build import build_model
from megadomino.distributed import ParallelDims, comm
from megadomino.overlap.domino import autotune
from megadomino.overlap.domino.schedule import DominoRunner

NAMES = ["plain TP", "Domino unsliced (explicit backward)", "Domino N=2 K=1", "Domino N=1 K=2"]


def test_candidates_fit_the_shape():
    config = tiny_config("gpt", ffn_hidden_size=96)  # 48 ffn columns a rank at TP=2
    assert autotune.candidates(config, 2, 4) == [
        (1, 1, False), (1, 1, True), (2, 1, True), (1, 2, True), (2, 2, True), (4, 1, True)]
    assert autotune.candidates(config, 2, 1) == [(1, 1, False), (1, 1, True), (1, 2, True)]
    odd = tiny_config("gpt", ffn_hidden_size=90)  # 45 a rank: no K=2
    assert (1, 2, True) not in autotune.candidates(odd, 2, 4)


def _times(choice: int) -> autotune.PlanTimes:
    plans = ((1, 1, False), (1, 1, True), (2, 1, True), (1, 2, True))
    return autotune.PlanTimes(plans, (4.0, 3.9, 3.2, 4.4), choice, passes=3)


def test_the_line_names_the_choice_and_every_time():
    line = _times(2).line()
    assert line.startswith("domino auto: chose Domino N=2 K=1 at 3.20 ms (0.800x plain TP's "
                           "time); "), line
    assert "median of 3 passes, slowest rank" in line
    for name, ms in zip(NAMES, ("4.00", "3.90", "3.20", "4.40")):
        assert f"{name} {ms} ms" in line, (name, line)
    assert line.count("(chosen)") == 1 and "Domino N=2 K=1 3.20 ms (chosen)" in line
    plain = _times(0).line()
    assert plain.startswith("domino auto: chose plain TP at 4.00 ms; ") and "x plain" not in plain
    assert "plain TP 4.00 ms (chosen)" in plain
    assert _times(2).plan == autotune.DominoPlan(2, 1, True)
    assert not _times(0).plan.enabled


def check_timing(dims):
    config = tiny_config("gpt", ffn_hidden_size=96)
    model = build_model(config, dims, "gpt", parallel=parallel_config())
    timed = autotune.time_plans(model, 4, warmup=1, iters=1, rounds=2)
    assert list(timed.plans) == autotune.candidates(config, dims.tp, 4)
    assert len(timed.ms) == len(timed.plans) and all(ms > 0 for ms in timed.ms)
    assert timed.ms[timed.choice] == min(timed.ms)
    gathered = comm.all_gather_object((timed.ms, timed.choice))
    assert all(other == gathered[0] for other in gathered), gathered
    assert model.decoder.runner is None  # its own config: plain TP
    assert all(p.grad is None for p in model.parameters())

    lines: list[str] = []
    plan = autotune.autotune_domino(model, 4, log=lines.append, warmup=1, iters=1, rounds=1)
    assert isinstance(model.decoder.runner, DominoRunner) == plan.enabled
    if dims.rank == 0:
        (line,) = lines
        chosen = autotune.plan_name(plan.batch_slices, plan.hidden_slices, plan.enabled)
        assert line.startswith(f"domino auto: chose {chosen} at "), line
        entries = line.split("slowest rank: ")[1].split(", ")
        names = [re.sub(r" [\d.]+ ms( \(chosen\))?$", "", entry) for entry in entries]
        assert names == [autotune.plan_name(*plan) for plan in timed.plans], line
    else:
        assert lines == []


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"dims": ParallelDims(tp=world)}


SUITE.case("timing", check_timing, C.dims)

test_domino_autotune = SUITE.test()
