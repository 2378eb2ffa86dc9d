"""StageChunks: the model parts one rank holds under a pipeline plan, with its Stage.

Chunk v of stage s is a GPTModel part (gpt.py: `layer_range`, `pre_process`, `post_process`)
holding virtual stage v P + s's layers (under ZBV's V placement, chunk 0 virtual stage s and
chunk 1 virtual stage 2 P - 1 - s: config/pipeline_split.py). The whole model is the one
chunk of a one-stage plan's stage; megadomino.build draws every stage's chunks (`build_stage`).
"""

from __future__ import annotations

from torch import nn

from megadomino.config import ModelConfig
from megadomino.config.pipeline_plan import Stage
from megadomino.models.gpt import GPTModel


class StageChunks(nn.ModuleList):
    """A stage's chunks (GPTModel parts, in chunk order) and its `stage` (the plan's Stage this
    rank holds: what the pipeline's runtime, transport and executor run). `config` is the whole
    model's; `checkpoint_parameters()` names each parameter as the whole model does
    (checkpoints key them so, and load them at another pipeline degree)."""

    def __init__(self, chunks: list[GPTModel], stage: Stage):
        super().__init__(chunks)
        self.stage = stage

    @property
    def config(self) -> ModelConfig:
        return self[0].config

    @property
    def dims(self):
        """The rank's ParallelDims (its chunks')."""
        return self[0].dims

    def embedding_and_output_weights(self) -> list[nn.Parameter]:
        """What --decoupled-lr gives its own rate, as Megatron marks them per stage: the word
        embedding of the first stage, the output layer of the last (with a tied embedding, its
        copy there), nothing in between."""
        return [weight for model in self
                for weight in (getattr(model.word_embeddings, "weight", None),
                               model.output_weight) if weight is not None]

    def checkpoint_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [named for model in self for named in model.checkpoint_parameters()]
