"""The training-resharding benchmark (benchmarks/bench_reshard_train.py, gpu_suite.sh's
`reshard-train` on GPUs) stays runnable: 3 gloo ranks at a tiny shape write one row per (plan,
boundary, direction, strategy) of every 3-rank plan, each with its rounds, bound, ratios and
auto's choice; each explicit strategy runs what it names, and the busiest-link bytes are each
strategy's closed form (so the rows time different mechanisms); a plan that does not fit the
world is refused with one line. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

from dist_utils import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks", "bench_reshard_train.py")
TINY = ["--device", "cpu", "--seq", "8", "--micro-batch", "2", "--hidden", "16", "--warmup",
        "1", "--iters", "2", "--rounds", "3"]
TILE = 8 * 2 * 16 * 4  # the whole fp32 activation, bytes

_SPEC = importlib.util.spec_from_file_location("bench_reshard_train", BENCH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def torchrun(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "3", "--master_port", str(free_port()), BENCH, *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_three_gloo_ranks_write_every_field(tmp_path):
    out = tmp_path / "reshard_train.json"
    proc = torchrun(tmp_path, *TINY, "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert (run["world"], run["backend"], run["shape"], run["dtype"]) == (
        3, "gloo", [8, 2, 16], "float32")
    assert run["plans"] == ["tp2_tp1", "dp2_dp1", "tp1_tp2"]
    rows = run["rows"]
    keys = [(r["plan"], r["boundary"], r["direction"], r["strategy"]) for r in rows]
    assert keys == [(plan, 0, direction, strategy) for plan in run["plans"]
                    for direction in bench.DIRECTIONS for strategy in bench.STRATEGIES]
    for row in rows:
        assert len(row["ms_rounds"]) == 3 and row["ms"] == statistics.median(row["ms_rounds"])
        assert row["bound_ms"] > 0 and row["x_bound"] == row["ms"] / row["bound_ms"]
        assert row["predicted_ms"] > 0 and row["auto_predicted_ms"] > 0
        assert row["auto_choice"] in bench.STRATEGY_OF and " predicted " in row["describe"]
        if row["strategy"] != "auto":
            assert row["runs"] == row["strategy"]
    for key in {(r["plan"], r["direction"]) for r in rows}:
        same = {r["strategy"]: r for r in rows if (r["plan"], r["direction"]) == key}
        named = [same[name] for name in bench.STRATEGY_OF]
        assert min(r["x_fastest"] for r in named) == 1.0
        assert same["auto"]["runs"] == same["auto"]["auto_choice"]
        assert same["auto"]["boundary_bound_ms"] == min(r["bound_ms"] for r in named)
    # TP1 -> TP2's activation and TP2 -> TP1's gradient: one rank to two replicas. send/recv
    # sends it twice, gloo's broadcast tree from the root twice too, the scatter half to each
    # replica, which then swap halves.
    busiest = {(r["plan"], r["direction"], r["strategy"]): r["busiest_bytes"] for r in rows}
    for plan, direction in (("tp1_tp2", "activation"), ("tp2_tp1", "gradient")):
        assert [busiest[(plan, direction, name)] for name in bench.STRATEGY_OF] == [
            2 * TILE, 2 * TILE, TILE]
    assert busiest[("tp2_tp1", "activation", "send-recv")] == TILE
    assert busiest[("dp2_dp1", "activation", "send-recv")] == TILE  # two halves into rank 2
    assert {p["bytes"] for p in run["p2p"]} == {r["busiest_bytes"] for r in rows}
    assert all(p["gbps"] > 0 and len(p["ms_rounds"]) == 3 for p in run["p2p"])
    assert len(run["targets"]) == 6 and all(line.startswith("target ") for line in
                                            run["targets"])
    assert "tp2_tp1 auto: boundary 0 -> 1 activation" in proc.stdout
    assert "P2P ranks 0 -> 1" in proc.stdout and "x fastest" in proc.stdout


def test_a_plan_of_another_world_is_refused():
    assert bench.plans_for(None, 3) == (["tp2_tp1", "dp2_dp1", "tp1_tp2"], None)
    assert bench.plans_for(["dp2_tp2"], 4) == (["dp2_tp2"], None)
    _, error = bench.plans_for(["tp2_tp1", "dp2_tp2"], 3)
    assert error.startswith("error: --plans: dp2_tp2 takes 4 ranks, this world has 3;")
    assert bench.plans_for(None, 2)[1].startswith("error: no plan of 2 ranks;")


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--plans", "tp3_tp1"],
                                  ["--warmup", "-1"]])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_defaults_are_a_gpt3_1_3b_boundary():
    args = bench.parse_args(["--device", "cuda"])
    assert (args.seq, args.micro_batch, args.hidden, args.dtype) == (2048, 4, 2048, "bfloat16")
    assert {sum(len(ranks) for ranks, _ in stages) for stages in bench.PLANS.values()} == {3, 4}


def test_veth_counts_each_hosts_interface_bytes(tmp_path):
    """--veth / --host-of (bench_reshard_train_netns.sh): the first rank of each host reads
    its interface around every row; here the loopback of one host, which every transfer
    crosses, so each row counts bytes both ways and prints the host table."""
    out = tmp_path / "wire.json"
    proc = torchrun(tmp_path, *TINY, "--plans", "tp1_tp2", "--veth", "lo", "--host-of", "0",
                    "0", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert all(list(row["wire_per_host"]) == ["0"] and min(row["wire_per_host"]["0"]) > 0
               and row["activation_bytes"] == TILE for row in rows)
    assert "host link bytes per transfer, in activations" in proc.stdout


def test_veth_needs_the_host_map():
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--veth", "lo"])


def test_profile_needs_cuda():
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--profile"])
