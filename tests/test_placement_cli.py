"""`pretrain_gpt.py --pipeline-plan auto` on 3 ranks: the ranks measure their links, plan the same
plan (resolve_auto compares every rank's), rank 0 prints it with its predicted step time and
writes it as a --pipeline-plan file, and five AdamW steps log the losses and grad norms of the
run without PP on the same global batches (DP 3) within 1e-5; and what cannot be planned is one
`error:` line, exit 2, before any process group."""

from __future__ import annotations

import pytest
from test_pipeline_hetero_cli import COMMON, LOG_LINE, launch, rank0_log

from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError
from megadomino.config.pipeline_plan import read_plan
from megadomino.config.validate import validate


def test_auto_plans_one_plan_and_trains_as_without_pp(tmp_path):
    placed = tmp_path / "placement"
    mine = rank0_log([*COMMON, "--pipeline-plan", "auto", "--micro-batch-size", "3",
                      "--pipeline-placement-dir", str(placed)], tmp_path)
    ref = rank0_log([*COMMON, "--micro-batch-size", "1"], tmp_path)
    assert "pipeline plan (--pipeline-plan auto, --pipeline-planner op-fence)" in mine, mine
    assert "predicted step" in mine and "links (Mbit/s, row -> column):" in mine, mine
    plan = read_plan(str(placed / "plan.json"), 3)
    assert plan.table().rstrip() in mine
    assert sorted(rank for stage in plan.stages for rank in stage.ranks) == [0, 1, 2]
    steps = [LOG_LINE.findall(log) for log in (mine, ref)]
    assert len(steps[0]) == 5 and len(steps[1]) == 5, (mine[-2000:], ref[-2000:])
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(*steps, strict=True):
        for a, b in ((loss, ref_loss), (norm, ref_norm)):
            assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b)), (step, a, b)


def _errors(world: int, flags: list[str], cwd) -> list[str]:
    ranks = launch(world, [*COMMON, *flags], cwd)
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2] * world, outputs[0][-2000:]
    return [line for line in outputs[0].splitlines() if line.startswith("error:")]


def test_what_cannot_be_planned_is_one_line_before_any_group(tmp_path):
    assert _errors(1, ["--pipeline-plan", "auto"], tmp_path) == [
        "error: --pipeline-plan auto places pipeline stages on at least 2 ranks: launch 2 or "
        "more (the world has 1)"]
    assert _errors(3, ["--pipeline-plan", "auto", "--pipeline-planner", "dt-fm",
                       "--num-layers", "2", "--micro-batch-size", "1"], tmp_path) == [
        "error: --pipeline-planner dt-fm needs stages of equal size: no stage count in 2 "
        "divides the world of 3 ranks into groups of at most --micro-batch-size=1 ranks; "
        "raise --micro-batch-size or use --pipeline-planner op-fence"]
    assert _errors(1, ["--pipeline-planner", "dt-fm"], tmp_path) == [
        "error: --pipeline-planner needs --pipeline-plan auto: it chooses how the plan is made "
        "at start-up"]
    assert _errors(1, ["--pipeline-plan", "auto", "--tensor-model-parallel-size", "2"],
                   tmp_path) == [
        "error: --tensor-model-parallel-size cannot be used with --pipeline-plan auto: each "
        "stage's TP degree is the plan's 'tp'"]


def test_a_bad_slow_rank_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match=r"^--emulate-slow-rank=3 is invalid: it must be "
                                          r"RANK:FACTOR, a rank and a factor >= 1"):
        parse_args([*COMMON, "--emulate-slow-rank", "3"], "gpt")
    config, _ = parse_args([*COMMON, "--emulate-slow-rank", "3:2"], "gpt")
    with pytest.raises(ConfigError, match=r"^--emulate-slow-rank=3:2 is invalid: it must be "
                                          r"RANK:FACTOR, a rank of the world \(0\.\.2\)"):
        validate(config, 3)
