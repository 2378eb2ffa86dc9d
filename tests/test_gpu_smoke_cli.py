"""benchmarks/gpu_smoke.py's pure parts, without launching anything: the log parser, the
tolerance check, a timed-out run's failure line, the mode list's skip rules at 2, 3 and 4 ranks,
and every mode's command line at 4 ranks passing the CLI's parser and validator."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from megadomino.cli.arguments import parse_args
from megadomino.config.validate import validate

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
smoke = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = smoke  # dataclasses look their module up there
_SPEC.loader.exec_module(smoke)

LOG = """\
 parallelism: 2 ranks = TP 2 x PP 1 x DP 1, gloo on CPU; TP overlap: none
 iteration        1/      10 | loss 5.826861E+00 | lr 1.000E-03 | global batch 4 | grad norm 2.266
 ZeRO-0 per rank: held 6.5 MiB (params 1.6), transient peak 1.6 MiB
 iteration        2/      10 | loss 5.660154E+00 | lr 9.000E-04 | global batch 4 | grad norm 1.383
 iteration        2/      10 | loss 9.999999E+00 | lr 9.000E-04 | global batch 4 | grad norm 9.999
"""


def steps(losses: list[float]) -> dict[int, tuple[float, float]]:
    return {step: (loss, 1.0) for step, loss in enumerate(losses, start=1)}


def test_parse_log_reads_loss_and_norm_and_keeps_the_first_line_of_an_iteration():
    assert smoke.parse_log(LOG) == {1: (5.826861, 2.266), 2: (5.660154, 1.383)}


def test_compare_bounds_the_relative_loss_difference_at_every_iteration():
    reference = steps([5.0] * smoke.ITERATIONS)
    near = steps([5.0] * (smoke.ITERATIONS - 1) + [5.0 * (1 + 5e-5)])
    passed, worst, why = smoke.compare(near, reference, 1e-4)
    assert passed and worst == pytest.approx(5e-5) and why == ""
    far = steps([5.0, 5.0 * (1 + 2e-4)] + [5.0] * (smoke.ITERATIONS - 2))
    passed, worst, why = smoke.compare(far, reference, 1e-4)
    assert not passed and worst == pytest.approx(2e-4) and why.startswith("iteration 2: ")
    passed, worst, why = smoke.compare(steps([5.0] * 9), reference, 1e-4)
    assert not passed and worst == math.inf and why == "iteration 10 missing"
    nan = steps([5.0] * 3 + [math.nan] + [5.0] * (smoke.ITERATIONS - 4))
    assert smoke.compare(nan, reference, 1e-4)[:2] == (False, math.inf)


def test_tolerances_per_dtype_and_for_quantized_modes():
    plain, quantized = smoke.Mode("tp"), smoke.Mode("zero3-qwz", quantized=True)
    assert smoke.tolerance(plain, "fp32") == 1e-4 and smoke.tolerance(plain, "bf16") == 2e-2
    assert smoke.tolerance(quantized, "fp32") == smoke.tolerance(quantized, "bf16") == 5e-2


def test_a_run_without_its_last_iteration_line_fails_naming_mode_and_budget():
    run = smoke.Launch(LOG, -9, 120.3, timed_out=True)
    row = smoke.judge(smoke.Mode("pp-1f1b"), "bf16", run, None, 120.0)
    assert row["status"] == "fail" and row["losses"] == [5.826861, 5.660154]
    assert row["detail"].startswith("pp-1f1b (bf16): no 'iteration 10/10' line within its "
                                    "120 s budget; rank output tail:\n parallelism: ")


def skips(nproc: int, cuda: bool = True) -> dict[str, str | None]:
    return {mode.name: mode.skip for mode in smoke.mode_matrix(nproc, cuda, fp8=cuda)}


def test_skip_rules_at_two_ranks():
    cpu = skips(2, cuda=False)
    assert list(cpu)[0] == "dp"
    for name in ("dp", "tp", "tp-sp-overlap", "domino", "pp-1f1b", "pp-interleaved", "zero3",
                 "zero++"):
        assert cpu[name] is None, name
    for name in ("pp-tp-sp", "pp-dp", "cuda-graph-tp-dp"):
        assert skips(2)[name] == "needs an even number of 4+ ranks, not 2", name
    assert "3+ ranks" in cpu["pp-plan"]
    assert cpu["cuda-graph"] == "CUDA graphs need CUDA" and "compute capability" in cpu["fp8"]


def test_skip_rules_at_three_and_four_ranks():
    assert skips(3)["tp"] == "TP=3 does not divide the 8 heads"
    assert skips(3)["pp-1f1b"] == "8 layers do not split over 3 stages"
    assert skips(3)["pp-plan"] is None
    assert all(reason is None for reason in skips(4).values()), skips(4)
    cpu = {name for name, reason in skips(4, cuda=False).items() if reason is not None}
    assert cpu == {"cuda-graph", "cuda-graph-sp-overlap", "cuda-graph-domino",
                   "cuda-graph-tp-dp", "fp8", "fp8-compiled", "zero1-fp8-gather",
                   "zero3-fp8-gather"}


@pytest.mark.parametrize("nproc", [3, 4, 8])
def test_pipeline_plans_tile_the_ranks_and_layers(nproc):
    mode = smoke.plan_mode(nproc)
    stages = mode.plan
    assert sorted(rank for stage in stages for rank in stage["ranks"]) == list(range(nproc))
    bounds = [stage["layers"] for stage in stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == smoke.num_layers(nproc)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert len({stage["tp"] for stage in stages}) == 2  # heterogeneous
    assert mode.flags == ("--pipeline-model-parallel-size", str(len(stages)))
    # tied where the first and last stage are alike (even N), else untied, its reference too
    assert bool(mode.model_flags) == (nproc % 2 == 1)
    widest = max(len(stage["ranks"]) // stage["tp"] for stage in stages)
    assert mode.micro_batch >= widest and smoke.global_batch(nproc) % mode.micro_batch == 0


def test_every_mode_at_four_ranks_passes_the_cli_validator(tmp_path):
    """Flags that exist and combine, a batch that tiles: what a launch would refuse first."""
    args = argparse.Namespace(nproc=4)
    for mode in smoke.mode_matrix(4, cuda=True, fp8=True):
        argv = smoke._command(args, mode, "bf16", tmp_path)
        config, _ = parse_args(argv[argv.index("pretrain_gpt.py") + 1:], "gpt")
        validate(config, 4)
