"""A pipeline plan: which ranks hold which stage, how each stage splits its layers, as data.

A plan is a tuple of `Stage`s, one per pipeline rank of Megatron's grid; a stage lists its ranks
(every rank of that pipeline position: its DP x TP block), its TP degree and its layer range per
model chunk (one chunk, or V under the interleaved schedule). The format allows per-stage ranks,
TP degree and layer ranges (heterogeneous meshes); `uniform_plan` builds Megatron's split:

    grid = arange(world).view(pp, dp, tp)       stage s holds grid[s] (ranks s*dp*tp ...)
    layers: L / (P V) per chunk; chunk v of stage s holds virtual stage v P + s
    --decoder-first/last-pipeline-num-layers: the first / last stage hold that many layers
    and the stages between split the rest evenly (V = 1 only)

`plan_from_stages` builds the plan of a --pipeline-plan file (config/pipeline_plan.py): stages
of different TP degrees and DP sizes, joined by the resharding transport (reshard_transport.py).

e.g. 7 layers over PP=2 with --decoder-first-pipeline-num-layers 4: [0, 4) and [4, 7).
The split's arithmetic is config/pipeline_split.py's `layer_split`, which the validator runs too:
a split that does not divide is refused there, one line naming the flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megadomino.config import ConfigError
from megadomino.config.pipeline_plan import StageSpec
from megadomino.config.pipeline_split import layer_split


@dataclass(frozen=True)
class Stage:
    """One pipeline stage. ranks: every global rank of the stage (DP x TP, Megatron's order);
    tp: its TP degree; layers: (start, end) per model chunk, in chunk order."""

    index: int
    ranks: tuple[int, ...]
    tp: int
    layers: tuple[tuple[int, int], ...]

    @property
    def num_layers(self) -> int:
        return sum(end - start for start, end in self.layers)

    @property
    def dp(self) -> int:
        """Batch-split data-parallel ranks: the stage's rank (d, t) is ranks[d * tp + t]."""
        return len(self.ranks) // self.tp


@dataclass(frozen=True)
class PipelinePlan:
    """The stages in pipeline order, over a model of `num_layers` layers; every stage holds
    `chunks` model chunks (virtual stages), the chunk v of stage s being virtual stage v P + s."""

    stages: tuple[Stage, ...]
    num_layers: int
    batch_split: bool = False
    """A --pipeline-plan file's: a micro-batch is the whole pipeline's, each stage splitting it
    over its DP ranks (the resharding transport joins the stages); False: Megatron's, each DP
    rank runs its own micro-batches through its own column of stages."""

    @property
    def size(self) -> int:
        return len(self.stages)

    @property
    def chunks(self) -> int:
        return len(self.stages[0].layers)

    @property
    def same_layout(self) -> bool:
        """Every stage has the same TP degree and rank count (plain P2P joins them)."""
        first = self.stages[0]
        return all(s.tp == first.tp and len(s.ranks) == len(first.ranks) for s in self.stages)

    @property
    def uniform(self) -> bool:
        """Every stage alike: same TP degree, rank count and layers per chunk."""
        first = self.stages[0]
        counts = {end - start for stage in self.stages for start, end in stage.layers}
        return all(s.tp == first.tp and len(s.ranks) == len(first.ranks)
                   for s in self.stages) and len(counts) == 1

    def stage_of(self, rank: int) -> Stage:
        for stage in self.stages:
            if rank in stage.ranks:
                return stage
        raise ValueError(f"rank {rank} is in no stage of the plan")

    def table(self) -> str:
        """One stage a line: what the start-up summary and docs print."""
        lines = []
        for stage in self.stages:
            layers = " ".join(f"[{start}, {end})" for start, end in stage.layers)
            lines.append(f"stage {stage.index}: ranks {list(stage.ranks)} tp {stage.tp} "
                         f"layers {layers}")
        return "\n".join(lines) + "\n"


def plan_from_stages(stages: Sequence[StageSpec], num_layers: int) -> PipelinePlan:
    """The plan of a --pipeline-plan file's stages (config/pipeline_plan.py, checked by the
    validator): one chunk a stage."""
    return PipelinePlan(tuple(Stage(index, spec.ranks, spec.tp, (spec.layers,))
                              for index, spec in enumerate(stages)), num_layers,
                        batch_split=True)


def uniform_plan(num_layers: int, world: int, tp: int, pp: int, chunks: int = 1,
                 first: int | None = None, last: int | None = None) -> PipelinePlan:
    """Megatron's plan: stage s holds ranks [s * world / pp, (s + 1) * world / pp), TP `tp`."""
    if world % pp:
        raise ConfigError(f"world size {world} is not divisible by "
                          f"--pipeline-model-parallel-size={pp}")
    per_stage = world // pp
    split = layer_split(num_layers, pp, chunks, first, last)
    stages = tuple(Stage(s, tuple(range(s * per_stage, (s + 1) * per_stage)), tp,
                         tuple(split[s])) for s in range(pp))
    return PipelinePlan(stages, num_layers)
