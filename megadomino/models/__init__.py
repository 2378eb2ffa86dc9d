"""The model families: GPTModel (GPT-3) and LlamaModel (Llama-2). megadomino.build.build_model
builds one with the runner its ParallelConfig asks for."""

from __future__ import annotations

from megadomino.models.gpt import GPTModel
from megadomino.models.llama import LlamaModel

FAMILIES = {"gpt": GPTModel, "llama": LlamaModel}

__all__ = ["FAMILIES", "GPTModel", "LlamaModel"]
