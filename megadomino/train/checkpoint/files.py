"""Checkpoint files: written atomically, checksummed, read back verified, and every rank
agreeing on the outcome (see `shards` for the layout).

Every file a save writes is checksummed (CRC-32, zlib's) as its bytes are written; rank 0 then
writes `ITERATION_DIR/manifest.json`, `{"format": 1, "files": {relative path: {"bytes": n,
"crc32": "8 hex digits"}}}`, before the iteration file names the checkpoint. A load verifies each
file against it before reading it: a file whose size or checksum differs is a CheckpointError
naming it. Each model shard records the manifest it is listed in (`"manifest": "manifest.json"`),
so a checkpoint whose manifest was deleted is refused; one whose shards record none (written
before manifests existed, or not by us) loads unverified, with a notice.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import torch

from megadomino.distributed import ParallelDims, comm

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
MANIFEST_FORMAT = 1
READ_CHUNK = 1 << 24  # bytes read at a time when verifying a file


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


class _Checksummed:
    """A binary file whose written bytes are counted and CRC-32'd on their way out."""

    def __init__(self, file):
        self.file, self.bytes, self.crc32 = file, 0, 0
        self.error: OSError | None = None
        """The write error, if one happened: torch.save reports it as its own RuntimeError
        ("unexpected pos"), which says nothing of the cause."""

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(view, self.crc32)
        self.bytes += view.nbytes
        try:
            return self.file.write(view)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def atomic_save(obj: dict, path: Path) -> dict:
    """torch.save `obj` to `path` through `path.tmp`, fsynced and renamed: `path` is either
    absent, as before, or complete. Returns its manifest entry {"bytes", "crc32"}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as raw:
        file = _Checksummed(raw)
        try:
            torch.save(obj, file)
            raw.flush()
            os.fsync(raw.fileno())
        except (OSError, RuntimeError) as err:
            cause = file.error or (err if isinstance(err, OSError) else None)
            if cause is None:
                raise
            free = shutil.disk_usage(path.parent).free
            raise CheckpointError(f"could not write {temporary} ({cause.strerror or cause}; "
                                  f"{free / 2**30:.2f} GiB free on its device): the checkpoint "
                                  "before it is kept") from None
    os.replace(temporary, path)
    fsync_dir(path.parent)
    return {"bytes": file.bytes, "crc32": f"{file.crc32:08x}"}


def write_manifest(iteration_dir: Path, files: dict[str, dict]) -> None:
    """Write the manifest of `iteration_dir` (entries keyed by path relative to it), atomically."""
    text = json.dumps({"format": MANIFEST_FORMAT, "files": dict(sorted(files.items()))},
                      indent=1)
    temporary = iteration_dir / (MANIFEST + ".tmp")
    with open(temporary, "w") as file:
        file.write(text + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, iteration_dir / MANIFEST)
    fsync_dir(iteration_dir)


class Manifest:
    """The checksums of one checkpoint's files, for verifying them before they are read."""

    def __init__(self, iteration_dir: Path, files: dict[str, dict]):
        self.iteration_dir, self.files = iteration_dir, files

    @classmethod
    def read(cls, iteration_dir: Path) -> Manifest | None:
        """The manifest of `iteration_dir`; None when it has none; CheckpointError when it is
        unreadable."""
        path = iteration_dir / MANIFEST
        if not path.exists():
            return None
        try:
            manifest = json.loads(path.read_text())
            files = manifest["files"]
            if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
                raise ValueError(f"format {manifest.get('format')!r}, expected "
                                 f"{MANIFEST_FORMAT}")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{path} is unreadable (corrupt?): {err}") from None
        return cls(iteration_dir, files)

    def verify(self, path: Path) -> None:
        """CheckpointError naming `path` unless its size and CRC-32 are those recorded."""
        name = path.relative_to(self.iteration_dir).as_posix()
        entry = self.files.get(name)
        if entry is None:
            raise CheckpointError(f"{path} is not listed in {self.iteration_dir / MANIFEST}: "
                                  "not a file this checkpoint's save wrote")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path} is unreadable (truncated or corrupt): {size} bytes, "
                                  f"{entry['bytes']} when it was saved "
                                  f"({self.iteration_dir / MANIFEST})")
        crc32 = 0
        with open(path, "rb") as file:
            while chunk := file.read(READ_CHUNK):
                crc32 = zlib.crc32(chunk, crc32)
        if f"{crc32:08x}" != entry["crc32"]:
            raise CheckpointError(f"{path} is corrupt: its CRC-32 is {crc32:08x}, "
                                  f"{entry['crc32']} when it was saved "
                                  f"({self.iteration_dir / MANIFEST})")


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
    return comm.all_gather_object(obj, group=dims.dp_group)


def gather_all(obj) -> list:
    """Every rank's `obj`, in rank order (collective over the world)."""
    return comm.all_gather_object(obj)


def agree(error: str | None) -> None:
    """Raise on every rank the first rank's error, if any rank has one (a barrier otherwise)."""
    first = next((e for e in comm.all_gather_object(error) if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def open_shard(path: Path, manifest: Manifest | None) -> dict:
    """The shard at `path`, memory-mapped, verified against `manifest` first (None: unverified);
    CheckpointError if it is missing, corrupt, unreadable or not of this format."""
    if not path.exists():
        raise CheckpointError(f"checkpoint shard missing: {path}")
    if manifest is not None:
        manifest.verify(path)
    try:
        shard = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt?): {err}") from None
    if not isinstance(shard, dict) or shard.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a megadomino checkpoint shard of format "
                              f"{FORMAT_VERSION}")
    if manifest is None and shard.get("manifest") is not None:
        # shards sit at ITERATION_DIR/mp_rank_*/; the manifest beside them was deleted
        raise CheckpointError(f"{path.parents[1] / shard['manifest']} is missing: {path} was "
                              "saved with checksums, so its checkpoint cannot be verified "
                              "(restore the file, or load another checkpoint)")
    return shard
