"""The resharding benchmark over emulated hosts (benchmarks/bench_reshard_netns.sh): its cases
plan, its report checks the targets (and says when one is missed), and, in the slow tier, a
short real run over rate-limited namespaces where the bytes each host's veth counted match the
plan's per-link bytes (so the link model, gloo's broadcast tree included, is what goes on the
wire) and no namespace is left behind."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from test_two_node import _namespaces, _netns_permitted

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_reshard_netns.sh")


def _load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_reshard", os.path.join(REPO, "benchmarks", "bench_reshard.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True, timeout=30)


def test_headline_plans_put_the_expected_copies_on_the_source_uplink():
    plans = bench.configs(bench.CASES["1-to-m/2x2"], rate=50e6)
    tensor = 64 << 20
    up_a = {key[0]: plan.link_bytes()[("up", "A")] for key, plan in plans.items()}
    assert up_a == {"send_recv": 4 * tensor, "send_recv_allgather": tensor,
                    "broadcast": 3 * tensor, "chained_broadcast": tensor}
    assert max(len(bench.CASES[name].host_index()) for name in bench.CASES) <= 10
    assert max(max(bench.CASES[name].host_index()) for name in bench.CASES) < 5  # MAX_HOSTS


def _row(case, strategy, solvers, median, bound=1.0):
    return {"case": case, "strategy": strategy, "solvers": solvers, "median_s": median,
            "bound_s": bound, "seconds": [median]}


def test_report_checks_the_targets():
    rows = [_row("1-to-m/2x2", "send_recv", ["none"], 4.2, 4.0),
            _row("1-to-m/2x2", "chained_broadcast", ["none"], 1.1, 1.0),
            _row("n-to-m/case2", "broadcast", ["none"], 0.7),
            _row("n-to-m/case2", "broadcast", ["least_bytes"], 0.8)]
    lines = bench.check_targets(rows)
    assert lines[0].startswith("headline: chained broadcast 1.10x its bound")
    assert "3.82x faster than send/recv" in lines[0]
    assert lines[1:] == ["slower than no balancing: n-to-m/case2 broadcast least_bytes: "
                         "0.800 s > 0.700 s (bounds 1.000 / 1.000 s)"]


@pytest.mark.slow
def test_short_run_over_namespaces(tmp_path):
    reason = _netns_permitted()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, CASES="1-to-m/1x2 n-to-m/case5", REPEATS="1", RATE_MBIT="800",
               OUT_DIR=str(tmp_path), RUN_TIMEOUT="240", PYTHON=sys.executable)
    run = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "results.json").read_text())
    assert {row["case"] for row in rows} == {"1-to-m/1x2", "n-to-m/case5"}
    for row in rows:
        for link, modeled in row["link_bytes"].items():
            measured = row["wire_bytes"][link]
            assert 0.9 * modeled <= measured <= 1.1 * modeled, (row["strategy"], link, row)
    made = set(re.findall(r"mdr-\d+-\w+", run.stderr))
    assert not made & _namespaces(), f"the script left {made & _namespaces()} behind"
