"""The multi-process harness itself: a hang ends in bounded time naming the case (by the rank's
faulthandler, or by the parent when a rank cannot be ended from inside), a crash in setup
or in a rank shows why, a case is registered once, a case's slow worlds are the slow tier, and a
suite no test asserts is refused at collection."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import C, DistSuite, run_world

HERE = os.path.dirname(__file__)


def passes() -> None:
    dist.barrier()


def deadlocks(rank: int) -> None:
    """Each rank waits for a message the other never sends."""
    dist.recv(torch.zeros(1), src=1 - rank)


def hangs_beyond_faulthandler(rank: int) -> None:
    """Rank 1 disarms its faulthandler (as a rank stuck inside a driver call cannot be ended by
    it) and sleeps; rank 0 finishes the case."""
    if rank == 1:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
        time.sleep(600)


def broken_setup(world: int) -> dict:
    raise ZeroDivisionError("setup broke on purpose")


def rank_dies(rank: int) -> None:
    if rank == 1:
        os._exit(7)
    dist.barrier()


def test_a_deadlocked_case_times_out_naming_itself_and_its_stack():
    suite = DistSuite(worlds=(2,), timeout=30)
    suite.case("before", passes)
    suite.case("hangs", deadlocks, C.rank, timeout=3)
    suite.case("after", passes)
    start = time.monotonic()
    results = run_world(suite, 2)
    assert time.monotonic() - start < 60, "the hanging world was not ended in bounded time"
    assert results["before"] is None
    assert "case 'hangs' timed out" in results["hangs"], results["hangs"]
    assert "deadlocks" in results["hangs"], "the stack of the stuck rank is not shown"
    assert "timed out" in results["after"], results["after"]


def test_a_case_that_overruns_its_budget_is_ended_by_the_parent_naming_the_waiting_rank():
    suite = DistSuite(worlds=(2,), timeout=30, grace=2)
    suite.case("stuck", hangs_beyond_faulthandler, C.rank, timeout=2)
    suite.case("after", passes)
    start = time.monotonic()
    results = run_world(suite, 2)
    assert time.monotonic() - start < 30, "the parent did not end the world after the budget"
    assert ("case 'stuck' overran its budget of 2 s (+2 s grace); ranks still in it: [1]"
            in results["stuck"]), results["stuck"]
    assert "overran" in results["after"], results["after"]


def test_a_crash_in_setup_shows_its_traceback_in_every_case():
    suite = DistSuite(worlds=(2,))
    suite.setup(broken_setup)
    suite.case("first", passes)
    suite.case("second", passes)
    results = run_world(suite, 2)
    for case in ("first", "second"):
        assert "setup failed" in results[case], results[case]
        assert "ZeroDivisionError: setup broke on purpose" in results[case], results[case]


def test_a_rank_that_dies_is_named_with_its_exit_code():
    suite = DistSuite(worlds=(2,), timeout=30)
    suite.case("dies", rank_dies, C.rank)
    results = run_world(suite, 2)
    assert "rank 1 exited with 7 during 'dies'" in results["dies"], results["dies"]


def test_a_case_is_registered_once_and_only_before_its_test():
    suite = DistSuite()
    suite.case("one", passes)
    with pytest.raises(ValueError, match="'one' is registered twice"):
        suite.case("one", passes)
    suite.test()
    with pytest.raises(RuntimeError, match="'two' registered after"):
        suite.case("two", passes)


def test_slow_worlds_are_the_slow_tier_and_a_default_world_runs_without_them():
    suite = DistSuite(worlds=(2,))
    suite.case("everywhere", passes)
    suite.case("slow_at_3", passes, slow_worlds=(3,))
    suite.case("slow_only", passes, worlds=(), slow_worlds=(2,))
    with pytest.raises(ValueError, match="overlap"):
        suite.case("both", passes, slow_worlds=(2,))
    assert suite.names(2) == ["everywhere", "slow_at_3", "slow_only"]
    assert suite.names(2, frozenset({"main"})) == ["everywhere", "slow_at_3"]
    assert suite.names(2, frozenset({"slow"})) == ["slow_only"]
    assert suite.names(3) == ["slow_at_3"] and suite.names(3, frozenset({"main"})) == []
    (parametrize,) = suite.test().pytestmark
    tiers = {param.id: [mark.name for mark in param.marks] for param in parametrize.args[1]}
    assert tiers == {"w2-everywhere": [], "w2-slow_at_3": [], "w2-slow_only": ["slow"],
                     "w3-slow_at_3": ["slow"]}


def test_a_suite_no_test_asserts_is_refused_at_collection(tmp_path):
    for name in ("conftest.py", "dist_utils.py"):
        (tmp_path / name).write_text(open(os.path.join(HERE, name)).read())
    (tmp_path / "test_forgotten.py").write_text(textwrap.dedent("""
        from dist_utils import DistSuite

        SUITE = DistSuite()
        SUITE.case("never_asserted", print)

        def test_something_else():
            pass
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert run.returncode == 4, run.stdout + run.stderr
    assert "test_forgotten.SUITE: a DistSuite whose cases no test asserts" in run.stderr, (
        run.stdout + run.stderr)


def test_a_world_runs_only_the_selected_cases_and_reports_each_with_its_time(tmp_path):
    """`pytest -k` picks which cases a world runs (a long world split over runs), and `-s`
    shows each case as every rank leaves it."""
    for name in ("conftest.py", "dist_utils.py"):
        (tmp_path / name).write_text(open(os.path.join(HERE, name)).read())
    (tmp_path / "test_selection.py").write_text(textwrap.dedent("""
        import time

        import torch
        import torch.distributed as dist
        from dist_utils import C, DistSuite

        def waits(rank):
            time.sleep(1.5)
            dist.barrier()

        def deadlocks(rank):
            dist.recv(torch.zeros(1), src=1 - rank)

        SUITE = DistSuite(worlds=(2,), timeout=30)
        SUITE.case("chosen", waits, C.rank)
        SUITE.case("left_out", deadlocks, C.rank, timeout=60)
        test_cases = SUITE.test()
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                          "-k", "chosen", str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 deselected" in run.stdout, run.stdout
    assert "world of 2 (gloo): chosen passed" in run.stderr, run.stderr
    assert "left_out" not in run.stderr, run.stderr


def test_every_process_a_test_starts_is_bounded_in_time():
    """subprocess.run / call / check_* in tests/ name a timeout (a Popen's communicate does), so a
    hung launcher fails its test instead of hanging CI; spawned worlds go through DistSuite."""
    import ast
    import glob

    unbounded = []
    for path in glob.glob(os.path.join(HERE, "**", "*.py"), recursive=True):
        for node in ast.walk(ast.parse(open(path).read())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("run", "call", "check_call", "check_output",
                                           "communicate")
                    and getattr(node.func.value, "id", "") in ("subprocess", "task", "proc")
                    and "timeout" not in {keyword.arg for keyword in node.keywords}):
                unbounded.append(f"{os.path.relpath(path, HERE)}:{node.lineno}")
            if (isinstance(node, ast.Attribute) and node.attr in ("start_processes", "spawn")
                    and getattr(node.value, "id", "") == "mp"):
                unbounded.append(f"{os.path.relpath(path, HERE)}:{node.lineno} (use DistSuite)")
    assert not unbounded, unbounded
