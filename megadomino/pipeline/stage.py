"""A pipeline stage's model: its chunks of the GPT / Llama model, built from the plan.

Chunk v of stage s is a `GPTModel` part (models/gpt.py: `layer_range`, `pre_process`,
`post_process`) holding virtual stage v P + s's layers; the first virtual stage holds the
embedding, the last the final norm, output layer and loss. Every chunk draws the whole model's
initial values from the same generator state (restored before each), so a pipelined model starts
from the weights the PP=1 model of the same seed has.

Tied embedding (GPT, `untie_embeddings_and_output_weights` off): the first and last stage both
hold `word_embeddings.weight` (equal at start); `tie_embedding_grads` sums their gradients over
the embedding group (those two stages' ranks at the same (dp, tp) position), as Megatron's
embedding group does, so both copies take the same optimizer steps. The last stage's copy is
marked `pipeline_duplicate` so the grad norm counts it once.

A chunk's `run(x, tokens, labels, loss_mask)`: x is the received activation (None on the first
virtual stage, which embeds `tokens`); returns the activation for the next virtual stage, or on
the last one the micro-batch's loss (mask-weighted mean over its labels, fp32 scalar).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megadomino import overlap
from megadomino.config import ConfigError, FP8Recipe, ModelConfig, ParallelConfig
from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.models import FAMILIES, GPTModel
from megadomino.models.gpt import gather_full


def build_stage(config: ModelConfig, dims, plan: PipelinePlan, family: str = "gpt",
                device=None, *, parallel: ParallelConfig | None = None,
                fp8: FP8Recipe | None = None, init_seed: int | None = None) -> StageChunks:
    """This rank's chunks (StageChunks: GPTModel parts, one per virtual stage it holds, and the
    rank's Stage of the plan, looked up here once), each with the runner `parallel` asks for
    (recompute). The initial values come from the default generator as it is (`init_seed`
    None) or seeded with `init_seed`, which leaves the rank's own generator untouched: the
    training loop passes --seed, so every stage starts from the weights the PP=1 run has
    (Megatron seeds stage s with seed + 100 s, and draws its weights from that; here that
    stream is left to dropout)."""
    if family not in FAMILIES:
        raise ConfigError(f"model family {family!r} is unknown: choose 'gpt' or 'llama'")
    parallel = parallel or ParallelConfig()
    stage = plan.stage_of(dims.rank)
    cuda = torch.cuda.is_available()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [],
                               enabled=init_seed is not None):
        if init_seed is not None:
            torch.manual_seed(init_seed)
        chunks = _draw_chunks(config, dims, plan, stage, family, device, parallel, fp8)
    if plan.size > 1 and stage.index == plan.size - 1 and chunks[-1].word_embeddings is not None:
        chunks[-1].word_embeddings.weight.pipeline_duplicate = True
    return StageChunks(chunks, stage)


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
        return [(global_name(model, name), param) for model in self
                for name, param in model.named_parameters()]


def _draw_chunks(config: ModelConfig, dims, plan: PipelinePlan, stage: Stage, family: str,
                 device, parallel: ParallelConfig, fp8: FP8Recipe | None) -> list[GPTModel]:
    """Stage `stage`'s chunks, each built from the same generator state (restored before
    each)."""
    cuda = torch.cuda.is_available()
    start_cpu = torch.get_rng_state()
    start_cuda = torch.cuda.get_rng_state() if cuda else None
    chunks = []
    for v, layers in enumerate(stage.layers):
        torch.set_rng_state(start_cpu)
        if cuda:
            torch.cuda.set_rng_state(start_cuda)
        model = FAMILIES[family](
            config, dims, device, parallel=parallel, fp8=fp8, layer_range=layers,
            pre_process=stage.index == 0 and v == 0,
            post_process=stage.index == plan.size - 1 and v == plan.chunks - 1)
        overlap.apply(model, parallel)
        chunks.append(model)
    return chunks


def run_chunk(model: GPTModel, x: torch.Tensor | None, tokens: torch.Tensor,
              labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One chunk's forward on one micro-batch (module docstring)."""
    if x is None:
        x = model.embed(tokens, None)
    x = model.decoder(x, model.rotary(tokens.shape[1], None, tokens.device))
    if not model.post_process:
        return x
    per_token = model.loss_parallel(model.logits_parallel(x), labels, loss_mask)
    # An all-zero mask (an SFT prompt filling the sequence) contributes 0, not 0 / 0.
    return per_token.sum() / loss_mask.sum().clamp(min=1.0)


def embedding_group(plan: PipelinePlan, dims):
    """The group of the first and last stage's ranks at this rank's (dp, tp) position, or None
    (PP 1, or an untied output layer). Collective over the world: every rank calls it."""
    first, last = plan.stages[0], plan.stages[-1]
    mine = None
    for position in range(len(first.ranks)):
        ranks = [first.ranks[position], last.ranks[position]]
        group = dist.new_group(ranks, timeout=dims.timeout)
        if dims.rank in ranks:
            mine = group
    return mine


def tied_embedding(chunks: nn.ModuleList, plan: PipelinePlan) -> nn.Parameter | None:
    """The word embedding this rank shares with the other end of the pipeline, if any."""
    if plan.size == 1 or chunks[0].config.untie_embeddings_and_output_weights:
        return None
    for model in (chunks[0], chunks[-1]):
        if model.word_embeddings is not None:
            return model.word_embeddings.weight
    return None


def global_name(model: GPTModel, name: str) -> str:
    """A chunk's parameter name under the whole model's (`decoder.layers.{global index}`)."""
    if not name.startswith("decoder.layers."):
        return name
    index, rest = name[len("decoder.layers."):].split(".", 1)
    return f"decoder.layers.{int(index) + model.decoder.layer_offset}.{rest}"


def stage_full_state(chunks: nn.ModuleList, grads: bool = False) -> dict[str, torch.Tensor]:
    """This stage's unsharded parameters (or gradients) under the whole model's names.
    Collective over the TP group."""
    out = {}
    for model in chunks:
        for name, param in model.named_parameters():
            tensor = param.grad if grads else param.detach()
            if tensor is not None:
                out[global_name(model, name)] = gather_full(tensor, param, model.dims).cpu()
    return out


def load_stage_full_state(chunks: nn.ModuleList, full: dict[str, torch.Tensor]) -> None:
    """Load this stage's part of a whole model's unsharded state dict (e.g. full_state_dict()
    of the same model without PP)."""
    for model in chunks:
        model.load_full_state_dict({name: full[global_name(model, name)]
                                    for name, _ in model.named_parameters()})
