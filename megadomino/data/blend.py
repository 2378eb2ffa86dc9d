"""Blending datasets in stated proportions (`--data-path 0.3 A 0.7 B`), Megatron's way.

Sample i of the blend is drawn from the dataset whose share is furthest behind its weight:
`argmax_k (w_k * max(i, 1) - n_k)`, n_k being how many samples dataset k gave so far (the first
maximum wins ties), and it is that dataset's n_k-th sample. This greedy keeps each dataset's
count near w_k * i at every prefix of the blend (within 2 samples in the tests), is
deterministic, and gives the same indices as Megatron-LM's `build_blending_indices` (same
normalisation, same float64 arithmetic). It runs in Python: about a second per million samples,
once, since the indices are cached.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import torch

from megadomino.data.index_cache import cached_arrays


def normalize_weights(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64 as Megatron does; refuses negatives and zero sum."""
    values = np.asarray(weights, dtype=np.float64)
    if values.size == 0 or (values < 0).any() or values.sum() <= 0:
        raise ValueError(f"blend weights {list(weights)} must be non-negative with a positive sum")
    return (values / values.sum()).tolist()


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) for normalised `weights`:
    blend sample i is sample dataset_sample_index[i] of dataset dataset_index[i]."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    datasets, samples = array("h"), array("q")
    candidates = range(1, len(weights))
    for i in range(size):
        drawn = float(max(i, 1))
        best, best_error = 0, weights[0] * drawn - counts[0]
        for k in candidates:
            error = weights[k] * drawn - counts[k]
            if error > best_error:
                best, best_error = k, error
        datasets.append(best)
        samples.append(counts[best])
        counts[best] += 1
    return (np.frombuffer(datasets, dtype=np.int16).copy(),
            np.frombuffer(samples, dtype=np.int64).copy())


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights` (normalised here).

    `ds[i]` is the sample dict of the dataset the blend index picks; indices are cached under
    `cache_dir` keyed by `description` (which should identify the member datasets). Raises if a
    member dataset is too short for the samples the blend draws from it.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int,
                 cache_dir: str | None, description: dict):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= 2**15:
            raise ValueError(f"{len(datasets)} datasets: the blend index holds at most 32767")
        self.datasets, self.weights, self.size = list(datasets), normalize_weights(weights), size

        def build() -> dict[str, np.ndarray]:
            dataset_index, sample_index = blending_indices(self.weights, size)
            return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

        arrays, self.from_cache = cached_arrays(
            cache_dir, "BlendedDataset", {**description, "weights": self.weights, "size": size},
            ("dataset_index", "dataset_sample_index"), build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        drawn = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for k, dataset in enumerate(self.datasets):
            if drawn[k] > len(dataset):
                raise ValueError(f"blend draws {drawn[k]} samples from dataset {k}, which has "
                                 f"{len(dataset)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} is out of range [0, {self.size})")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset[int(self.dataset_sample_index[index])]
