"""Run many test cases inside one gloo process group per world size.

Spawning ranks costs seconds, so a test module collects its cases into one function that runs in
every rank and returns {case name: None or an error string}; `run_cases` spawns once and pytest
tests then assert per case (see `case_results`).
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, fn, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = fn(*args)
    except Exception:
        result = {"<setup>": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    # A barrier is queued behind any collective a case left in flight (gloo runs them in order),
    # so the group is not torn down under a background thread still using it.
    dist.barrier()
    dist.destroy_process_group()


def run_cases(world: int, fn, *args, backend: str = "gloo") -> dict[str, str | None]:
    """Spawn `world` ranks (gloo on CPU, or nccl with one GPU each) running fn(*args) ->
    {case: error or None}; merge the ranks' results (a case fails if it failed on any rank)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, free_port(), backend, fn, args, out_dir),
                           nprocs=world,
                           join=True, start_method="spawn")
        merged: dict[str, str | None] = {}
        for rank in range(world):
            for case, error in torch.load(os.path.join(out_dir, f"rank{rank}.pt")).items():
                if error is not None and merged.get(case) is None:
                    merged[case] = f"rank {rank}: {error}"
                else:
                    merged.setdefault(case, None)
        return merged


class CaseRunner:
    """Collects named cases in a rank; each runs under try/except so one failure is reported
    without stopping the others (every rank runs every case, so collectives stay matched)."""

    def __init__(self):
        self.results: dict[str, str | None] = {}

    def run(self, name: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
            self.results[name] = None
        except Exception:
            self.results[name] = traceback.format_exc()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    """max |actual - expected| <= rel * max |expected| (a relative error over the whole tensor)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    scale = expected.abs().max().item()
    error = (actual.double() - expected.double()).abs().max().item()
    if not error <= rel * max(scale, 1e-30):
        raise AssertionError(f"{what}: max abs error {error:.3e} > {rel:g} x max |ref| {scale:.3e}")


def check_result(results: dict[str, str | None], case: str) -> None:
    if case not in results:
        raise AssertionError(f"case {case!r} did not run; ran: {sorted(results)}")
    if results[case] is not None:
        raise AssertionError(results[case])


def with_fused_comm(mode: str, check, *args, **kwargs) -> None:
    """`check` with MEGADOMINO_FUSED_COMM=mode (parallel/async_tp.fused_comm_mode)."""
    before = os.environ.get("MEGADOMINO_FUSED_COMM")
    os.environ["MEGADOMINO_FUSED_COMM"] = mode
    try:
        check(*args, **kwargs)
    finally:
        if before is None:
            del os.environ["MEGADOMINO_FUSED_COMM"]
        else:
            os.environ["MEGADOMINO_FUSED_COMM"] = before
