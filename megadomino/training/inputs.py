"""From the flags to what the loop reads: the tokenizer, the datasets, and the model's starting
weights when they come from a Hugging Face checkpoint.

Pretraining (`--data-path` prefixes) sizes its datasets as Megatron-LM does: the train split holds
iterations x global batch samples, the valid split (eval runs + 1) x --eval-iters x global batch,
the test split --eval-iters x global batch. Fine-tuning (`finetune_llama.py`, JSONL files) builds
`data.sft` datasets of the same sizes.
"""

from __future__ import annotations

from megadomino.config import ModelConfig, TrainConfig
from megadomino.parallel import ParallelDims
from megadomino.training.data import build_tokenizer, build_train_valid_test_datasets
from megadomino.training.data.sft import build_sft_datasets
from megadomino.training.data.tokenizer import Tokenizer
from megadomino.training.loop import ModelInit
from megadomino.training.step import Dataset
from megadomino.validate import batch_plan, train_iterations


def run_tokenizer(model_config: ModelConfig, train_config: TrainConfig
                  ) -> tuple[ModelConfig, Tokenizer | None]:
    """The tokenizer --tokenizer-type names (None without one) and the model config with its
    vocabulary, which wins over --vocab-size as in Megatron-LM (NullTokenizer reads
    --vocab-size). Local file reads only: call it on every rank before the process group."""
    if train_config.tokenizer_type is None:
        return model_config, None
    tokenizer = build_tokenizer(train_config.tokenizer_type, train_config.tokenizer_model,
                                train_config.vocab_file, train_config.merge_file,
                                vocab_size=model_config.vocab_size)
    model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
    model_config.validate(tp=train_config.tensor_model_parallel_size)
    return model_config, tokenizer


def sample_counts(train_config: TrainConfig, dp: int) -> tuple[int, int, int]:
    """Samples the train, valid and test splits must hold for this run (Megatron-LM's sizing)."""
    gbs, _ = batch_plan(train_config, dp)
    iters = train_iterations(train_config, gbs)
    evaluations = iters // train_config.eval_interval + 1 if train_config.eval_interval > 0 else 0
    return iters * gbs, evaluations * train_config.eval_iters * gbs, train_config.eval_iters * gbs


def build_datasets(model_config: ModelConfig, train_config: TrainConfig, dims: ParallelDims,
                   tokenizer: Tokenizer | None, finetune: bool
                   ) -> tuple[Dataset | None, Dataset | None]:
    """(train, valid) for --data-path; (None, None) with --mock-data (the loop's default).
    Collective: pretraining datasets are built (and their index cached) on rank 0 first."""
    if train_config.mock_data:
        return None, None
    train_samples, valid_samples, _ = sample_counts(train_config, dims.dp)
    if finetune:
        return build_sft_datasets(train_config.data_path, train_config.split, tokenizer,
                                  model_config.seq_length, train_config.prompt_template,
                                  train_config.seed, (train_samples, valid_samples),
                                  vocab_size=model_config.vocab_size,
                                  vocab_source=vocab_source(train_config))
    # The test split is never read by the loop: it is not built (a small corpus's 0.1% test
    # split may not hold one sample).
    train, valid, _ = build_train_valid_test_datasets(
        train_config.data_path, train_config.split, model_config.seq_length, train_config.seed,
        (train_samples, valid_samples, 0), tokenizer.eod, train_config.eod_mask_loss,
        train_config.data_cache_path, vocab_size=model_config.vocab_size,
        vocab_source=vocab_source(train_config))
    return train, valid


def vocab_source(train_config: TrainConfig) -> str:
    """What set the vocabulary, in flags: --vocab-size for the NullTokenizer, else the
    tokenizer and its file."""
    kind = train_config.tokenizer_type
    if kind == "NullTokenizer":
        return "--vocab-size (NullTokenizer)"
    files = train_config.tokenizer_model or train_config.vocab_file
    return f"--tokenizer-type {kind}" + (f" ({files})" if files else "")


def hf_model_init(hf_dir: str) -> ModelInit:
    """Builds the model from a Hugging Face Llama directory, with the run's resolved config
    (precision, sequence parallelism, recompute, ...) applied over config.json's."""
    def init(model_config: ModelConfig, dims: ParallelDims):
        from megadomino.interop.hf import load_llama

        return load_llama(hf_dir, dims, **vars(model_config))

    return init
