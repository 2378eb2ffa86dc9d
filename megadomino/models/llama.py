"""LlamaModel: GPTModel with the Llama-2 architecture required (RMSNorm, SwiGLU, rotary
embeddings with base `rotary_base`, grouped-query attention, no biases, untied output)."""

from __future__ import annotations

from megadomino.config import ConfigError, ModelConfig
from megadomino.models.gpt import GPTModel

LLAMA_ARCHITECTURE = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "untie_embeddings_and_output_weights": True,
}


class LlamaModel(GPTModel):
    def __init__(self, config: ModelConfig, dims, device=None):
        for field, value in LLAMA_ARCHITECTURE.items():
            if getattr(config, field) != value:
                raise ConfigError(
                    f"LlamaModel needs {field}={value!r}, got {getattr(config, field)!r}: start "
                    f"from ModelConfig.preset('llama2-7b') or 'llama-tiny', or use GPTModel")
        super().__init__(config, dims, device)
