"""The model families: GPTModel (GPT-3) and LlamaModel (Llama-2), and StageChunks (the parts a
pipeline stage holds). megadomino.build.build_stage builds a stage's (build_model: the whole
model's) with the runner its ParallelConfig asks for."""

from __future__ import annotations

from megadomino.models.gpt import GPTModel
from megadomino.models.llama import LlamaModel
from megadomino.models.stage import StageChunks

FAMILIES = {"gpt": GPTModel, "llama": LlamaModel}

__all__ = ["FAMILIES", "GPTModel", "LlamaModel", "StageChunks"]
