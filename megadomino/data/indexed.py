"""Megatron's indexed dataset: token ids in `PREFIX.bin`, their layout in `PREFIX.idx`.

The format is Megatron-LM's (`megatron/core/datasets/indexed_dataset.py`), byte for byte, so files
written by its `tools/preprocess_data.py` load here and ours load there. All integers are
little-endian:

    .idx   b"MMIDIDX\\x00\\x00"                    9-byte magic
           u64  version = 1
           u8   dtype code of the tokens          1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                                  6 float64, 7 float32, 8 uint16
           u64  S, the number of sequences
           u64  D, the number of document indices (documents + 1)
           i32[S]  sequence lengths, in tokens
           i64[S]  sequence pointers, in bytes from the start of .bin
           i64[D]  document indices: document d is sequences [doc[d], doc[d + 1]); doc[0] = 0
    .bin   the sequences' tokens back to back, in the dtype above

A document is one JSON line of the corpus; without sentence splitting it is one sequence (an empty
line gives an empty document: no sequence, a repeated document index). Both files are memory
mapped, never read whole.

Opening a pair validates it (ConfigError naming --data-path and the file): lengths
non-negative, pointers the running sum of lengths times the token size (from 0), document indices
from 0, non-decreasing, to the sequence count, and the `.bin` exactly as long as the lengths imply
(which also catches an `.idx` whose dtype is not the `.bin`'s). `identity()` says what the data
is, for cache keys: a hash of the `.idx` content with the `.bin`'s size and modification time, so
that re-tokenizing into the same prefix never reuses indices built for the old data.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from megadomino.config import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type[np.number]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
    7: np.float32, 8: np.uint16,
}
_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """Megatron's choice of token dtype: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


class IndexedDataset:
    """Read-only view of a `PREFIX.bin` / `PREFIX.idx` pair.

    `len(ds)` is the number of sequences; `ds[i]` (or `ds.get(i, offset, length)`) is a numpy
    array of sequence i's tokens (or of `length` of them from `offset`), in the file's dtype, a view
    into the memory map: copy it before writing. `document_indices` is int64 [documents + 1].
    """

    def __init__(self, prefix: str):
        try:
            self._open(prefix)
        except ConfigError as err:  # --data-path is what names indexed data
            raise ConfigError(f"--data-path: {err}") from None
        except OSError as err:
            raise ConfigError(f"--data-path: {err.filename} cannot be read ({err.strerror})"
                              ) from None

    def _open(self, prefix: str) -> None:
        """Map the pair and validate it (see the module docstring)."""
        for path in (idx_path(prefix), bin_path(prefix)):
            if not os.path.isfile(path):
                raise ConfigError(f"indexed dataset file {path} is missing (data prefix "
                                  f"{prefix!r}: {_prefix_hint(prefix)})")
        self.prefix = prefix
        index_file = idx_path(prefix)
        with open(index_file, "rb") as stream:
            head = stream.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise ConfigError(f"{index_file} is not a Megatron MMIDIDX index file")
        _, version, code, num_sequences, num_doc_indices = _HEADER.unpack(head)
        if version != VERSION:
            raise ConfigError(f"{index_file}: index version {version}, expected {VERSION}")
        if code not in DTYPES:
            raise ConfigError(f"{index_file}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])

        index = np.memmap(index_file, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        expected = offset + 12 * num_sequences + 8 * num_doc_indices
        if index.size < expected:
            raise ConfigError(f"{index_file} is truncated: {index.size} bytes, the header "
                              f"announces {expected}")
        self.sequence_lengths = np.frombuffer(index, np.int32, num_sequences, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, np.int64, num_sequences, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, np.int64, num_doc_indices, offset)
        self._validate()
        data_bytes = os.path.getsize(bin_path(prefix))
        implied = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if data_bytes != implied:
            raise ConfigError(
                f"{bin_path(prefix)} holds {data_bytes} bytes, but {index_file} implies {implied} "
                f"({int(self.sequence_lengths.sum(dtype=np.int64))} tokens of {self.dtype}): the "
                "two files do not belong together (truncated, or written with another dtype or "
                "at another time); preprocess the corpus again into this prefix")
        # np.memmap refuses empty files; an empty corpus has no sequence to read anyway.
        self._data = (np.memmap(bin_path(prefix), dtype=np.uint8, mode="r") if data_bytes
                      else np.zeros(0, np.uint8))
        self._identity: dict | None = None

    def _validate(self) -> None:
        """ConfigError naming the .idx unless its arrays describe a well-formed corpus."""
        index_file, lengths = idx_path(self.prefix), self.sequence_lengths
        documents = self.document_indices
        if len(lengths) and int(lengths.min()) < 0:
            first = int(np.argmax(lengths < 0))
            raise ConfigError(f"{index_file} is corrupt: sequence {first} has length "
                              f"{int(lengths[first])}")
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        if not np.array_equal(pointers, self.sequence_pointers):
            first = int(np.argmax(pointers != self.sequence_pointers))
            raise ConfigError(f"{index_file} is corrupt: sequence {first} starts at byte "
                              f"{int(self.sequence_pointers[first])}, the lengths before it put "
                              f"it at {int(pointers[first])}")
        if len(documents) == 0 or documents[0] != 0 or documents[-1] != len(lengths):
            raise ConfigError(f"{index_file} is corrupt: document indices must run from 0 to the "
                              f"sequence count {len(lengths)}")
        if len(documents) > 1 and int(np.diff(documents).min()) < 0:
            first = int(np.argmax(np.diff(documents) < 0))
            raise ConfigError(f"{index_file} is corrupt: document {first + 1} starts at sequence "
                              f"{int(documents[first + 1])}, before document {first} "
                              f"({int(documents[first])})")

    def identity(self) -> dict:
        """What this data is, for cache keys: the .idx content's BLAKE2b digest, the .bin's size
        and modification time (ns). Hashing reads the .idx once per instance."""
        if self._identity is None:
            digest = hashlib.blake2b(digest_size=16)
            with open(idx_path(self.prefix), "rb") as stream:
                while chunk := stream.read(1 << 24):
                    digest.update(chunk)
            status = os.stat(bin_path(self.prefix))
            self._identity = {"idx_blake2b": digest.hexdigest(), "bin_bytes": status.st_size,
                              "bin_mtime_ns": status.st_mtime_ns}
        return self._identity

    def max_token_id(self, log: Callable[[str], None] = print,
                     chunk_tokens: int = 1 << 26) -> int:
        """The largest token id in the .bin (-1 when empty), scanning it in chunks; a progress
        line to `log` every 10 seconds and one at the end."""
        tokens = len(self._data) // self.dtype.itemsize
        data = np.frombuffer(self._data, self.dtype, tokens)
        largest, began, shown = -1, time.monotonic(), time.monotonic()
        for start in range(0, tokens, chunk_tokens):
            largest = max(largest, int(data[start:start + chunk_tokens].max()))
            if time.monotonic() - shown > 10:
                shown = time.monotonic()
                log(f" scanning {bin_path(self.prefix)} for its largest token id: "
                    f"{100 * (start + chunk_tokens) / tokens:.0f}%")
        log(f" largest token id of {bin_path(self.prefix)}: {largest} ({tokens} tokens, "
            f"{time.monotonic() - began:.1f} s; cached)")
        return largest

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} is out of range [0, {len(self)})")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) of sequence {index} are out "
                             f"of its {size}")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._data, self.dtype, length, start)


