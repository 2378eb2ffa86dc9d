"""Fixed-length GPT samples cut from an indexed dataset, across document boundaries.

Megatron's scheme (`megatron/core/datasets/gpt_dataset.py`), with the same random draws, so a
split, seed, length and sample count give the same samples in the same order as Megatron-LM:

- the **document index** lists the split's documents (sequences) once per epoch, as many epochs
  as it takes to hold `num_samples * seq_length + 1` tokens, shuffled with
  `numpy.random.RandomState(seed)`. If the last epoch is needed for less than 80% of its samples,
  it is shuffled on its own, so the full epochs come first and each stays a permutation;
- concatenating those documents gives one token stream; sample j is the `seq_length + 1` tokens
  starting at position `j * seq_length` (consecutive samples share one token: the last label of
  one is the first input of the next). The **sample index** [samples + 1, 2] holds, for each j,
  (position in the document index, token offset in that document) of that start; a trailing
  partial sample is dropped;
- the **shuffle index** permutes the samples (the separated last epoch's samples apart again).

`ds[i]` is sample `shuffle_index[i]`: `{"tokens": LongTensor [seq_length + 1], "loss_mask":
FloatTensor [seq_length]}`; inputs are `tokens[:-1]`, labels `tokens[1:]`, and loss_mask[t]
weights label t. With `eod_mask_loss`, as in Megatron, loss_mask[t] is 0 where the *input*
tokens[t] is the end-of-document token (predicting across a document boundary is not learned).
`len(ds)` counts whole epochs of samples: at least `num_samples`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from megadomino.data.index_cache import cached_arrays
from megadomino.data.indexed import IndexedDataset

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    """Epochs needed for `num_samples` samples of seq_length + 1 tokens overlapping by one."""
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_indices(sequence_lengths: np.ndarray, sequences: np.ndarray, num_samples: int,
                  seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices for samples drawn from `sequences` (ids into
    `sequence_lengths`). Pure: the same arguments give the same arrays on every rank and run."""
    tokens_per_epoch = int(np.sum(sequence_lengths[sequences], dtype=np.int64))
    if tokens_per_epoch < seq_length + 1:
        raise ValueError(f"{len(sequences)} documents hold {tokens_per_epoch} tokens: not "
                         f"enough for one sample of {seq_length + 1}")
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if epochs > 1:
        samples_before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = (num_samples - samples_before_final
                                < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch))

    rng = np.random.RandomState(seed)
    document_index = _document_index(sequences, epochs, rng, separate_final_epoch)
    sample_index = _sample_index(sequence_lengths, document_index, seq_length)
    total = len(sample_index) - 1
    first = samples_before_final if separate_final_epoch else total
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    shuffle_index = np.arange(total, dtype=dtype)
    rng.shuffle(shuffle_index[:first])
    rng.shuffle(shuffle_index[first:])  # empty unless the final epoch is apart: no draws
    return {"document_index": document_index, "sample_index": sample_index,
            "shuffle_index": shuffle_index}


def _document_index(sequences: np.ndarray, epochs: int, rng: np.random.RandomState,
                    separate_final_epoch: bool) -> np.ndarray:
    if separate_final_epoch:
        return np.concatenate([_document_index(sequences, epochs - 1, rng, False),
                               _document_index(sequences, 1, rng, False)])
    document_index = np.tile(sequences.astype(np.int32), epochs)
    rng.shuffle(document_index)
    return document_index


def _sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray,
                  seq_length: int) -> np.ndarray:
    """[samples + 1, 2]: (document index position, offset) of token j * seq_length, for every j
    whose sample (seq_length + 1 tokens from there) fits in the stream."""
    lengths = sequence_lengths[document_index].astype(np.int64)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    num_samples = (int(starts[-1]) - 1) // seq_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    # The last document starting at or before each position (empty documents are skipped: the
    # next one starts at the same position); positions are < the stream's length.
    documents = np.searchsorted(starts, positions, side="right") - 1
    fits_int32 = max(len(document_index), int(lengths.max(initial=0))) < 2**31
    sample_index = np.empty((num_samples + 1, 2), dtype=np.int32 if fits_int32 else np.int64)
    sample_index[:, 0] = documents
    sample_index[:, 1] = positions - starts[documents]
    return sample_index


class GPTDataset:
    """Samples of one split of one indexed dataset (see the module docstring).

    `sequence_range` [begin, end) are the split's sequences (documents); indices are cached under
    `cache_dir` (None: built in memory every time); `from_cache` says whether they were loaded.
    """

    def __init__(self, indexed: IndexedDataset, sequence_range: tuple[int, int],
                 num_samples: int, seq_length: int, seed: int, eod: int,
                 eod_mask_loss: bool, cache_dir: str | None, split: str = "train"):
        self.indexed, self.seq_length, self.eod = indexed, seq_length, eod
        self.eod_mask_loss = eod_mask_loss
        begin, end = sequence_range
        description = {
            "class": "GPTDataset", "prefix": os.path.abspath(indexed.prefix),
            **indexed.identity(), "split": split,
            "sequence_range": [begin, end], "num_samples": num_samples,
            "seq_length": seq_length, "seed": seed,
        }
        sequences = np.arange(begin, end, dtype=np.int32)
        arrays, self.from_cache = cached_arrays(
            cache_dir, f"GPTDataset-{split}", description,
            ("document_index", "sample_index", "shuffle_index"),
            lambda: build_indices(indexed.sequence_lengths, sequences, num_samples, seq_length,
                                  seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, index: int) -> np.ndarray:
        """int64 [seq_length + 1]: the tokens of sample `index` (after shuffling)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range [0, {len(self)})")
        sample = int(self.shuffle_index[index])
        (first, begin), (last, end) = self.sample_index[sample], self.sample_index[sample + 1]
        first, begin, last, end = int(first), int(begin), int(last), int(end)
        if first == last:
            parts = [self.indexed.get(int(self.document_index[first]), begin, end - begin + 1)]
        else:
            parts = [self.indexed.get(int(self.document_index[first]), begin)]
            parts += [self.indexed.get(int(d)) for d in self.document_index[first + 1:last]]
            parts.append(self.indexed.get(int(self.document_index[last]), 0, end + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.from_numpy(self.sample_tokens(index))
        loss_mask = torch.ones(self.seq_length, dtype=torch.float32)
        if self.eod_mask_loss:
            loss_mask[tokens[:-1] == self.eod] = 0.0
        return {"tokens": tokens, "loss_mask": loss_mask}
