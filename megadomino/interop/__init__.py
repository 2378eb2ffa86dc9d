"""Checkpoint interop: Hugging Face Llama directories (config.json + safetensors) at any TP and
PP, and Megatron-LM's checkpoints (`torch_dist` read and written, the legacy `torch` format
read).

Neither `transformers` nor megatron is imported here: `safetensors` reads and writes the first,
torch.distributed.checkpoint and torch's weights-only unpickler the second."""

from megadomino.interop.hf import load_llama, load_llama_weights, save_llama
from megadomino.interop.hf_config import hf_config_from, model_config_from_hf
from megadomino.interop.megatron import MegatronCheckpointError, megatron_format
from megadomino.interop.megatron_dist import save_megatron_dist
from megadomino.interop.megatron_load import load_megatron

__all__ = ["MegatronCheckpointError", "hf_config_from", "load_llama", "load_llama_weights",
           "load_megatron", "megatron_format", "model_config_from_hf", "save_llama",
           "save_megatron_dist"]
