"""Training data: mock data, Megatron indexed datasets, tokenizers, GPT samples and blends, and
the order Megatron-LM's cyclic loader reads them in (`cyclic`).

`MockDataset[i]` is a LongTensor [seq_length + 1]; the real datasets built by
`build_train_valid_test_datasets` give dicts {"tokens": LongTensor [seq_length + 1],
"loss_mask": FloatTensor [seq_length]} (see `builder` and `gpt_dataset`).
"""

from megadomino.data.blend import BlendedDataset
from megadomino.data.builder import (
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
)
from megadomino.data.gpt_dataset import GPTDataset
from megadomino.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megadomino.data.mock import MockDataset
from megadomino.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer

__all__ = [
    "TOKENIZER_TYPES",
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MockDataset",
    "Tokenizer",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "parse_data_path",
    "parse_split",
]
