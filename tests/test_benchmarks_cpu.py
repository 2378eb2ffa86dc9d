"""The benchmarks that run on CPU stay runnable: tiny settings, output checked for its rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_quant_host_overhead_prints_every_wrapper():
    out = run("benchmarks/quant_host_overhead.py", "--calls", "5")
    for name in ("quantize", "PayloadLayout.views", "swizzled_quantize into a payload",
                 "dequantize_reduce", "dequantize_reduce_quantize"):
        assert f"{name}: " in out and "us per call" in out, out


def test_zero_host_overhead_times_both_stages(tmp_path):
    out = run("benchmarks/zero_host_overhead.py", "--layers", "2", "--backwards", "4",
              "--warmup", "1", "--out", str(tmp_path / "host.json"))
    assert "stage 3: hooks" in out and "stage 1: hooks" in out, out
    assert (tmp_path / "host.json").exists()


def test_layer_tp1_table_has_the_graphed_domino_column():
    """bench_layer_tp1.py runs on a GPU only; its table (pure) puts the product's graphed Domino
    host time beside the eager Domino's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_layer_tp1", ROOT / "benchmarks" / "bench_layer_tp1.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = {"row": "gpt3-6.7b", "ms_per_layer": {"domino_2x1_eager": 20.5,
                                                   "domino_2x1_graphed": 19.25},
              "host_ms_per_layer": {"domino_2x1_eager": 3.61, "domino_2x1_compiled": 4.5,
                                    "domino_2x1_graphed": 0.12}}
    header, rule, row = bench.table([result]).splitlines()
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    names = [cell.strip() for cell in header.strip("|").split("|")]
    assert len(cells) == len(names) == rule.count("---")
    assert cells[names.index("Domino 2x1 eager / compiled / graphed, host ms")] == \
        "3.61 / 4.50 / 0.12"
    assert cells[names.index("Domino 2x1 graphed")] == "19.25"


def test_codec_bench_times_every_codec(tmp_path):
    out = run("benchmarks/bench_codec.py", "--seq", "16", "--micro-batch", "2", "--hidden",
              "128", "--iters", "2", "--densities", "0.05", "--out", str(tmp_path / "c.json"))
    for op in ("copy", "int8 encode", "int8 decode", "int4 encode", "int4 decode",
               "adatopk select (torch.topk) d=0.05", "adatopk encode d=0.05"):
        assert f"| {op} |" in out, out
    assert (tmp_path / "c.json").exists()


def test_codec_netns_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "bench_codec_netns.sh")], check=True,
                   timeout=60)
