"""The model families: GPTModel (GPT-3) and LlamaModel (Llama-2)."""

from __future__ import annotations

from megadomino.config import ConfigError, FP8Recipe, ModelConfig, ParallelConfig
from megadomino.models.gpt import GPTModel
from megadomino.models.llama import LlamaModel

FAMILIES = {"gpt": GPTModel, "llama": LlamaModel}


def build_model(config: ModelConfig, dims, family: str = "gpt", device=None, *,
                parallel: ParallelConfig | None = None, fp8: FP8Recipe | None = None) -> GPTModel:
    """Build a model of `family` ('gpt' or 'llama') with this rank's shards, on `device`
    (default: the current CUDA device, else CPU), parameters in config.params_dtype; its layers
    run as `parallel` says (default: ParallelConfig(), plain TP), FP8 GEMMs with `fp8`."""
    if family not in FAMILIES:
        raise ConfigError(f"model family {family!r} is unknown: choose 'gpt' or 'llama'")
    return FAMILIES[family](config, dims, device, parallel=parallel, fp8=fp8)


__all__ = ["GPTModel", "LlamaModel", "build_model"]