def _prefix_hint(prefix: str) -> str:
    """What to give instead of a prefix whose pair is missing."""
    if os.path.isdir(prefix):
        return "a directory; give the prefix PREFIX of PREFIX.bin and PREFIX.idx"
    if os.path.isfile(prefix) and not prefix.endswith((".bin", ".idx")):
        return ("a file of another kind; a JSONL or text corpus is tokenized into .bin / .idx "
                "by scripts/preprocess_data.py first")
    return "pass the path without .bin / .idx"


class IndexedDatasetBuilder:
    """Writes a `.bin` as documents arrive, then the `.idx` at `finalize`.

    Tokens are cast to `dtype` (refused if a value does not fit, rather than wrapped). Usage:
    `add_document(tokens, lengths)` per document (lengths: its sequences' token counts, summing
    to len(tokens)), then `finalize(idx_path(prefix))`, or `discard()` to give up. Both files
    are written under temporary names beside their own and renamed into place by `finalize`,
    once written and synced: a run that fails or is killed leaves no `.bin` or `.idx` (and
    keeps an older pair whole). Between the two renames a reader would see the new `.bin`
    with the old `.idx`, which IndexedDataset refuses (their sizes disagree).
    """

    def __init__(self, bin_file: str, dtype: type[np.number] = np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"token dtype {self.dtype} has no Megatron dtype code")
        self.bin_file = bin_file
        self._temporary = f"{bin_file}.tmp{os.getpid()}"
        self._data = open(self._temporary, "wb")  # closed by finalize or discard
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.num_tokens = 0

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int]) -> None:
        array = np.asarray(tokens)
        lengths = [int(length) for length in lengths]
        if sum(lengths) != array.size:
            raise ValueError(f"sequence lengths {lengths} do not add up to the document's "
                             f"{array.size} tokens")
        if array.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise ValueError(f"token ids [{array.min()}, {array.max()}] do not fit "
                                 f"{self.dtype}")
        self._data.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))
        self.num_tokens += array.size

    def finalize(self, idx_file: str) -> None:
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        index_temporary = f"{idx_file}.tmp{os.getpid()}"
        try:
            _sync_and_close(self._data)
            with open(index_temporary, "wb") as stream:
                stream.write(_HEADER.pack(MAGIC, VERSION, _CODES[self.dtype], len(lengths),
                                          len(self.document_indices)))
                stream.write(lengths.tobytes(order="C"))
                stream.write(pointers.tobytes(order="C"))
                stream.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))
                _sync_and_close(stream)
            os.replace(self._temporary, self.bin_file)
            os.replace(index_temporary, idx_file)
        finally:
            for path in (self._temporary, index_temporary):
                if os.path.exists(path):
                    os.remove(path)

    def discard(self) -> None:
        """Close and delete what was written (nothing after `finalize`)."""
        self._data.close()
        if os.path.exists(self._temporary):
            os.remove(self._temporary)


def _sync_and_close(stream) -> None:
    stream.flush()
    os.fsync(stream.fileno())
    stream.close()
