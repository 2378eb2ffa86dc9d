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
