"""The model families: GPTModel (GPT-3) and LlamaModel (Llama-2)."""

from __future__ import annotations

from megadomino.config import ConfigError, ModelConfig
from megadomino.models.gpt import GPTModel
from megadomino.models.llama import LlamaModel

FAMILIES = {"gpt": GPTModel, "llama": LlamaModel}


def build_model(config: ModelConfig, dims, family: str = "gpt", device=None) -> GPTModel:
    """Build a model of `family` ('gpt' or 'llama') with this rank's shards, on `device`
    (default: the current CUDA device, else CPU), parameters in config.params_dtype."""
    if family not in FAMILIES:
        raise ConfigError(f"model family {family!r} is unknown: choose 'gpt' or 'llama'")
    return FAMILIES[family](config, dims, device)


__all__ = ["GPTModel", "LlamaModel", "build_model"]
