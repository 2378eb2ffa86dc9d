"""Checkpoint interop: Hugging Face Llama directories (config.json + safetensors) at any TP.

`transformers` is never imported here; only `safetensors` is needed to read and write."""

from megadomino.interop.hf import load_llama, save_llama
from megadomino.interop.hf_config import hf_config_from, model_config_from_hf

__all__ = ["hf_config_from", "load_llama", "model_config_from_hf", "save_llama"]
