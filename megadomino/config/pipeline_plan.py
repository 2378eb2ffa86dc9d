"""The pipeline plan: which ranks hold which stage, how each stage splits its layers, as one value.

A plan is a tuple of `Stage`s, one per pipeline rank of the run; a stage lists its ranks (every
rank of that pipeline position: its DP x TP block), its TP degree and its layer range per model
chunk (one chunk, or V under the interleaved schedule). `uniform_plan` builds Megatron's split:

    grid = arange(world).view(pp, dp, tp)       stage s holds grid[s] (ranks s*dp*tp ...)
    layers: L / (P V) per chunk; chunk v of stage s holds virtual stage v P + s, or under the
    ZBV schedule's V placement (2 chunks) stage s holds virtual stages s and 2 P - 1 - s
    --decoder-first/last-pipeline-num-layers: the first / last stage hold that many layers
    and the stages between split the rest evenly (V = 1 only)

e.g. 7 layers over PP=2 with --decoder-first-pipeline-num-layers 4: [0, 4) and [4, 7). The
split's arithmetic is config/pipeline_split.py's `layer_split`, which the validator runs too: a
split that does not divide is refused there, one line naming the flag.

`--pipeline-plan FILE` gives a heterogeneous plan instead (`read_plan`): stages of different TP
degrees and DP sizes, joined by the resharding transport (pipeline/transport_reshard.py). The
file lists the stages in pipeline order; each gives its global ranks, its TP degree and its
layer range [start, end):

    {"stages": [{"ranks": [0, 1], "tp": 2, "layers": [0, 4]},
                {"ranks": [2, 3, 4], "tp": 1, "layers": [4, 7]}]}

A stage's ranks are its batch-split DP x TP block in Megatron's order (TP fastest):
dp = len(ranks) / tp, and rank ranks[d * tp + t] is its (dp d, tp t). Under a plan the
pipeline's micro-batch is `--micro-batch-size` sequences in all, which each stage splits over
its own DP ranks (unevenly where they do not divide: torch.tensor_split's rule), so the batch
arithmetic counts one data-parallel replica of the whole pipeline.

The plan is one value, resolved once before any process group (`resolve_plan`: the file as the
argument parser read it, or the flags' uniform plan); `ParallelDims` is built from it and every
later step takes it (a rank's own stage: `stage_of`, looked up once by the stage builder and
handed on). A plan computed from the world (`--pipeline-plan auto`: pipeline/placement/'s
`resolve_auto`, from measured links and speeds) is a resolver of the same result, every rank
returning the same plan: the launcher calls it after init_process_group and before
`ParallelDims`, the flags validated before the group (config/pipeline_auto.py: what can be
planned on the world), the computed plan checked by `check_plan` and `check_composition`.
`plan_file` writes a plan as a file `read_plan` reads. `check_plan` and the rest are the
validator's: every rule names the file and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from megadomino.config.check import ConfigError, check
from megadomino.config.parallel import PIPELINE_RESHARD
from megadomino.config.pipeline_split import holder, layer_split, placement_of, virtual_stage

AUTO = "auto"
"""--pipeline-plan's value for a plan made at start-up from measured links and speeds."""


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
    `chunks` model chunks (virtual stages), placed as `placement` says (pipeline_split.py:
    "loop", chunk v of stage s is virtual stage v P + s; "v", ZBV's V)."""

    stages: tuple[Stage, ...]
    num_layers: int
    batch_split: bool = False
    """A --pipeline-plan file's: a micro-batch is the whole pipeline's, each stage splitting it
    over its DP ranks (the resharding transport joins the stages); False: Megatron's, each DP
    rank runs its own micro-batches through its own column of stages."""
    placement: str = "loop"

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """The virtual stage chunk `chunk` of `stage` holds (pipeline_split.virtual_stage)."""
        return virtual_stage(stage, chunk, self.size, self.placement)

    def holder(self, virtual: int) -> tuple[int, int]:
        """The (stage, chunk) holding virtual stage `virtual`."""
        return holder(virtual, self.size, self.placement)

    @property
    def last_stage(self) -> int:
        """The stage holding the last virtual stage (the output layer and the loss): the last
        stage, or stage 0 under the V placement."""
        return self.holder(self.size * self.chunks - 1)[0]

    @property
    def size(self) -> int:
        return len(self.stages)

    @property
    def chunks(self) -> int:
        return len(self.stages[0].layers)

    @property
    def same_layout(self) -> bool:
        """Every stage has the same TP degree and rank count (plain P2P joins them)."""
        return all(same_layout(self.stages[0], stage) for stage in self.stages)

    @property
    def uniform(self) -> bool:
        """Every stage alike: same TP degree, rank count and layers per chunk."""
        counts = {end - start for stage in self.stages for start, end in stage.layers}
        return self.same_layout and len(counts) == 1

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


def same_layout(first: Stage, second: Stage) -> bool:
    """Same TP degree and rank count: an activation moves between them position by position."""
    return first.tp == second.tp and len(first.ranks) == len(second.ranks)


def uniform_plan(num_layers: int, world: int, tp: int, pp: int, chunks: int = 1,
                 first: int | None = None, last: int | None = None,
                 placement: str = "loop") -> PipelinePlan:
    """Megatron's plan: stage s holds ranks [s * world / pp, (s + 1) * world / pp), TP `tp`,
    its chunks placed as `placement` says (pipeline_split.py)."""
    if world % pp:
        raise ConfigError(f"world size {world} is not divisible by "
                          f"--pipeline-model-parallel-size={pp}")
    per_stage = world // pp
    split = layer_split(num_layers, pp, chunks, first, last, placement)
    stages = tuple(Stage(s, tuple(range(s * per_stage, (s + 1) * per_stage)), tp,
                         tuple(split[s])) for s in range(pp))
    return PipelinePlan(stages, num_layers, placement=placement)


def resolve_plan(config, world_size: int, read: PipelinePlan | None = None) -> PipelinePlan:
    """The run's plan on `world_size` ranks, the one value every later step takes: --pipeline-
    plan's file (`read`: as the argument parser read it, not read again; None: read now), else
    Megatron's uniform plan of the flags. `config`: a Config the validator has passed."""
    parallel, model = config.parallel, config.model
    if parallel.pipeline_plan == AUTO:
        raise ConfigError("--pipeline-plan auto is planned once the process group exists "
                          "(pipeline/placement/resolve.py's resolve_auto): build ParallelDims "
                          "with its plan")
    if parallel.pipeline_plan is not None:
        return read if read is not None else read_plan(parallel.pipeline_plan, model.num_layers)
    return uniform_plan(model.num_layers, world_size, parallel.tensor_model_parallel_size,
                        parallel.pipeline_model_parallel_size,
                        parallel.virtual_chunks(model.num_layers),
                        parallel.decoder_first_pipeline_num_layers,
                        parallel.decoder_last_pipeline_num_layers,
                        placement_of(parallel.pipeline_schedule))


def read_plan(path: str, num_layers: int) -> PipelinePlan:
    """The plan of the file `path` (module docstring: one chunk a stage, batch-split) over a
    model of `num_layers` layers, which `check_plan` checks its layer ranges against;
    ConfigError naming the file when it is not a plan. A pure function of the file: every rank
    reads the same plan."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"--pipeline-plan {path}: not found") from None
    except IsADirectoryError:
        raise ConfigError(f"--pipeline-plan {path}: a directory, not a JSON file") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--pipeline-plan {path}: cannot be read as JSON ({err})") from None
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"--pipeline-plan {path}: expected an object with a non-empty list "
                          "'stages'")
    return PipelinePlan(tuple(_stage(path, index, entry) for index, entry in enumerate(stages)),
                        num_layers, batch_split=True)


def plan_file(plan: PipelinePlan) -> str:
    """The plan as a --pipeline-plan file (one chunk a stage), which read_plan reads back."""
    stages = [{"ranks": list(stage.ranks), "tp": stage.tp, "layers": list(stage.layers[0])}
              for stage in plan.stages]
    return json.dumps({"stages": stages}) + "\n"


def _stage(path: str, index: int, entry) -> Stage:
    where = f"--pipeline-plan {path}: stage {index}"
    keys = ("ranks", "tp", "layers")
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object with the keys 'ranks', 'tp' and 'layers'")
    unknown = [key for key in entry if key not in keys]
    missing = [key for key in keys if key not in entry]
    if unknown or missing:
        said = ([f"unknown key{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}"]
                if unknown else []) + ([f"no {', '.join(map(repr, missing))}"] if missing else [])
        raise ConfigError(f"{where}: {'; '.join(said)} (a stage has exactly the keys 'ranks', "
                          "'tp' and 'layers')")
    ranks, tp, layers = entry["ranks"], entry["tp"], entry["layers"]
    if not isinstance(ranks, list) or not ranks or not all(_is_int(r) for r in ranks):
        raise ConfigError(f"{where}: 'ranks' must be a non-empty list of integers")
    if not _is_int(tp) or tp < 1:
        raise ConfigError(f"{where}: 'tp' must be a positive integer, not {tp!r}")
    if (not isinstance(layers, list) or len(layers) != 2 or not all(map(_is_int, layers))
            or not 0 <= layers[0] < layers[1]):
        raise ConfigError(f"{where}: 'layers' must be [start, end) with 0 <= start < end, "
                          f"not {layers!r}")
    if len(ranks) % tp:
        raise ConfigError(f"{where}: tp {tp} does not divide its {len(ranks)} ranks")
    return Stage(index, tuple(ranks), tp, (tuple(layers),))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_plan(path: str, plan: PipelinePlan, num_layers: int,
               world_size: int | None = None) -> None:
    """The plan's own rules: layer ranges contiguous over [0, num_layers), no rank in two
    stages, and with `world_size` the ranks cover the world exactly once."""
    name = f"--pipeline-plan {path}"
    end = 0
    for stage in plan.stages:
        (start, stop), = stage.layers  # a file's stage holds one chunk
        if start != end:
            raise ConfigError(f"{name}: stage {stage.index} starts at layer {start}, not "
                              f"{end}: the layer ranges must be contiguous from 0")
        end = stop
    if end != num_layers:
        raise ConfigError(f"{name}: the stages end at layer {end}, not at --num-layers "
                          f"({num_layers})")
    ranks = [rank for stage in plan.stages for rank in stage.ranks]
    repeated = sorted({rank for rank in ranks if ranks.count(rank) > 1})
    if repeated:
        raise ConfigError(f"{name}: rank {repeated[0]} is in more than one stage (or twice in "
                          "one)")
    if world_size is not None and sorted(ranks) != list(range(world_size)):
        missing = sorted(set(range(world_size)) - set(ranks))
        outside = sorted(set(ranks) - set(range(world_size)))
        what = (f"rank {outside[0]} is outside the world of {world_size}" if outside else
                f"rank {missing[0]} of the world of {world_size} is in no stage")
        raise ConfigError(f"{name}: the stages must cover the world's ranks exactly once; {what}")


def plan_rules(config, world_size: int | None, plan: PipelinePlan | None = None,
               gpus_per_node: int | None = None) -> list[int]:
    """The validator's rules for --pipeline-plan on a `Config`: the file (`plan`: as already
    read; None: read here), the plan, what composes with it, and its boundaries' flags (refused
    without it). gpus_per_node: the launcher's ranks per node (None: --gpus-per-node, else the
    whole world). Returns the stages' TP degrees, at which the validator checks the layers."""
    parallel, path = config.parallel, config.parallel.pipeline_plan
    check_reshard(parallel, world_size, gpus_per_node)
    if path is None or (path == AUTO and plan is None):  # auto's: config/pipeline_auto.py
        return []
    plan = plan if plan is not None else read_plan(path, config.model.num_layers)
    check_plan(path, plan, config.model.num_layers, world_size)
    check_composition(path, plan, parallel, config.model,
                      config.train.schedule.micro_batch_size)
    check_features(path, config)
    return sorted({stage.tp for stage in plan.stages})


