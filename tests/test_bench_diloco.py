"""The DiLoCo netns benchmark's report (benchmarks/bench_diloco.py, run by
bench_diloco_netns.sh) on rank 0's log lines as pretrain_gpt.py writes them: throughput against
the no-communication limit, the loss against plain DP's, and the targets met or missed."""

from __future__ import annotations

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location(
    "bench_diloco", os.path.join(REPO, "benchmarks", "bench_diloco.py"))
bench_diloco = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_diloco)


def _log(tokens_per_s: float, iters: int, loss: float | None, inter_mb: float) -> str:
    valid = f" validation at iteration {iters} | loss {loss:.6E} | ppl 1.0E+00\n" if loss else ""
    windows = "".join(f" iteration {it:8d}/{iters:8d} | loss 5.0E+00 | 100.0 ms/iter | "
                      f"{tokens_per_s:.0f} tokens/s | peak mem 1.0 GiB\n"
                      for it in range(10, iters + 1, 10))
    ended = (f" run ended: iterations 1-{iters} of {iters} in 12.0 s, {tokens_per_s:.0f} "
             f"tokens/s | train loss 5.000000E+00")
    if loss is not None:
        ended += f" | validation loss {loss:.6E} (iteration {iters})"
    zero = (" ZeRO-0 per rank: held 2.1 MiB (params 0.5), transient peak 0.5 MiB | per "
            f"iteration: 0.00 MB intra-node, {inter_mb:.2f} MB inter-node")
    return f"{windows}{zero}\n{zero}\n{valid}{ended}\n"


def _write(directory, runs: dict) -> None:
    for name, args in runs.items():
        (directory / f"{name}.log").write_text(_log(*args))
    (directory / "nocomm-rank1.log").write_text("rank 1 says nothing the report reads\n")


def test_report_meets_the_targets(tmp_path):
    _write(tmp_path, {"plain": (180, 20, None, 13.3),
                      "plain-unshaped-200": (950, 200, 5.0, 13.3),
                      "plain-unshaped-1000": (950, 1000, 4.0, 13.3),
                      "nocomm": (1000, 300, None, 0.0),
                      "diloco-h10-bf16": (880, 200, 5.05, 0.66),
                      "diloco-h50-bf16": (950, 1000, 4.06, 0.13)})
    result = bench_diloco.report(tmp_path)
    runs = result["runs"]
    assert set(runs) == {"plain", "plain-unshaped-200", "plain-unshaped-1000", "nocomm",
                         "diloco-h10-bf16", "diloco-h50-bf16"}
    assert runs["diloco-h50-bf16"]["outer_steps"] == 20
    assert runs["diloco-h10-bf16"]["of_limit"] == pytest.approx(0.88)
    assert runs["diloco-h10-bf16"]["loss_vs_plain"] == pytest.approx(0.01)  # plain's 200 steps
    assert runs["diloco-h50-bf16"]["loss_vs_plain"] == pytest.approx(0.015)
    assert result["all_reduce_vs_inner_step"] == pytest.approx(1000 / 180 - 1)
    assert all(result["targets"].values()), result["targets"]
    assert runs["plain"]["block_tokens_per_s"] is None  # 20 iterations: no whole block
    assert ("| diloco-h50-bf16 | 1000 | 950 | 95.0% | 950 (950-950, 19) | 0.130 | 20 | 4.0600 | "
            "+1.50% |") in \
        bench_diloco.table(result)


def test_report_names_what_is_missed(tmp_path):
    _write(tmp_path, {"plain": (400, 20, None, 13.3),
                      "plain-unshaped-500": (950, 500, 4.1, 13.3),
                      "nocomm": (1000, 1000, None, 0.0),
                      "diloco-h50-int8": (850, 500, 4.2, 0.07)})
    targets = bench_diloco.report(tmp_path)["targets"]
    assert [name for name, met in targets.items() if not met] == [
        "plain DP <= 25% of the limit", "plain DP's all-reduce >= 3x an inner step",
        "DiLoCo H=50 >= 90% of the limit", "DiLoCo H=50: >= 20 outer steps",
        "DiLoCo's final loss within 2% of plain DP's (unshaped)"]


def test_a_run_without_its_end_line_stops_the_report(tmp_path):
    _write(tmp_path, {"plain": (180, 20, None, 13.3),
                      "plain-unshaped-1000": (950, 1000, 4.0, 13.3),
                      "nocomm": (1000, 1000, None, 0.0)})
    (tmp_path / "diloco-h50-bf16.log").write_text("error: DiLoCo's replicas differ ...\n")
    with pytest.raises(SystemExit, match="diloco-h50-bf16.log: no 'run ended' line"):
        bench_diloco.report(tmp_path)


def test_a_run_without_its_plain_dp_reference_stops_the_report(tmp_path):
    _write(tmp_path, {"plain": (180, 20, None, 13.3),
                      "plain-unshaped-1000": (950, 1000, 4.0, 13.3),
                      "nocomm": (1000, 300, None, 0.0), "diloco-h10-bf16": (880, 200, 4.1, 0.66)})
    with pytest.raises(SystemExit, match="no evaluated plain-unshaped-200.log, the reference of "
                                         "diloco-h10-bf16"):
        bench_diloco.report(tmp_path)


def test_blocks_are_whole_and_skip_the_first():
    windows = [(it, 100.0 if it <= 50 else 200.0 if it % 50 else 50.0) for it in range(10, 171, 10)]
    # blocks 51-100 and 101-150: four windows at 200 tokens/s and one at 50, by time: 125
    assert bench_diloco.blocks(windows) == [pytest.approx(125.0)] * 2
