"""--distributed-timeout-minutes: a rank that stops answering (SIGSTOP) ends the job in bounded
time; the rank still running exits 1 within the timeout plus 10 s, naming the silent rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_MINUTES = 0.1  # 6 s


def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    args = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--model-preset", "gpt-tiny",
            "--mock-data", "--train-iters", "100000", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--log-interval", "1",
            "--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
    logs = [open(tmp_path / f"rank{rank}.log", "w+") for rank in range(2)]  # noqa: SIM115
    ranks = [subprocess.Popen(args, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                              stdout=logs[rank], stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    try:
        deadline = time.monotonic() + 120
        while "iteration        3/" not in (tmp_path / "rank0.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "rank0.log").read_text()
            assert ranks[0].poll() is None, (tmp_path / "rank0.log").read_text()
            time.sleep(0.2)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        code = ranks[0].wait(timeout=TIMEOUT_MINUTES * 60 + 60)
        took = time.monotonic() - stopped
        output = (tmp_path / "rank0.log").read_text()
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait(timeout=30)
    assert code == 1, output[-3000:]
    assert took <= TIMEOUT_MINUTES * 60 + 10, f"rank 0 took {took:.1f} s to exit"
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: a collective waited --distributed-timeout-minutes 0.1"), last
    assert last.endswith("silent: rank 1"), last


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
