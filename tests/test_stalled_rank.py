"""--distributed-timeout-minutes: a rank that stops answering (SIGSTOP) ends the job in bounded
time; every rank still running exits 1 with one line naming the stopped rank, and only it (a live
rank that entered the same collective later is not named), within the timeout plus GRACE of the
stop. The heartbeat names it after half of the timeout plus 2 intervals (3.5 s for 0.1 minutes):
GRACE covers the rest on 2 loaded cores."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_MINUTES = 0.1  # 6 s: a heartbeat every 0.5 s, a peer silent for 3 s is named
GRACE = 10.0  # seconds past the timeout, counted from the stop

# A world that reaches a collective on a plan: launch.main with the datasets left out and the
# training loop replaced by `plan[rank]`, counted from a barrier: after its delay, say "now stop"
# and stop itself (SIGSTOP), or say "now enter" and enter an all-reduce.
DRIVER = """
import json, os, signal, sys, time
import torch
import torch.distributed as dist
from megadomino.cli import launch
from megadomino.distributed import comm
from megadomino.train import inputs, loop

def train(*args):
    comm.barrier()
    action, delay = json.loads(sys.argv[1])[dist.get_rank()]
    time.sleep(delay)
    print("now", action, flush=True)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.all_reduce(torch.ones(1))
    print("the all-reduce returned", flush=True)

