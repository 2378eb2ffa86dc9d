"""The model builder: this rank's stage of a pipeline plan, its layers run as ParallelConfig says.

`build_stage` draws the rank's chunks of the plan (megadomino.models: GPTModel parts, held in a
StageChunks); the whole model is the one chunk of a one-stage plan's stage (`build_model`).
Each chunk is built with the layout its parallel linears need (sequence parallelism, fused SP
communication, FP8); then megadomino.overlap hands its layer stack the runner the configuration
asks for (full recompute, Domino's schedule).

Every chunk draws the whole model's initial values from the same generator state (restored
before each), so a pipelined model starts from the weights the PP=1 model of the same seed has.

Tied embedding (GPT, `untie_embeddings_and_output_weights` off): the first and last stage both
hold `word_embeddings.weight` (equal at start); the pipeline runtime sums their gradients over
the embedding group (pipeline/stage.py), as Megatron's embedding group does. The output
layer's copy (the last stage's; under ZBV's V placement stage 0's chunk 1's, summed with its
chunk 0's on the rank) is marked `pipeline_duplicate` here so the grad norm counts it once.
"""

from __future__ import annotations

import torch

from megadomino import overlap
from megadomino.config import ConfigError, FP8Recipe, ModelConfig, ParallelConfig
from megadomino.config.pipeline_plan import PipelinePlan, Stage, uniform_plan
from megadomino.models import FAMILIES, GPTModel, StageChunks


def build_model(config: ModelConfig, dims, family: str = "gpt", device=None, *,
                parallel: ParallelConfig | None = None, fp8: FP8Recipe | None = None) -> GPTModel:
    """The whole model of `family` ('gpt' or 'llama') with this rank's shards: the one chunk of
    a one-stage plan's stage (build_stage), drawn from the default generator as it is."""
    whole = uniform_plan(config.num_layers, dims.world_size, dims.tp, 1)
    return build_stage(config, dims, whole, family, device, parallel=parallel, fp8=fp8)[0]


def build_stage(config: ModelConfig, dims, plan: PipelinePlan, family: str = "gpt",
                device=None, *, parallel: ParallelConfig | None = None,
                fp8: FP8Recipe | None = None, init_seed: int | None = None) -> StageChunks:
    """This rank's chunks of `plan` (StageChunks: GPTModel parts of `family`, one per virtual
    stage it holds, and the rank's Stage of the plan, looked up here once), on `device`
    (default: the current CUDA device, else CPU), parameters in config.params_dtype; their
    layers run as `parallel` says (default ParallelConfig(): plain TP), FP8 GEMMs with `fp8`.
    The initial values come from the default generator as it is (`init_seed` None) or seeded
    with `init_seed`, which leaves the rank's own generator untouched: the training loop passes
    --seed at PP > 1, so every stage starts from the weights the PP=1 run has (Megatron seeds
    stage s with seed + 100 s, and draws its weights from that; here that stream is left to
    dropout)."""
    if family not in FAMILIES:
        raise ConfigError(f"model family {family!r} is unknown: choose 'gpt' or 'llama'")
    parallel = parallel or ParallelConfig()
    stage = plan.stages[0] if plan.size == 1 else plan.stage_of(dims.rank)
    cuda = torch.cuda.is_available()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [],
                               enabled=init_seed is not None):
        if init_seed is not None:
            torch.manual_seed(init_seed)
        chunks = _draw_chunks(config, dims, plan, stage, family, device, parallel, fp8)
    if plan.size > 1 and stage.index == plan.last_stage and chunks[-1].word_embeddings is not None:
        chunks[-1].word_embeddings.weight.pipeline_duplicate = True
    return StageChunks(chunks, stage)


def _draw_chunks(config: ModelConfig, dims, plan: PipelinePlan, stage: Stage, family: str,
                 device, parallel: ParallelConfig, fp8: FP8Recipe | None) -> list[GPTModel]:
    """Stage `stage`'s chunks, each built from the same generator state (restored before each
    but the first, which finds it so)."""
    cuda = torch.cuda.is_available()
    start_cpu = torch.get_rng_state()
    start_cuda = torch.cuda.get_rng_state() if cuda else None
    chunks = []
    for v, layers in enumerate(stage.layers):
        if v > 0:
            torch.set_rng_state(start_cpu)
            if cuda:
                torch.cuda.set_rng_state(start_cuda)
        model = FAMILIES[family](
            config, dims, device, parallel=parallel, fp8=fp8, layer_range=layers,
            pre_process=plan.virtual_stage(stage.index, v) == 0,
            post_process=plan.virtual_stage(stage.index, v) == plan.size * plan.chunks - 1)
        overlap.apply(model, parallel)
        chunks.append(model)
    return chunks
