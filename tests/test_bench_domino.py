"""benchmarks/bench_domino.py's testbed logic: each --link names distinct NCCL variables and
clears the others; bus bandwidth, message sizes, the communication share and auto's choice
against the best measured plan are computed as domino_report.py documents; the flags refuse what
cannot run; and a short run on two gloo ranks writes every column for every round, the
collectives' bandwidth and auto's choice (no timing assertions). The namespace script parses."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from dist_utils import free_port
from megadomino.config import ModelConfig
from megadomino.overlap.domino import autotune

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")


def _load_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_domino", os.path.join(BENCHMARKS, "bench_domino.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
links, report = bench.links, bench.report  # its helper modules, as it imported them


def test_each_link_sets_its_variables_and_clears_the_others():
    shell = {"PATH": "/bin", "NCCL_P2P_DISABLE": "1", "NCCL_MAX_NCHANNELS": "2",
             "NCCL_DEBUG": "WARN"}
    assert links.link_environment("nvlink", shell) == {"PATH": "/bin", "NCCL_DEBUG": "WARN"}
    pcie = links.link_environment("pcie", shell)
    assert pcie["NCCL_P2P_DISABLE"] == "1" and "NCCL_MAX_NCHANNELS" not in pcie
    one = links.link_environment("pcie-1ch", {})
    assert one["NCCL_P2P_DISABLE"] == one["NCCL_MAX_NCHANNELS"] == one["NCCL_MAX_CTAS"] == "1"
    socket = links.link_environment("socket", {})
    assert socket["NCCL_SHM_DISABLE"] == socket["NCCL_IB_DISABLE"] == "1"
    assert socket["NCCL_SOCKET_IFNAME"] == "lo"
    settings = [tuple(sorted(link.env.items())) for link in links.LINKS.values()]
    assert len(set(settings)) == len(settings)
    assert all(name.startswith("NCCL_") for name in links.MANAGED)
    with pytest.raises(ValueError, match="--link 'ethernet' is unknown"):
        links.link_environment("ethernet", {})
    assert links.link_carries_fused_sp("nvlink") and links.link_carries_fused_sp(None)
    assert not any(links.link_carries_fused_sp(name) for name in links.LINKS if name != "nvlink")
    help_text = links.link_help()
    assert all(f"{name}: " in help_text for name in links.LINKS)


def test_bus_bandwidth_and_message_sizes():
    assert links.bus_bandwidth("all_reduce", 10**9, 1.0, 4) == pytest.approx(1.5)
    assert links.bus_bandwidth("reduce_scatter", 10**9, 0.5, 4) == pytest.approx(1.5)
    assert links.bus_bandwidth("all_gather", 10**9, 1.0, 2) == pytest.approx(0.5)
    per_sequence = 2048 * 4096
    assert links.message_numels(2048, 4096, 4, [1, 2, 4]) == [
        4 * per_sequence, 2 * per_sequence, per_sequence]
    # uneven slices: the largest one (5 sequences in 2 slices: 3 and 2); N > batch is never run
    assert links.message_numels(16, 8, 5, [2, 8]) == [5 * 128, 3 * 128]


def test_comm_share_serial_estimate_and_auto_against_best():
    share = report.comm_share([10.0, 12.0, 11.0], [8.0, 9.0, 8.8])
    assert share["median"] == pytest.approx(0.2) and share["min"] == pytest.approx(0.2)
    assert share["max"] == pytest.approx(0.25)
    assert report.comm_share([10.0], []) is None
    assert report.serial_comm_share(0.5, 10.0) == pytest.approx(0.2)
    assert report.serial_comm_share(None, 10.0) is None
    plans = [(1, 1, False), (1, 1, True), (2, 1, True), (4, 1, True)]
    ms = {"b_plain_tp": 10.0, "e_domino_N1_K1": 9.9, "e_domino_N2_K1": 9.0, "a_no_comm": 1.0}
    missed = report.auto_vs_best(ms, plans, 1)
    assert missed["choice"] == "e_domino_N1_K1" and missed["best"] == "e_domino_N2_K1"
    assert missed["ratio"] == pytest.approx(1.1) and missed["within"] is False
    assert missed["missing"] == ["e_domino_N4_K1"]
    assert report.auto_vs_best(ms, plans, 2)["within"] is True
    assert "ratio" not in report.auto_vs_best(ms, plans, 3)  # its choice was not measured


def _row() -> dict:
    return {"row": "gpt3-6.7b", "tp": 2, "link": "pcie", "message_numel": 1024,
            "ms_rounds": {"a_no_comm": [6.0, 6.2, 5.8], "b_plain_tp": [10.0, 10.4, 9.0],
                          "e_domino_N1_K1": [9.5, 9.4, 9.6], "e_domino_N2_K1": [8.0, 8.1, 7.9]},
            "host_rounds": {"a_no_comm": [1.0, 1.0, 1.0]},
            "collectives": {"1024": {"bytes": 2048, "all_reduce": {"ms": 1.0, "bus_gbps": 2.0},
                                     "reduce_scatter": {"ms": 0.5, "bus_gbps": 2.0},
                                     "all_gather": {"error": "RuntimeError: no"}}},
            "auto": {"plans": [[1, 1, False], [1, 1, True], [2, 1, True]], "choice": 1}}


def test_finish_row_and_tables():
    row = _row()
    report.finish_row(row)
    assert row["ms_per_layer"]["b_plain_tp"] == 10.0
    assert row["ms_range"]["b_plain_tp"] == [9.0, 10.4]
    assert row["best_domino"] == "e_domino_N2_K1"
    assert row["comm_share"]["median"] == pytest.approx(0.4)
    assert row["serial_comm_share"] == pytest.approx(0.4)
    assert row["auto"]["vs_best"]["ratio"] == pytest.approx(9.5 / 8.0)
    for text in (report.table, report.columns_table, report.link_table):
        header, rule, *body = text([row]).splitlines()
        assert len(header.strip("|").split("|")) == rule.count("---")
        assert all(len(line.strip("|").split("|")) == rule.count("---") for line in body)
    cells = [c.strip() for c in report.link_table([row]).splitlines()[2].strip("|").split("|")]
    assert cells[2:5] == ["pcie", "0.00", "2 / 2 / -"]
    assert cells[5] == "40% (36%-40%)" and cells[-1] == "1.188 MISSED"


def test_flags_refuse_what_cannot_run(capsys):
    for argv in (["--device", "cpu", "--link", "pcie"], ["--rows", "gpt3-175b"],
                 ["--rounds", "0"], ["--link", "infiniband"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert "error:" in capsys.readouterr().err
    args = bench.parse_args(["--rows", "link"])
    assert args.link == "nvlink" and args.dtype == "bfloat16"
    assert args.rows == ["gpt3-6.7b", "gpt3-6.7b-mb8", "llama2-7b", "llama2-7b-mb8"]
    assert set(autotune.CANDIDATES) <= set(args.plans)  # the default sweep has auto's plans
    cpu = bench.parse_args(["--device", "cpu", "--tag", "netns 300 Mbit/s"])
    assert cpu.link is None and cpu.link_label == "netns 300 Mbit/s" and cpu.dtype == "float32"
    for name in bench.ROWS:
        config, _, micro_batch = bench.model_config(name, 1, "float32")
        assert isinstance(config, ModelConfig) and micro_batch >= 2


def test_two_gloo_ranks_write_every_column_every_round(tmp_path):
    out = tmp_path / "domino.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), os.path.join(BENCHMARKS, "bench_domino.py"),
         "--device", "cpu", "--rows", "cpu-llama", "--layers", "1", "--warmup", "1", "--iters",
         "1", "--rounds", "2", "--plans", "1x1,2x1", "--peers", "", "--comm-overlap", "--auto",
         "--tag", "loopback", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["link"] == "loopback" and run["world"] == 2
    (row,) = run["results"]
    columns = {"a_no_comm", "b_plain_tp", "a_sp_no_comm", "b_plain_tp_sp", "f_sp_comm_overlap",
               "e_domino_N1_K1", "e_domino_N2_K1"}
    assert set(row["ms_rounds"]) == columns
    assert all(len(times) == 2 for times in row["ms_rounds"].values())
    full = row["collectives"][str(row["message_numel"])]
    assert all(full[name]["bus_gbps"] > 0 for name in ("all_reduce", "reduce_scatter",
                                                         "all_gather"))
    assert row["comm_share"] is not None and row["serial_comm_share"] > 0
    config, _, micro_batch = bench.model_config("cpu-llama", 1, "float32")
    plans = autotune.candidates(config, 2, micro_batch)
    assert [tuple(plan) for plan in row["auto"]["plans"]] == plans
    vs_best = row["auto"]["vs_best"]
    assert vs_best["choice"] == report.plan_column(*plans[row["auto"]["choice"]])
    assert sorted(vs_best["missing"]) == ["e_domino_N1_K2", "e_domino_N2_K2", "e_domino_N4_K1"]
    assert "domino auto: " in proc.stdout and "| comm share of plain TP" in proc.stdout


def test_namespace_script_parses():
    subprocess.run(["bash", "-n", os.path.join(BENCHMARKS, "bench_domino_netns.sh")],
                   check=True, timeout=30)
