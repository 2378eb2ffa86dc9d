"""The placement benchmark's parts (benchmarks/bench_placement.py, run over three emulated sites
by bench_placement_netns.sh) at tiny size, without namespaces: the script parses; `plans` turns
a measurement and ours into the four runs' plan files with predicted steps (rank order: rank r is
stage r); `report` reads rounds of logs into medians, paired ratios and the targets' verdicts;
the TCP probe moves its bytes on localhost and prints a rate. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading

from dist_utils import free_port
from megadomino.cli.arguments import parse_args
from megadomino.config.pipeline_plan import plan_file, read_plan
from megadomino.pipeline.placement.cost import Machine, Workload
from megadomino.pipeline.placement.planners import op_fence
from megadomino.pipeline.placement.resolve import rules_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks", "bench_placement.py")
SCRIPT = os.path.join(REPO, "benchmarks", "bench_placement_netns.sh")
FLAGS = ["--model-preset", "gpt-tiny", "--num-layers", "4", "--mock-data",
         "--untie-embeddings-and-output-weights", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "1"]


def _load():
    spec = importlib.util.spec_from_file_location("bench_placement", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True, timeout=30)


def _three_sites() -> Machine:
    """A = ranks 0, 1 (100 Mbit/s), C = rank 2 (10 Mbit/s), B = rank 3 (100 Mbit/s)."""
    site, rate = [0, 0, 1, 2], [12.5e6, 1.25e6, 12.5e6]
    bandwidth = [[1.25e9 if site[i] == site[j] else min(rate[site[i]], rate[site[j]])
                  for j in range(4)] for i in range(4)]
    return Machine.uniform([1e9, 1e9, 1e9, 5e8], bandwidth, 1e-4)


def test_plans_are_written_for_every_run(tmp_path):
    (tmp_path / "measure").mkdir()
    machine = _three_sites()
    config, _ = parse_args(FLAGS, "gpt")
    plan = op_fence(Workload.from_config(config), machine, rules_of(config)).plan
    (tmp_path / "measure" / "plan.json").write_text(plan_file(plan))
    (tmp_path / "measure" / "links.json").write_text(json.dumps(
        {"machine": json.loads(machine.to_json())}))
    made = bench.plans(bench.parse(["plans", str(tmp_path), "--", *FLAGS]))
    assert list(made) == list(bench.PLANS)
    assert made["rank-order"]["stages"] == [[0], [1], [2], [3]]
    assert made["ours"]["stages"] == [list(stage.ranks) for stage in plan.stages]
    for name, row in made.items():
        assert read_plan(row["file"], 4).size == len(row["stages"])
        assert (row["predicted_step"] is None) == (name == "nocomm")
    written = json.loads((tmp_path / "plans.json").read_text())
    assert written["ours"]["predicted_step"] > 0


def _log(milliseconds: list[float]) -> str:
    return "".join(f" iteration {i:>8}/{len(milliseconds):>8} | loss 1.0 | {ms:.1f} ms/iter |\n"
                   for i, ms in enumerate(milliseconds, start=1))


def test_the_report_pairs_rounds_and_checks_the_targets(tmp_path, capsys):
    steps = {"rank-order": 400.0, "dt-fm": 300.0, "ours": 250.0, "nocomm": 50.0}
    for round_ in (1, 2, 3):
        for name, ms in steps.items():
            (tmp_path / f"round{round_}-{name}.log").write_text(
                _log([9000.0] * 2 + [ms * (1 + 0.01 * round_)] * 4))
    (tmp_path / "plans.json").write_text(json.dumps(
        {name: {"predicted_step": None if name == "nocomm" else 1.1 * 1.02 * ms / 1e3}
         for name, ms in steps.items()}))
    lines = bench.report(bench.parse(["report", str(tmp_path), "--warmup", "2", "--tokens",
                                      "1000"]))
    text = "\n".join(lines)
    assert "ours' speedup over rank-order: paired 1.60x (target >= 1.3x: met)" in text
    assert "ours' speedup over dt-fm: paired 1.20x (target >= 0.97x: met)" in text
    assert "ours' step over the no-communication limit's: paired 5.00x (target >= 4.5x: met)" \
        in text
    assert "prediction error: median 10% (target <= 15%), largest 10% (target <= 30%)" in text
    assert capsys.readouterr().out.strip() == text


def test_the_probe_moves_its_bytes_on_localhost(capsys):
    port = free_port()
    sender = threading.Thread(target=bench.main,
                              args=(["probe-send", "127.0.0.1", str(port), str(1 << 20)],))
    sender.start()
    rate = bench.probe_recv(bench.parse(["probe-recv", str(port), str(1 << 20)]))
    sender.join(timeout=60)
    assert rate > 0 and capsys.readouterr().out.strip() == f"{rate:.1f}"


def test_the_module_runs_as_a_command():
    result = subprocess.run([sys.executable, BENCH, "--help"], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0 and "plans" in result.stdout, result.stderr[-2000:]
