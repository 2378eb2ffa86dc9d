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
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

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
        for path in (idx_path(prefix), bin_path(prefix)):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file {path} is missing (data prefix "
                                        f"{prefix!r}: pass the path without .bin / .idx)")
        self.prefix = prefix
        with open(idx_path(prefix), "rb") as stream:
            head = stream.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise ValueError(f"{idx_path(prefix)} is not a Megatron MMIDIDX index file")
        _, version, code, num_sequences, num_doc_indices = _HEADER.unpack(head)
        if version != VERSION:
            raise ValueError(f"{idx_path(prefix)}: index version {version}, expected {VERSION}")
        if code not in DTYPES:
            raise ValueError(f"{idx_path(prefix)}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])

        index = np.memmap(idx_path(prefix), dtype=np.uint8, mode="r")
        offset = _HEADER.size
        expected = offset + 12 * num_sequences + 8 * num_doc_indices
        if index.size < expected:
            raise ValueError(f"{idx_path(prefix)} is truncated: {index.size} bytes, the header "
                             f"announces {expected}")
        self.sequence_lengths = np.frombuffer(index, np.int32, num_sequences, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, np.int64, num_sequences, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, np.int64, num_doc_indices, offset)
        if num_doc_indices == 0 or self.document_indices[-1] != num_sequences:
            raise ValueError(f"{idx_path(prefix)}: document indices do not end at the sequence "
                             f"count {num_sequences}")

        data_bytes = os.path.getsize(bin_path(prefix))
        # np.memmap refuses empty files; an empty corpus has no sequence to read anyway.
        self._data = (np.memmap(bin_path(prefix), dtype=np.uint8, mode="r") if data_bytes
                      else np.zeros(0, np.uint8))
        if num_sequences:
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * \
                self.dtype.itemsize
            if end > data_bytes:
                raise ValueError(f"{bin_path(prefix)} is truncated: {data_bytes} bytes, the index "
                                 f"needs {end}")

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


class IndexedDatasetBuilder:
    """Writes a `.bin` as documents arrive, then the `.idx` at `finalize`.

    Tokens are cast to `dtype` (refused if a value does not fit, rather than wrapped). Usage:
    `add_document(tokens, lengths)` per document (lengths: its sequences' token counts, summing
    to len(tokens)), then `finalize(idx_path(prefix))`.
    """

    def __init__(self, bin_file: str, dtype: type[np.number] = np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"token dtype {self.dtype} has no Megatron dtype code")
        self._data = open(bin_file, "wb")  # closed by finalize
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

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

    def finalize(self, idx_file: str) -> None:
        self._data.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_file, "wb") as stream:
            stream.write(_HEADER.pack(MAGIC, VERSION, _CODES[self.dtype], len(lengths),
                                      len(self.document_indices)))
            stream.write(lengths.tobytes(order="C"))
            stream.write(pointers.tobytes(order="C"))
            stream.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))
