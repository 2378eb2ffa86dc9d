"""From the flags to what the loop reads: the tokenizer, the datasets, and the model's starting
weights when they come from a Hugging Face checkpoint.

Pretraining (`--data-path` prefixes) sizes its datasets as Megatron-LM does: the train split holds
iterations x global batch samples, the valid split (eval runs + 1) x --eval-iters x global batch,
the test split --eval-iters x global batch. Fine-tuning (`finetune_llama.py`, JSONL files) builds
`data.sft` datasets of the same sizes.
"""

from __future__ import annotations

import dataclasses
import functools

from megadomino.build import build_model, build_stage
from megadomino.config import Config, DataConfig
from megadomino.config.batches import sample_counts
from megadomino.data import build_tokenizer, build_train_valid_test_datasets
from megadomino.data.builder import rank0_first
from megadomino.data.sft import build_sft_datasets
from megadomino.data.tokenizer import Tokenizer
from megadomino.distributed import ParallelDims
from megadomino.pipeline.runtime import run_plan
from megadomino.train.loop import ModelInit
from megadomino.train.step import Dataset


def run_tokenizer(config: Config) -> tuple[Config, Tokenizer | None]:
    """The tokenizer --tokenizer-type names (None without one) and the config with its
    vocabulary, which wins over --vocab-size as in Megatron-LM (NullTokenizer reads
    --vocab-size). Local file reads only: call it on every rank before the process group."""
    data = config.train.data
    if data.tokenizer_type is None:
        return config, None
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_file,
                                data.merge_file, vocab_size=config.model.vocab_size)
    model = config.model.replace(vocab_size=tokenizer.vocab_size)
    model.validate(tp=config.parallel.tensor_model_parallel_size)
    return dataclasses.replace(config, model=model), tokenizer


def build_datasets(config: Config, dims: ParallelDims, tokenizer: Tokenizer | None,
                   finetune: bool) -> tuple[Dataset | None, Dataset | None]:
    """(train, valid) for --data-path; (None, None) with --mock-data (the loop's default).
    Collective: pretraining datasets are built (and their index cached) on rank 0 first."""
    data, seed = config.train.data, config.train.runtime.seed
    seq, vocab = config.model.seq_length, config.model.vocab_size
    if data.mock_data:
        return None, None
    train_samples, valid_samples, _ = sample_counts(config.train.schedule,
                                                   config.parallel.data_parallel_size(dims.dp))
    if finetune:  # rank 0 reads first: a bad example is one error, alike on every rank
        return rank0_first(functools.partial(
            build_sft_datasets, data.data_path, data.split, tokenizer, seq, data.prompt_template,
            seed, (train_samples, valid_samples), vocab_size=vocab,
            vocab_source=vocab_source(data)))
    # The test split is never read by the loop: it is not built (a small corpus's 0.1% test
    # split may not hold one sample).
    train, valid, _ = build_train_valid_test_datasets(
        data.data_path, data.split, seq, seed, (train_samples, valid_samples, 0), tokenizer.eod,
        data.eod_mask_loss, data.data_cache_path, vocab_size=vocab,
        vocab_source=vocab_source(data))
    return train, valid


def vocab_source(data: DataConfig) -> str:
    """What set the vocabulary, in flags: --vocab-size for the NullTokenizer, else the
    tokenizer and its file."""
    kind = data.tokenizer_type
    if kind == "NullTokenizer":
        return "--vocab-size (NullTokenizer)"
    files = data.tokenizer_model or data.vocab_file
    return f"--tokenizer-type {kind}" + (f" ({files})" if files else "")


def hf_model_init(hf_dir: str) -> ModelInit:
    """Builds this rank's model, or with pipeline stages its stage (megadomino.build), of the
    run's resolved config (config.json's with the architecture overrides and precision applied,
    checked against the checkpoint's tensors by the launcher), filled with its layers' tensors
    from the Hugging Face Llama directory `hf_dir`."""
    def init(config: Config, dims: ParallelDims):
        from megadomino.interop.hf import load_llama_weights

        fp8 = config.train.precision.fp8
        if dims.pp == 1:
            model = build_model(config.model, dims, "llama", parallel=config.parallel, fp8=fp8)
        else:
            model = build_stage(config.model, dims, run_plan(config, dims), "llama",
                                parallel=config.parallel, fp8=fp8,
                                init_seed=config.train.runtime.seed)
        load_llama_weights(model, hf_dir)
        return model

    return init
