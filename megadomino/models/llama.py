"""LlamaModel: GPTModel with the Llama-2 architecture required (RMSNorm, SwiGLU, rotary
embeddings with base `rotary_base`, grouped-query attention, no biases, untied output)."""

from __future__ import annotations

from megadomino.config import ARCHITECTURES, ConfigError, FP8Recipe, ModelConfig, ParallelConfig
from megadomino.models.gpt import GPTModel


class LlamaModel(GPTModel):
    def __init__(self, config: ModelConfig, dims, device=None, *,
                 parallel: ParallelConfig | None = None, fp8: FP8Recipe | None = None,
                 layer_range: tuple[int, int] | None = None, pre_process: bool = True,
                 post_process: bool = True):
        for field, value in ARCHITECTURES["llama"].items():
            if getattr(config, field) != value:
                raise ConfigError(
                    f"LlamaModel needs {field}={value!r}, got {getattr(config, field)!r}: start "
                    f"from ModelConfig.preset('llama2-7b') or 'llama-tiny', or use GPTModel")
        super().__init__(config, dims, device, parallel=parallel, fp8=fp8,
                         layer_range=layer_range, pre_process=pre_process,
                         post_process=post_process)
