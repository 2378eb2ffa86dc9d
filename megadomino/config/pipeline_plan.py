"""`--pipeline-plan FILE`: a heterogeneous pipeline plan, read from JSON and checked.

The file lists the stages in pipeline order; each gives its global ranks, its TP degree and
its layer range [start, end):

    {"stages": [{"ranks": [0, 1], "tp": 2, "layers": [0, 4]},
                {"ranks": [2, 3, 4], "tp": 1, "layers": [4, 7]}]}

A stage's ranks are its batch-split DP x TP block in Megatron's order (TP fastest):
dp = len(ranks) / tp, and rank ranks[d * tp + t] is its (dp d, tp t). Under a plan the
pipeline's micro-batch is `--micro-batch-size` sequences in all, which each stage splits over
its own DP ranks (unevenly where they do not divide: torch.tensor_split's rule), so the batch
arithmetic counts one data-parallel replica of the whole pipeline.

`read_plan` is a pure function of the file: every rank derives the same stages.
`check_plan` is the validator's: every rule names the file and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from megadomino.config.check import ConfigError


@dataclass(frozen=True)
class StageSpec:
    """One stage of a plan file: its ranks (DP x TP, TP fastest), TP degree, layers [a, b)."""

    ranks: tuple[int, ...]
    tp: int
    layers: tuple[int, int]

    @property
    def dp(self) -> int:
        return len(self.ranks) // self.tp


def read_plan(path: str) -> tuple[StageSpec, ...]:
    """The stages of `path`; ConfigError naming the file when it is not a plan."""
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
    return tuple(_stage(path, index, entry) for index, entry in enumerate(stages))


def _stage(path: str, index: int, entry) -> StageSpec:
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
    return StageSpec(tuple(ranks), tp, tuple(layers))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_plan(path: str, stages: tuple[StageSpec, ...], num_layers: int,
               world_size: int | None = None) -> None:
    """The plan's own rules: layer ranges contiguous over [0, num_layers), no rank in two
    stages, and with `world_size` the ranks cover the world exactly once."""
    name = f"--pipeline-plan {path}"
    end = 0
    for index, stage in enumerate(stages):
        if stage.layers[0] != end:
            raise ConfigError(f"{name}: stage {index} starts at layer {stage.layers[0]}, not "
                              f"{end}: the layer ranges must be contiguous from 0")
        end = stage.layers[1]
    if end != num_layers:
        raise ConfigError(f"{name}: the stages end at layer {end}, not at --num-layers "
                          f"({num_layers})")
    ranks = [rank for stage in stages for rank in stage.ranks]
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


def same_layout(first: StageSpec, second: StageSpec) -> bool:
    """Same TP degree and rank count: an activation moves between them position by position."""
    return first.tp == second.tp and len(first.ranks) == len(second.ranks)


def plan_rules(config, world_size: int | None) -> list[int]:
    """The validator's rules for --pipeline-plan (none without it) on a `Config`: the file,
    the plan, what composes with it. Returns the stages' TP degrees, at which the validator
    checks the layers."""
    parallel, path = config.parallel, config.parallel.pipeline_plan
    if path is None:
        return []
    stages = read_plan(path)
    check_plan(path, stages, config.model.num_layers, world_size)
    check_composition(path, stages, parallel, config.model,
                      config.train.schedule.micro_batch_size)
    check_features(path, config)
    return sorted({stage.tp for stage in stages})


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


def check_composition(path: str, stages: tuple[StageSpec, ...], parallel, model,
                      micro_batch_size: int) -> None:
    """What runs beside a plan today, each refusal with its reason. `parallel`: the
    ParallelConfig; `model`: the ModelConfig."""
    name = f"--pipeline-plan {path}"
    count = len(stages)
    if count < 2:
        raise ConfigError(f"{name}: a plan needs at least 2 stages (one stage is data and tensor "
                          "parallelism alone)")
    if parallel.pipeline_model_parallel_size != count:
        raise ConfigError(f"--pipeline-model-parallel-size="
                          f"{parallel.pipeline_model_parallel_size} disagrees with {name}'s "
                          f"{count} stages: give --pipeline-model-parallel-size {count}")
    refusals = (
        (parallel.tensor_model_parallel_size != 1, "--tensor-model-parallel-size",
         "each stage's TP degree is the plan's 'tp'"),
        (parallel.virtual_chunks(model.num_layers) > 1 or parallel.pipeline_schedule
         == "interleaved", "virtual stages / --pipeline-schedule interleaved",
         "the interleaved schedule needs a uniform plan"),
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
    largest = max(stage.dp for stage in stages)
    if micro_batch_size < largest:
        raise ConfigError(f"--micro-batch-size={micro_batch_size} is invalid with {name}: the "
                          f"micro-batch (all of a stage's DP ranks together) must hold at least "
                          f"one sequence per DP rank of every stage ({largest})")
    if not model.untie_embeddings_and_output_weights and not same_layout(stages[0], stages[-1]):
        raise ConfigError(f"{name}: the first and last stage hold the tied embedding and must "
                          "have the same layout (tp and rank count) unless "
                          "--untie-embeddings-and-output-weights")