inputs.build_datasets = lambda *args: (None, None)
loop.train = train
sys.exit(launch.main("gpt", sys.argv[2:]))
"""


def start_world(tmp_path: Path, world: int, args: list[str], env: dict | None = None):
    """`world` ranks of `args` under torchrun's environment, each logging to rank<N>.log."""
    env = dict(os.environ, **(env or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    logs = [open(tmp_path / f"rank{rank}.log", "w+") for rank in range(world)]  # noqa: SIM115
    return [subprocess.Popen(args, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                             stdout=logs[rank], stderr=subprocess.STDOUT, text=True)
            for rank in range(world)]


def wait_for(tmp_path: Path, rank: int, text: str, ranks: list, seconds: float = 120) -> float:
    """Wait until rank `rank`'s log holds `text` (failing if a rank ends first); the time then."""
    deadline = time.monotonic() + seconds
    while text not in (tmp_path / f"rank{rank}.log").read_text():
        assert time.monotonic() < deadline, (tmp_path / f"rank{rank}.log").read_text()
        for other, process in enumerate(ranks):
            assert process.poll() is None, (tmp_path / f"rank{other}.log").read_text()[-3000:]
        time.sleep(0.1)
    return time.monotonic()


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def stalled_line(stopped: int, rank: int, timeout_minutes: float) -> str:
    """The one line a rank prints when `stopped` stopped answering."""
    return (rf"error: rank {stopped} stopped answering \(no heartbeat for [\d.]+ s; "
            rf"--distributed-timeout-minutes {timeout_minutes:g}\); ending this rank \({rank}\)")


@contextlib.contextmanager
def running_world(tmp_path: Path, world: int, args: list[str]):
    """start_world's ranks, killed (whatever is left of them) on the way out."""
    ranks = start_world(tmp_path, world, args)
    try:
        yield ranks
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait(timeout=30)


def stop_rank_1_in_training(tmp_path: Path, timeout_minutes: float) -> tuple[int, float, str]:
    """Two ranks of pretrain_gpt.py; rank 1 stopped at iteration 3. Rank 0's exit status, its
    seconds from the stop to its exit, and its output."""
    args = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--model-preset", "gpt-tiny",
            "--mock-data", "--train-iters", "100000", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--log-interval", "1",
            "--distributed-timeout-minutes", str(timeout_minutes)]
    with running_world(tmp_path, 2, args) as ranks:
        wait_for(tmp_path, 0, "iteration        3/", ranks)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = ranks[0].wait(timeout=timeout_minutes * 60 + 60)
        took = time.monotonic() - stopped
    return code, took, (tmp_path / "rank0.log").read_text()


def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    code, took, output = stop_rank_1_in_training(tmp_path, TIMEOUT_MINUTES)
    assert code == 1, output[-3000:]
    assert took <= TIMEOUT_MINUTES * 60 + GRACE, f"rank 0 took {took:.1f} s to exit"
    last = output.strip().splitlines()[-1]
    assert error_lines(output) == [last], output[-3000:]
    assert re.fullmatch(stalled_line(1, 0, TIMEOUT_MINUTES), last), last


def driver_args(plan: list) -> list[str]:
    """The command of a rank of DRIVER following `plan` (one (action, seconds) a rank), one
    micro-batch of one sample a rank."""
    return [sys.executable, "-c", DRIVER, json.dumps(plan), "--model-preset", "gpt-tiny",
            "--mock-data", "--train-iters", "1", "--micro-batch-size", "1",
            "--global-batch-size", str(len(plan)), "--distributed-timeout-minutes",
            str(TIMEOUT_MINUTES)]


@pytest.mark.slow  # a long fault test: the default tier has the stop itself
def test_only_the_stopped_rank_is_named_by_ranks_entering_apart(tmp_path):
    """Rank 0 enters the all-reduce first; rank 2 stops 4 s later (so rank 0's collective times
    out, at 6 s, before rank 2 has been silent for 3 s); rank 1 enters 5 s after rank 0, alive
    and still waiting when rank 0's timeout fires. Ranks 0 and 1 each name rank 2 only."""
    plan = [("enter", 0), ("enter", 5), ("stop", 4)]
    with running_world(tmp_path, 3, driver_args(plan)) as ranks:
        stopped = wait_for(tmp_path, 2, "now stop", ranks)
        codes = [ranks[rank].wait(timeout=TIMEOUT_MINUTES * 60 + 60) for rank in (0, 1)]
        took = time.monotonic() - stopped
    for rank in (0, 1):
        output = (tmp_path / f"rank{rank}.log").read_text()
        assert codes[rank] == 1, output[-3000:]
        lines = error_lines(output)
        assert len(lines) == 1, output[-3000:]
        assert re.fullmatch(stalled_line(2, rank, TIMEOUT_MINUTES), lines[0]), lines[0]
    assert "now enter" in (tmp_path / "rank1.log").read_text()  # rank 1 was alive in the all-reduce
    assert took <= TIMEOUT_MINUTES * 60 + GRACE, f"the live ranks took {took:.1f} s to exit"


@pytest.mark.slow  # a long fault test: the default tier has the stop itself
def test_a_live_rank_waiting_elsewhere_is_not_named(tmp_path):
    """Rank 1 stays alive outside the all-reduce that rank 0 waits in: rank 0's collective times
    out and its line says that every rank still beats, naming none."""
    plan = [("enter", 0), ("enter", 60)]
    with running_world(tmp_path, 2, driver_args(plan)) as ranks:
        entered = wait_for(tmp_path, 0, "now enter", ranks)
        code = ranks[0].wait(timeout=TIMEOUT_MINUTES * 60 + 60)
        took = time.monotonic() - entered
    output = (tmp_path / "rank0.log").read_text()
    assert code == 1, output[-3000:]
    assert error_lines(output) == [
        "error: a collective waited --distributed-timeout-minutes 0.1, but every rank's "
        "heartbeat still beats: a rank waits elsewhere (a collective the others did not call, "
        "or a hang in its main thread); ending this rank (0)"], output[-3000:]
    assert took <= TIMEOUT_MINUTES * 60 + GRACE, f"rank 0 took {took:.1f} s to exit"


def test_an_internal_bug_keeps_its_traceback(monkeypatch):
    """Only a collective's timeout becomes a one-line exit: a RuntimeError of our own propagates
    with its traceback (and so does any other exception type)."""
    from megadomino.cli import launch
    from megadomino.train import loop

    def broken(*args, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(loop, "train", broken)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(RuntimeError, match="an internal bug"):
        launch.main("gpt", ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "1",
                            "--micro-batch-size", "1", "--global-batch-size", "1"])
