"""Megatron-LM's cyclic data loader (--dataloader-type cyclic): the sample each read position
holds, as Megatron-LM's MegatronPretrainingRandomSampler deals them out.

The training loop reads *positions*: the iteration after `consumed` samples reads positions
[consumed, consumed + global batch), DP rank r's micro-batch m the `mbs` positions from
consumed + (m * dp + r) * mbs (train/step.py). The single loader reads sample p at position p.
The cyclic loader reads there the sample Megatron-LM's sampler gives DP rank r as element j of
the micro-batch it yields after c samples were consumed, where c = p - p % (mbs * dp),
r = p % (mbs * dp) // mbs and j = p % mbs. With `total` the dataset's length:

    active = total - total % (mbs * dp)    an epoch's samples (a partial batch is dropped)
    epoch, offset = divmod(c, active)
    perm(n) = torch.randperm(n), its torch.Generator seeded with `epoch`
    data sharding:     r * bucket + perm(bucket)[offset // dp + j]
                       where bucket = total // (mbs * dp) * mbs
    no data sharding:  perm(full)[offset + r + dp * j]
                       where full = total // mbs * mbs

Invariants (tests/test_cyclic_loader.py checks them against Megatron-LM's formula):
- every epoch is `active` consecutive positions. Without data sharding they read
  perm(full)[:active], each sample once, dealt to the ranks in turn; with data sharding DP rank
  r reads its bucket [r * bucket, (r + 1) * bucket), each sample once, and the samples from
  dp * bucket on are never read;
- deterministic: the sample at a position depends on (total, mbs, dp, data sharding, position)
  alone, the permutation seeded with the epoch only (as in Megatron-LM: --seed does not enter),
  so every rank and every run agrees;
- resumable: a run resumed after `consumed` samples reads on where the uninterrupted run would;
- the loader cycles: epochs follow one another for as long as the run reads.

One difference, where Megatron-LM's ranks fall out of step: without data sharding, when a rank's
share of perm(full)'s tail past `active` holds a whole micro-batch (with micro-batch 1: whenever
`total` is not a multiple of DP), Megatron-LM's rank reads it too, a micro-batch more than the
other ranks that epoch, and its count of consumed samples runs ahead of theirs from then on.
Here every rank ends the epoch at the same position: that tail is dropped like the partial
batch.

How often the loader wraps: Megatron-LM sizes the train split to the run's samples (its GPT
dataset repeats the documents over as many epochs as that takes), and so does
megadomino.data.builder; a dataset without a length (the mock data) is read as one holding the
samples the run reads from that split. Epochs thus wrap only for a dataset shorter than the run
handed to the training loop; otherwise the run reads (part of) one permuted epoch: the order
differs from the single loader's, and so do the samples read where the dataset holds more than
the run reads.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch

from megadomino.config import ConfigError, DataConfig


class CyclicOrder:
    """`order[p]` is `dataset[index(p)]`, index as the module docstring says."""

    def __init__(self, dataset: Any, total: int, micro_batch_size: int, dp: int,
                 data_sharding: bool):
        """`total`: the samples the order permutes, dataset[0 .. total)."""
        self.dataset, self.total, self.mbs, self.dp = dataset, total, micro_batch_size, dp
        self.data_sharding = data_sharding
        self.active = total - total % (micro_batch_size * dp)
        if self.active == 0:
            raise ConfigError(f"--dataloader-type cyclic reads whole micro-batches x DP "
                              f"({micro_batch_size} x {dp} samples), but the dataset holds "
                              f"{total}: add data or use a smaller micro-batch")
        self._permutations: dict[int, torch.Tensor] = {}

    def index(self, position: int) -> int:
        """The dataset index the read position `position` holds."""
        if position < 0:
            raise IndexError(f"read position {position} is negative")
        slot = self.mbs * self.dp
        consumed, within = position - position % slot, position % slot
        rank, j = divmod(within, self.mbs)
        epoch, offset = divmod(consumed, self.active)
        if self.data_sharding:
            bucket = self.total // slot * self.mbs
            return rank * bucket + int(self._permutation(epoch, bucket)[offset // self.dp + j])
        full = self.total // self.mbs * self.mbs
        return int(self._permutation(epoch, full)[offset + rank + self.dp * j])

    def __getitem__(self, position: int) -> Any:
        return self.dataset[self.index(position)]

    def _permutation(self, epoch: int, size: int) -> torch.Tensor:
        """torch.randperm(size) seeded with `epoch`; the last two epochs' are kept (a global
        batch may straddle an epoch's end)."""
        if epoch not in self._permutations:
            generator = torch.Generator()
            generator.manual_seed(epoch)
            self._permutations = {e: p for e, p in self._permutations.items() if e == epoch - 1}
            self._permutations[epoch] = torch.randperm(size, generator=generator)
        return self._permutations[epoch]


def loader_order(dataset: Any, data: DataConfig, micro_batch_size: int, dp: int,
                 run_samples: int) -> Any:
    """`dataset` read in the order `data.dataloader_type` names: as it is (single), or its
    CyclicOrder (cyclic) over its length, or `run_samples` (the samples the run reads from it)
    for a dataset without one. None stays None."""
    if dataset is None or data.dataloader_type == "single":
        return dataset
    total = len(dataset) if isinstance(dataset, Sized) else run_samples
    return CyclicOrder(dataset, total, micro_batch_size, dp, data.data_sharding)
