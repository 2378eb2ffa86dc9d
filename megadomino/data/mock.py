"""Learnable mock data: arithmetic progressions, so that a tiny model's loss visibly falls.

Megatron's mock data is uniform noise, whose loss cannot fall below ln(vocab); ours has structure a
model learns in a few dozen steps. Sample `i` of a split is

    tokens[t] = (start + step * t) mod alphabet,   t = 0 .. seq_length

with `start` uniform in [0, alphabet) and `step` drawn from `steps`, both a pure function of
(seed, split, i): any rank, any run, asked for sample i, gets the same tokens. The loss falls first
to the bigram entropy (ln len(steps): the next token is one of len(steps) successors) and then
towards zero once attention reads the step off the previous tokens.

Which rank reads which sample is the caller's business; the training loop uses Megatron's
pretraining sampler (see `megadomino.train.step`): the whole global batch is a contiguous
range of sample indices, each micro-batch slot takes `micro_batch_size * dp` of them and DP rank r
takes the r-th block, so the ranks of one TP group read the same samples and DP ranks differ
(under --dataloader-type cyclic, permuted: `megadomino.data.cyclic`).
"""

from __future__ import annotations

import random

import torch

SPLITS = ("train", "valid", "test")


class MockDataset:
    """`dataset[i]` is a LongTensor [seq_length + 1]: the inputs are [:-1], the labels [1:]."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int, split: str = "train",
                 alphabet: int = 128, steps: tuple[int, ...] = (1, 2, 3)):
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        self.seq_length = seq_length
        self.alphabet = min(alphabet, vocab_size)
        self.seed, self.split, self.steps = seed, split, steps

    def __getitem__(self, index: int) -> torch.Tensor:
        if index < 0:
            raise IndexError(f"mock sample index {index} is negative")
        # str seeds hash with SHA-512: stable across processes and Python runs, unlike hash().
        rng = random.Random(f"megadomino-mock/{self.seed}/{self.split}/{index}")
        start = rng.randrange(self.alphabet)
        step = rng.choice(self.steps)
        positions = torch.arange(self.seq_length + 1, dtype=torch.long)
        return (start + step * positions) % self.alphabet
