"""--async-save keeps every guarantee of a synchronous save:

- an asynchronously saved checkpoint (ZeRO stage 1 at DP=2: model and optimizer shards) resumes
  bit-exactly: 3 iterations, saved in the background, stopped, resumed for 3 more, repeat 6
  straight; its files are listed with their checksums in its manifest, and it is the latest;
- a writer that fails between files (rank 0's thread, after its first file) fails the run on
  every rank with the error naming the rank and the file, and the previous checkpoint stays
  the latest (the new one has no manifest);
- a process killed while its writer is between files (a single rank, `os._exit` from the
  writer thread) leaves the previous checkpoint the latest, and a run resumes from it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dist_utils import C, DistSuite, free_port
from megadomino.cli.arguments import parse_args
from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint import (
    CheckpointError,
    Manifest,
    checkpoint_dir,
    latest_iteration,
    shards,
)
from megadomino.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--model-preset", "gpt-tiny", "--seq-length", "16", "--mock-data", "--micro-batch-size",
         "2", "--global-batch-size", "8", "--lr", "5e-3", "--lr-warmup-iters", "1",
         "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--zero-stage",
         "1"]


def _train(dims: ParallelDims, *flags: str) -> dict:
    """A run of FLAGS and `flags`, saving asynchronously when it saves."""
    config, _ = parse_args([*FLAGS, *flags, *(["--async-save"] if "--save" in flags else [])],
                           "gpt")
    return train(config, dims, "gpt", log=lambda line: None)


def _case_resume(dims: ParallelDims, directory: str) -> None:
    straight = _train(dims, "--train-iters", "6")
    first = _train(dims, "--train-iters", "6", "--save", directory, "--save-interval", "2",
                   "--exit-interval", "3")
    assert latest_iteration(directory) == 3
    manifest = Manifest.read(checkpoint_dir(directory, 3))
    assert sorted(manifest.files) == ["mp_rank_00/model_optim_rng.pt",
                                      "mp_rank_00/optim_dp_rank_000.pt",
                                      "mp_rank_00/optim_dp_rank_001.pt"]
    assert Manifest.read(checkpoint_dir(directory, 2)) is not None  # published, then replaced
    second = _train(dims, "--train-iters", "6", "--save", directory, "--load", directory)
    assert first["losses"] + second["losses"] == straight["losses"]
    assert latest_iteration(directory) == 6


def _case_writer_fails_between_files(dims: ParallelDims, directory: str) -> None:
    real_save = shards.atomic_save

    def fail_second_file_on_rank0(obj: dict, path):  # its model shard is written, then this
        if dims.rank == 0 and "iter_0000004" in str(path) and "optim_dp" in path.name:
            raise OSError("disk full")
        return real_save(obj, path)

    shards.atomic_save = fail_second_file_on_rank0
    try:
        _train(dims, "--train-iters", "6", "--save", directory, "--save-interval", "2")
    except CheckpointError as err:
        assert re.search(r"rank 0 could not write .*iter_0000004/mp_rank_00/"
                         r"optim_dp_rank_000.pt: .*disk full", str(err)), str(err)
    else:
        raise AssertionError("the failed background write did not fail the run")
    finally:
        shards.atomic_save = real_save
    assert latest_iteration(directory) == 2
    assert Manifest.read(checkpoint_dir(directory, 4)) is None


SUITE = DistSuite(worlds=(2,), timeout=300)


@pytest.fixture(scope="module")
def async_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("async_save")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"dp": ParallelDims(tp=1), "resume": f"{root}/resume", "fails": f"{root}/fails"}


SUITE.case("resume_bit_exact", _case_resume, C.dp, C.resume)
SUITE.case("writer_fails_between_files", _case_writer_fails_between_files, C.dp, C.fails)

test_async_save = SUITE.test(args_fixture="async_root")


KILLED = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from megadomino.cli.arguments import parse_args
    from megadomino.distributed import ParallelDims
    from megadomino.train.checkpoint import shards
    from megadomino.train.loop import train

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                            world_size=1)
    real_save = shards.atomic_save
    written = []

    def die_after_first_file_of_iteration_4(obj, path):
        if "iter_0000004" in str(path) and written:
            os._exit(9)  # the process dies, its writer between two files
        entry = real_save(obj, path)
        if "iter_0000004" in str(path):
            written.append(path)
        return entry

    shards.atomic_save = die_after_first_file_of_iteration_4
    config, _ = parse_args(sys.argv[2:], "gpt")
    train(config, ParallelDims(tp=1), "gpt", log=print)
""")


def test_process_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    save = tmp_path / "checkpoints"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # One rank: stage 0 writes one shard; stage 1 at DP 1 writes two files, so the writer has
    # a "between" to die in.
    argv = [*FLAGS, "--train-iters", "6", "--save", str(save), "--save-interval", "2",
            "--async-save"]
    done = subprocess.run([sys.executable, str(script), str(free_port()), *argv], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stdout[-3000:] + done.stderr[-3000:]
    assert latest_iteration(save) == 2
    assert Manifest.read(checkpoint_dir(save, 4)) is None
    assert (checkpoint_dir(save, 4) / "mp_rank_00" / "model_optim_rng.pt").exists()
