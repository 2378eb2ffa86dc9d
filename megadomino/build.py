"""build_model: this rank's shards of a model family, its layers run as ParallelConfig says.

The model (megadomino.models) is built with the layout its parallel linears need (sequence
parallelism, fused SP communication, FP8); then megadomino.overlap hands its layer stack the
runner the configuration asks for (full recompute, Domino's schedule).
"""

from __future__ import annotations

from megadomino import overlap
from megadomino.config import ConfigError, FP8Recipe, ModelConfig, ParallelConfig
from megadomino.models import FAMILIES, GPTModel


def build_model(config: ModelConfig, dims, family: str = "gpt", device=None, *,
                parallel: ParallelConfig | None = None, fp8: FP8Recipe | None = None) -> GPTModel:
    """A model of `family` ('gpt' or 'llama') with this rank's shards, on `device` (default: the
    current CUDA device, else CPU), parameters in config.params_dtype; its layers run as
    `parallel` says (default ParallelConfig(): plain TP), FP8 GEMMs with `fp8`."""
    if family not in FAMILIES:
        raise ConfigError(f"model family {family!r} is unknown: choose 'gpt' or 'llama'")
    parallel = parallel or ParallelConfig()
    model = FAMILIES[family](config, dims, device, parallel=parallel, fp8=fp8)
    overlap.apply(model, parallel)
    return model
