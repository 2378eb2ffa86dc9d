"""Training data: datasets give `dataset[i]`, a LongTensor [seq_length + 1] of token ids."""

from megadomino.training.data.mock import MockDataset

__all__ = ["MockDataset"]
