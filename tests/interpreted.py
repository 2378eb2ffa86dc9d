"""Triton kernels run on CPU only under Triton's interpreter, which must be chosen before triton
is first imported: a kernel test module runs its cases in one subprocess started with
TRITON_INTERPRET=1 (the module run as a script prints `run_cases`' results as JSON, the last line
of its output), and each pytest case reports its own result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable

import pytest

from megadomino.kernels.quant_launch import HAS_TRITON


def run_cases(cases: dict[str, tuple], check: Callable[..., None]) -> dict[str, str | None]:
    """check(*args) for each case: None where it passed, else its traceback."""
    results = {}
    for name, args in cases.items():
        try:
            check(*args)
            results[name] = None
        except Exception:  # reported per case by the module's test
            results[name] = traceback.format_exc(limit=3)
    return results


def interpreted_results(script: str) -> dict[str, str | None]:
    """The results `script` prints when run under Triton's interpreter."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (the test extra brings it where a wheel exists)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreted_test(script: str, cases: dict[str, tuple]) -> Callable[[str], None]:
    """A test parametrized by the names of `cases`: the first case runs `script` under the
    interpreter (all cases, one subprocess), each case then asserts its own result."""
    results: dict[str, str | None] = {}

    @pytest.mark.parametrize("case", list(cases))
    def test(case: str) -> None:
        if not results:
            results.update(interpreted_results(script))
        assert results[case] is None, results[case]
    return test
