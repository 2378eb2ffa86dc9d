"""Checkpoint files: written atomically, read back checked, and every rank agreeing on the
outcome (see `megadomino.training.checkpoint` for the layout)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from megadomino.parallel import ParallelDims

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded or saved; the message names the file or the field."""


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its bytes (torch.save writes a view's whole storage)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def compact_all(obj):
    """`obj` (nested dicts, lists, tuples) with every tensor compact-ed."""
    if isinstance(obj, torch.Tensor):
        return compact(obj)
    if isinstance(obj, dict):
        return {key: compact_all(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(compact_all(value) for value in obj)
    return obj


def atomic_save(obj: dict, path: Path) -> None:
    """torch.save `obj` to `path` through `path.tmp`, fsynced and renamed: `path` is either
    absent, as before, or complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def write_tracker(directory: Path, iteration: int | str) -> None:
    """Point DIR's iteration file at `iteration`, atomically (as atomic_save)."""
    temporary = directory / (TRACKER + ".tmp")
    with open(temporary, "w") as file:
        file.write(f"{iteration}\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, directory / TRACKER)
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def gather_over_dp(obj: dict, dims: ParallelDims) -> list[dict]:
    """Every DP rank's `obj`, in DP rank order (collective over the DP group)."""
    if dims.dp == 1:
        return [obj]
    gathered: list = [None] * dims.dp
    dist.all_gather_object(gathered, obj, group=dims.dp_group)
    return gathered


def gather_all(obj) -> list:
    """Every rank's `obj`, in rank order (collective over the world)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def agree(error: str | None) -> None:
    """Raise on every rank the first rank's error, if any rank has one (a barrier otherwise)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def open_shard(path: Path) -> dict:
    """The shard at `path`, memory-mapped; CheckpointError if it is missing, unreadable or not
    of this format."""
    if not path.exists():
        raise CheckpointError(f"checkpoint shard missing: {path}")
    try:
        shard = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt?): {err}") from None
    if not isinstance(shard, dict) or shard.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a megadomino checkpoint shard of format "
                              f"{FORMAT_VERSION}")
    return shard
