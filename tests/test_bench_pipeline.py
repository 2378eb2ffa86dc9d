"""The pipeline-schedule benchmark (benchmarks/bench_pipeline.py, run over emulated links by
bench_pipeline_netns.sh) stays runnable: its two workers on localhost (2 gloo ranks, one tiny
GPT, every schedule and control) write one row per schedule with every field the report reads,
measured bubbles in [0, 1), memory that grows with the micro-batches a schedule keeps in
flight, the split backward's B and W beside F and B (ZB-H1's prediction runs them), auto's row
naming the schedule it ran; the report prints the table and checks the target (no timing
assertions)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from dist_utils import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks", "bench_pipeline.py")
SCRIPT = os.path.join(REPO, "benchmarks", "bench_pipeline_netns.sh")
TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq", "16", "--mbs", "2",
        "--vocab", "101", "--micro", "4", "--warmup", "1", "--steps", "2", "--repeats", "2"]


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True, timeout=30)


def test_two_ranks_on_localhost_write_every_field(tmp_path):
    port = str(free_port())
    workers = [subprocess.Popen([sys.executable, BENCH, "worker", "--rank", str(rank), "--port",
                                 port, "--out", str(tmp_path), *TINY], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for rank in (0, 1)]
    for worker in workers:
        output, _ = worker.communicate(timeout=400)
        assert worker.returncode == 0, output[-3000:]
    report = subprocess.run([sys.executable, BENCH, "report", str(tmp_path), "--json",
                             str(tmp_path / "results.json")], capture_output=True, text=True,
                            timeout=60)
    assert report.returncode == 0, report.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    names = [row["schedule"] for row in rows]
    assert names == list(bench.DEFAULT_RUN)
    for row in rows:
        assert row["rate"] == "none" and row["stages"] == 2 and row["micro"] == 4
        assert len(row["load_average"]) == 2 and row["cpus"] >= 1
        assert len(row["step_s"]) == 2 and row["step_median_s"] > 0
        assert row["c_s"] > 0 and len(row["fb_s"]) == 2 and min(row["fb_s"]) > 0
        assert row["c_over_fb"] == row["c_s"] / max(row["fb_s"])
        assert row["activation_bytes"] == 4 * 16 * 2 * 32
        assert 0 < row["bubble_formula"] < 1
        for stage in row["per_stage"]:
            assert all(0 <= bubble < 1 for bubble in stage["bubble"]), row
            assert stage["peak_saved_bytes"] > 0 and stage["peak_in_flight"] >= 1
    by = {row["schedule"]: row for row in rows}
    first = [by[name]["per_stage"][0] for name in ("1f1b", "eager-1f1b")]
    # Stage 0 of 2 keeps 2 micro-batches in flight under 1F1B, 3 under eager-1F1B.
    assert [stage["peak_in_flight"] for stage in first] == [2, 3]
    assert first[0]["peak_saved_bytes"] < first[1]["peak_saved_bytes"]
    assert by["interleaved"]["bubble_formula"] == 1 / (2 * 4 + 1)
    assert by["zb-h1"]["runs"] == "zb-h1" and by["1f1b/no-prefetch"]["runs"] == "1f1b"
    assert by["auto"]["runs"] in ("1f1b", "eager-1f1b", "zb-h1")
    for row in rows:
        assert [len(stage) for stage in row["chunk_split_s"]] == [2 * row["chunks"]] * 2
        assert min(min(stage) for stage in row["chunk_split_s"]) > 0
        assert bench.predicted_step(row) > 0
    assert "eager-1f1b" in report.stdout and "target" in report.stdout


def _row(rate: str, schedule: str, step: float, ratio: float) -> dict:
    return {"rate": rate, "schedule": schedule, "step_median_s": step, "c_over_fb": ratio,
            "step_s": [step, 2 * step]}


def test_target_applies_where_the_link_is_slow():
    rows = [_row("1000mbit", "1f1b", 1.0, 0.05), _row("1000mbit", "eager-1f1b", 1.0, 0.05),
            _row("100mbit", "1f1b", 1.5, 0.6), _row("100mbit", "eager-1f1b", 1.0, 0.6),
            _row("10mbit", "1f1b", 1.0, 2.0), _row("10mbit", "eager-1f1b", 1.0, 2.0)]
    lines = bench.check_target(rows)
    assert lines[0].endswith(": n/a)") and "1.00x" in lines[0]
    assert "1.50x 1f1b (paired 1.50x" in lines[1] and lines[1].endswith(": met)")
    assert lines[2].endswith(": MISSED)")
