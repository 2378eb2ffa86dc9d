"""FP8 linears' memory on CPU, in live tensor bytes (benchmarks/fp8_memory_cpu.py's LiveBytes:
every storage an aten op makes, from its creation to its release): a GPT layer stack with FP8
linears against the same stack in bf16, and one eager cast. Byte counts, no timing.

What FP8 adds to a layer is its weights' 1-byte codes in both layouts (row-major for the forward
GEMM, transposed for backward's dx GEMM), cast once per weight value and kept for the step's
micro-batches (tp/fp8.py), and the cast's transient; what it saves is half of each linear input
kept for backward (1 byte an element, not 2). At the 6.7B row's ratios (tokens = 2 x hidden)
that nets to about 1.15x bf16's peak, measured at a step's first micro-batch (where the codes
are made); keeping anything more per linear (the row-major FP8 input beside its transpose, a
third weight copy, a second fp32 copy in the cast) goes past the bounds below."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from megadomino.config import FP8Recipe
from megadomino.tp.fp8 import E4M3, E5M2, cast_operand

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)

from fp8_memory_cpu import LiveBytes, gpt_config, layer_stack_memory  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_process_group")


def test_fp8_layer_stack_peak_stays_near_bf16():
    config = gpt_config(hidden=128, layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        bf16 = layer_stack_memory(config, None)
        fp8 = layer_stack_memory(config, FP8Recipe())
    assert fp8["base"] - bf16["base"] < 4096  # the scaling state: a few scalars per linear
    assert fp8["after_forward"] < 1.25 * bf16["after_forward"], (fp8["after_forward"],
                                                                 bf16["after_forward"])
    ratio = (fp8["base"] + fp8["peak"]) / (bf16["base"] + bf16["peak"])
    assert ratio < 1.17, f"FP8 peak {ratio:.3f} x bf16's"


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_eager_cast_keeps_one_fp32_copy_alive(dtype):
    """cast_operand of a bf16 [M, K] operand with its transpose and amax: at most the fp32 copy
    (4 bytes an element) and the FP8 result (1) alive at once, besides scalars."""
    x = torch.randn(256, 320, dtype=torch.bfloat16)
    meter = LiveBytes([x])
    with meter:
        q, q_t, _, _ = cast_operand(x, torch.tensor(3.0), dtype, True, True)
    assert torch.equal(q_t.view(torch.uint8), q.t().contiguous().view(torch.uint8))
    assert meter.peak <= 5 * x.numel() + 1024, meter.at_peak


def test_cpu_study_runs_and_finds_no_leftovers_after_collecting():
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "fp8_memory_cpu.py"),
                           "--hidden", "128", "--top", "3"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "fp8 / bf16 peak: " in out, out
    collected = out.split("with gc.collect() before each")[1].splitlines()[1:]
    assert len(collected) == 4 and all(" 0.00 MiB" in line for line in collected), out
