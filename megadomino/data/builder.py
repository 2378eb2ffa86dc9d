"""From `--data-path`, `--split`, `--seq-length` and `--seed` to the train, valid and test datasets.

    train, valid, test = build_train_valid_test_datasets(
        data_path=["0.3", "/data/a_text_document", "0.7", "/data/b_text_document"],
        split="969,30,1", seq_length=2048, seed=1234,
        num_samples=(train_samples, eval_samples, test_samples),
        tokenizer_eod=tokenizer.eod, eod_mask_loss=False, cache_dir=None)

- `data_path` is Megatron's: one prefix; or pairs `weight prefix ...`, blended in those
  proportions; or several prefixes without weights, blended in proportion to their sizes (in
  samples per epoch; Megatron then caps the blend at one epoch, we repeat epochs like a weighted
  blend so that the requested samples always exist).
- `split` ("969,30,1", also "98/2/0") divides every prefix's documents into consecutive train,
  valid and test ranges in those proportions (Megatron's rounding); missing parts are 0.
- `num_samples[i]` samples are guaranteed in split i; a split whose weight or num_samples is 0
  is None. For a blend, each member is built with Megatron's 0.5% surplus over its share, and
  the blend holds sum_k ceil(num_samples * w_k) samples.
- Each sample is a dict, see `gpt_dataset`. Index files are cached in `cache_dir`, default
  `DIR/index-cache` beside the first prefix (`--data-cache-path`); the second run loads them.
- Under torch.distributed, rank 0 builds (and caches) first, then the other ranks build
  (loading the cache where they share the disk): call it on every rank. An error on rank 0
  (too little data for a split, a bad file) is raised on every rank.
- With `vocab_size`, every prefix's token ids must be below it (the unpadded vocabulary: an id
  in the padding band would train a padding row, a larger one would crash or read a zero
  vector): the largest id of each .bin is found once, by the rank that builds the cache (a
  progress line while it scans), and cached with the indices; a larger id is a ConfigError naming
  the file, the id and `vocab_source` (the flag or tokenizer that set the vocabulary).

Which rank reads which sample is the sampler's business (the loop's: DP ranks take disjoint
slices of each global batch of consecutive sample indices, or of Megatron-LM's cyclic order of
them, `cyclic`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch.distributed as dist

from megadomino.config import ConfigError
from megadomino.data.blend import BlendedDataset, normalize_weights
from megadomino.data.gpt_dataset import GPTDataset
from megadomino.data.index_cache import cached_arrays
from megadomino.data.indexed import IndexedDataset
from megadomino.distributed import comm

SPLITS = ("train", "valid", "test")
T = TypeVar("T")
MID_LEVEL_SURPLUS = 0.005


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights or None): `A`, `A B`, or `0.3 A 0.7 B`."""
    if not data_path:
        raise ConfigError("--data-path is empty: give a prefix, or weights and prefixes")
    pairs = len(data_path) % 2 == 0
    weights = [_float_or_none(w) for w in data_path[0::2]] if pairs else [None]
    if any(w is None for w in weights):
        numbers = [w for w in weights if w is not None]
        if pairs and numbers:  # some weights parse: the others are typos, not prefixes
            bad = next(t for t, w in zip(data_path[0::2], weights) if w is None)
            raise ConfigError(f"--data-path {' '.join(data_path)}: {bad!r} stands where a blend "
                              "weight goes but is not a number: give weight prefix pairs "
                              "(e.g. 0.3 A 0.7 B)")
        return list(data_path), None
    prefixes = list(data_path[1::2])
    if any(_float_or_none(p) is not None for p in prefixes):
        raise ConfigError(f"--data-path {' '.join(data_path)}: expected weight prefix pairs")
    try:
        normalize_weights(weights)
    except ValueError as error:
        raise ConfigError(f"--data-path: {error}") from error
    return prefixes, weights


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """Per split, [begin, end) as fractions of the documents, or None for a zero weight."""
    parts = [_float_or_none(p) for p in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(parts) <= 3 or None in parts or sum(parts) <= 0:
        raise ConfigError(f"--split {split!r} is invalid: give up to three non-negative "
                          f"weights, e.g. 969,30,1")
    parts += [0.0] * (3 - len(parts))
    shares = normalize_weights(parts)
    bookends = [sum(shares[:i]) for i in range(4)]
    return [(bookends[i], bookends[i + 1]) if shares[i] > 0 else None for i in range(3)]


def build_train_valid_test_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                                    num_samples: tuple[int, int, int], tokenizer_eod: int,
                                    eod_mask_loss: bool, cache_dir: str | None = None, *,
                                    vocab_size: int | None = None,
                                    vocab_source: str = "--vocab-size") -> tuple:
    """(train, valid, test): GPTDataset / BlendedDataset / None each; see the module docstring."""
    prefixes, weights = parse_data_path(data_path)
    ranges = parse_split(split)
    if cache_dir is None:
        cache_dir = os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index-cache")
    def build() -> tuple:
        indexed = [IndexedDataset(prefix) for prefix in prefixes]
        if vocab_size is not None:
            for dataset in indexed:
                check_token_ids(dataset, vocab_size, vocab_source, cache_dir)
        return tuple(
            _build_split(indexed, weights, ranges[i], num_samples[i], seq_length, seed,
                         tokenizer_eod, eod_mask_loss, cache_dir, SPLITS[i])
            if ranges[i] is not None and num_samples[i] > 0 else None
            for i in range(3))

    return rank0_first(build)