def check_reshard(parallel, world_size: int | None, gpus_per_node: int | None) -> None:
    """--pipeline-reshard and --nics-per-node choose how a plan's boundaries move data and
    nothing else reads them: refused without --pipeline-plan; a node has at most one NIC per
    GPU (the cost model's senders per host at 1, per device at --gpus-per-node)."""
    check(parallel.pipeline_reshard in PIPELINE_RESHARD, "--pipeline-reshard",
          parallel.pipeline_reshard, "one of " + ", ".join(PIPELINE_RESHARD))
    if parallel.pipeline_plan is None:
        for flag, given in (("--pipeline-reshard", parallel.pipeline_reshard != "auto"),
                            ("--nics-per-node", parallel.nics_per_node is not None)):
            if given:
                raise ConfigError(f"{flag} needs --pipeline-plan: it chooses how a plan's "
                                  "boundaries between stages of different layouts move data")
        return
    nics = parallel.nics_per_node
    gpus = parallel.gpus_per_node or gpus_per_node or world_size
    check(nics is None or nics >= 1 and (gpus is None or nics <= gpus), "--nics-per-node", nics,
          f"between 1 and the GPUs per node ({gpus}: --gpus-per-node, else the ranks torchrun "
          "starts on a node)")


def check_features(path: str, config) -> None:
    """The training features and checkpoint formats that run with a uniform pipeline but are
    not composed with a plan's batch-split stages yet (their batch and token arithmetic counts
    the uniform grid's DP; their writers gather at one TP degree), each refused by name."""
    schedule, checkpoint = config.train.schedule, config.train.checkpoint
    refusals = (
        (schedule.calculate_per_token_loss, "--calculate-per-token-loss"),
        (schedule.rampup_batch_size is not None, "--rampup-batch-size"),
        (schedule.step_batch_size_schedule is not None, "--step-batch-size-schedule"),
        (schedule.decoupled_lr is not None, "--decoupled-lr"),
        (config.parallel.zero.overlap_param_gather, "--overlap-param-gather"),
        (checkpoint.hf_checkpoint is not None, "--hf-checkpoint"),
        (checkpoint.ckpt_format == "torch_dist" and checkpoint.save is not None,
         "--ckpt-format torch_dist with --save"),
    )
    for refused, flag in refusals:
        if refused:
            raise ConfigError(f"{flag} cannot be used with --pipeline-plan {path}: not composed "
                              "with heterogeneous stages yet (it runs with a uniform "
                              "--pipeline-model-parallel-size)")


