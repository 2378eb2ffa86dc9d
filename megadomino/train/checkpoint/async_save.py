"""Asynchronous checkpoint saving (--async-save): the same files as a synchronous save
(`shards.save_checkpoint`), written by a background thread from a CPU snapshot while training
goes on, and every guarantee kept:

- atomic and checksummed: the thread writes each file through `files.atomic_save`
  (`NAME.tmp`, fsync, rename; CRC-32 as written); the manifest and the iteration file are
  written only by `publish`, collectively, after every rank's thread finished without error;
- promoted only when finite: the caller probes the snapshot's weights (a forward pass) right
  after `start`, before the next step changes them, and `promote()` only arms the promotion;
- one save in flight: `start` first finishes the previous save (waits for its thread and
  publishes it);
- finished before exit: the loop calls `finish()` after its last iteration; `close()` (in its
  `finally`) at least lets a running thread complete its files, never promoting them;
- errors surfaced: a write error in any rank's thread is raised on every rank, as
  CheckpointError naming the rank and the file, when the save is published; the iteration
  file still names the previous checkpoint.

The snapshot copies every tensor of this rank's files to CPU memory (one checkpoint's worth per
rank), so the thread never reads a tensor the training loop writes. `poll()`, once per
iteration, publishes a save as soon as every rank's thread is done: one small all-gather per
iteration while a save is in flight, none otherwise. Collectives (`start`, `poll`, `finish`)
run on the main thread only, in the same order on every rank.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint import shards
from megadomino.train.checkpoint.files import gather_all
from megadomino.train.checkpoint.pipeline_codec import CodecState
from megadomino.zero import ZeroPlusPlus


def snapshot(obj):
    """`obj` (nested dicts, lists, tuples) with every tensor copied into CPU memory it owns."""
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        return tensor.cpu() if tensor.device.type != "cpu" else tensor.clone()
    if isinstance(obj, dict):
        return {key: snapshot(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(value) for value in obj)
    return obj


class AsyncCheckpointer:
    """The asynchronous saves of one run into `directory` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, dims: ParallelDims,
                 log: Callable[[str], None] = print):
        self.directory, self.dims, self.log = directory, dims, log
        self._thread: threading.Thread | None = None
        self._target: Path | None = None
        self._iteration: int | None = None
        self._promote = False
        self._error: str | None = None
        self._written: dict[str, dict] = {}

    @property
    def in_flight(self) -> bool:
        return self._target is not None

    def start(self, state: shards.TrainingState, model: nn.Module, engine: ZeroPlusPlus,
              *, save_rng: bool = True, save_optim: bool = True,
              codec: CodecState | None = None) -> Path:
        """Snapshot the checkpoint of `state.iteration` (with `codec`'s state: the pipeline
        codecs') and start writing it; returns its directory. Collective over the world (after
        finishing any save in flight)."""
        self.finish()
        target, files, error = shards.checkpoint_files(
            self.directory, state, model, engine, self.dims, save_rng=save_rng,
            save_optim=save_optim, codec=codec)
        files = snapshot(files)
        self._target, self._iteration, self._promote = target, state.iteration, False
        self._written, self._error = {}, error
        if error is None:
            self._thread = threading.Thread(target=self._write, args=(target, files),
                                            name=f"checkpoint {target.name}", daemon=True)
            self._thread.start()
        return target

    def _write(self, target: Path, files: dict[Path, dict]) -> None:
        try:
            self._written, self._error = shards.write_files(target, files, self.dims)
        except BaseException as err:  # surfaced by publish, on every rank
            self._error = f"rank {self.dims.rank}'s checkpoint writer failed: {err!r}"

    def promote(self) -> None:
        """Make the save in flight the latest once it is published (its weights were found
        finite)."""
        self._promote = True

    def poll(self) -> None:
        """Publish the save in flight if every rank's writer is done. Collective over the
        world while a save is in flight (every rank has one then, or none)."""
        if not self.in_flight:
            return
        done = self._thread is None or not self._thread.is_alive()
        if all(gather_all(done)):
            self._publish()

    def finish(self) -> None:
        """Wait for the save in flight and publish it. Collective over the world."""
        if not self.in_flight:
            return
        if self._thread is not None:
            self._thread.join()
        self._publish()

    def close(self) -> None:
        """Let a running writer complete its files (no collective, nothing promoted): for a
        run ending in an error."""
        if self._thread is not None:
            self._thread.join()
        self._thread = self._target = None

    def _publish(self) -> None:
        target, iteration, promote = self._target, self._iteration, self._promote
        self._thread = self._target = None
        shards.publish(self.directory, target, self._written, self._error, self.dims,
                       promote=iteration if promote else None)
        if promote and self.dims.rank == 0:
            self.log(f" saved checkpoint {target} (iteration {iteration}, in the background)")