def rank0_first(build: Callable[[], T]) -> T:
    """build() on rank 0 first (which may write caches the others then read), then on the
    others; a ValueError or OSError of rank 0's is raised on every rank alike (a ConfigError
    marked `alike`), instead of the others failing in a collective. Collective over the world
    (nothing without a group of more than one)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return build()
    outcome = None
    if dist.get_rank() == 0:
        try:
            built = build()
        except (ValueError, OSError) as error:
            outcome = (type(error), getattr(error, "messages", None) or [str(error)])
    outcome = comm.broadcast_object(outcome, src=0)
    if outcome is not None:
        error_type, messages = outcome
        if issubclass(error_type, ConfigError):
            raise ConfigError(*messages, alike=True)
        raise error_type("\n".join(messages))
    return built if dist.get_rank() == 0 else build()


def check_token_ids(indexed: IndexedDataset, vocab_size: int, vocab_source: str,
                    cache_dir: str | None) -> None:
    """ConfigError unless every token id of `indexed` is below `vocab_size`; the largest id is
    computed once and cached in `cache_dir` beside the indices, keyed by the data's identity."""
    description = {"class": "IndexedDataset", "prefix": os.path.abspath(indexed.prefix),
                   **indexed.identity()}
    arrays, _ = cached_arrays(
        cache_dir, "IndexedDataset", description, ("max_token_id",),
        lambda: {"max_token_id": np.array([indexed.max_token_id()], dtype=np.int64)})
    largest = int(arrays["max_token_id"][0])
    if largest >= vocab_size:
        raise ConfigError(
            f"{indexed.prefix}.bin holds token id {largest}, but the vocabulary has {vocab_size} "
            f"ids (ids 0 to {vocab_size - 1}, set by {vocab_source}): preprocess the data with "
            "the tokenizer the model uses, or give the vocabulary that the data was tokenized "
            "with")


def _build_split(indexed: list[IndexedDataset], weights: list[float] | None,
                 fraction: tuple[float, float], num_samples: int, seq_length: int, seed: int,
                 eod: int, eod_mask_loss: bool, cache_dir: str, split: str):
    ranges = [_sequence_range(ds, fraction) for ds in indexed]

    def member(k: int, samples: int) -> GPTDataset:
        tokens = int(indexed[k].sequence_lengths[ranges[k][0]:ranges[k][1]].sum())
        if tokens < seq_length + 1:
            raise ConfigError(
                f"the {split} split of {indexed[k].prefix} (documents [{ranges[k][0]}, "
                f"{ranges[k][1]}) of {len(indexed[k])}) holds {tokens} tokens, too few for one "
                f"sample of --seq-length {seq_length} + 1: adjust --split or add data")
        return GPTDataset(indexed[k], ranges[k], samples, seq_length, seed, eod, eod_mask_loss,
                          cache_dir, split)

    if len(indexed) == 1 and weights is None:
        return member(0, num_samples)
    if weights is None:  # in proportion to the samples one epoch of each gives
        weights = [max(0, (int(ds.sequence_lengths[b:e].sum()) - 1) // seq_length)
                   for ds, (b, e) in zip(indexed, ranges)]
    shares = normalize_weights(weights)
    targets = [math.ceil(num_samples * w) for w in shares]
    members = [member(k, math.ceil(target * (1 + MID_LEVEL_SURPLUS)))
               for k, target in enumerate(targets)]
    description = {"members": [[os.path.abspath(ds.prefix), ds.identity(), list(r)]
                               for ds, r in zip(indexed, ranges)],
                   "split": split, "seq_length": seq_length, "seed": seed}
    return BlendedDataset(members, shares, sum(targets), cache_dir, description)


def _sequence_range(indexed: IndexedDataset, fraction: tuple[float, float]) -> tuple[int, int]:
    count = len(indexed)
    return int(round(fraction[0] * count)), int(round(fraction[1] * count))


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