def check_composition(path: str, plan: PipelinePlan, parallel, model,
                      micro_batch_size: int) -> None:
    """What runs beside a plan today, each refusal with its reason. `parallel`: the
    ParallelConfig; `model`: the ModelConfig."""
    name = f"--pipeline-plan {path}"
    stages, count = plan.stages, plan.size
    if count < 2:
        raise ConfigError(f"{name}: a plan needs at least 2 stages (one stage is data and tensor "
                          "parallelism alone)")
    if parallel.pipeline_model_parallel_size != count:
        raise ConfigError(f"--pipeline-model-parallel-size="
                          f"{parallel.pipeline_model_parallel_size} disagrees with {name}'s "
                          f"{count} stages: give --pipeline-model-parallel-size {count}")
    check_flags_beside_plan(name, parallel, model)
    largest = max(stage.dp for stage in stages)
    if micro_batch_size < largest:
        raise ConfigError(f"--micro-batch-size={micro_batch_size} is invalid with {name}: the "
                          f"micro-batch (all of a stage's DP ranks together) must hold at least "
                          f"one sequence per DP rank of every stage ({largest})")
    if not model.untie_embeddings_and_output_weights and not same_layout(stages[0], stages[-1]):
        raise ConfigError(f"{name}: the first and last stage hold the tied embedding and must "
                          "have the same layout (tp and rank count) unless "
                          "--untie-embeddings-and-output-weights")


def check_flags_beside_plan(name: str, parallel, model) -> None:
    """The flags a plan (file or auto) does not compose with, each refused with its reason;
    `name`: '--pipeline-plan FILE'."""
    refusals = (
        (parallel.tensor_model_parallel_size != 1, "--tensor-model-parallel-size",
         "each stage's TP degree is the plan's 'tp'"),
        (parallel.virtual_chunks(model.num_layers) > 1 or parallel.pipeline_schedule
         in ("interleaved", "zbv"), "virtual stages / --pipeline-schedule interleaved or zbv",
         "their schedules need a uniform plan"),
        (parallel.decoder_first_pipeline_num_layers is not None
         or parallel.decoder_last_pipeline_num_layers is not None,
         "--decoder-first/last-pipeline-num-layers", "the plan gives every stage's layers"),
        (parallel.domino.enabled or parallel.domino_auto, "Domino (--domino-*)",
         "Domino's batch slices are not composed with a stage's batch split yet"),
        (parallel.zero.stage == 3, "--zero-stage 3",
         "stage 3 is refused with any pipeline (docs/pipeline.md)"),
    )
    for refused, flag, reason in refusals:
        if refused:
            raise ConfigError(f"{flag} cannot be used with {name}: {reason}")
