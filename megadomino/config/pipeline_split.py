"""Megatron's split of the layers over pipeline stages, as arithmetic (the validator checks it;
config/pipeline_plan.py builds the plan from it).

    virtual pipeline (V chunks a stage): L / (P V) layers a chunk; chunk v of stage s holds
        virtual stage v P + s, layers [(v P + s) n, (v P + s + 1) n) (placement "loop")
    V placement (the ZBV schedule's, 2 chunks a stage): chunk 0 of stage s holds virtual stage s,
        chunk 1 virtual stage 2 P - 1 - s, so the model goes down the stages and back up: the
        last stage feeds its own chunk 1, and stage 0 holds the embedding and the loss
    --decoder-first/last-pipeline-num-layers: the first / last stage hold that many layers, the
        stages between share the rest evenly (one chunk a stage)
"""

from __future__ import annotations

from megadomino.config.check import ConfigError

PLACEMENTS = ("loop", "v")
"""Where a stage's chunks sit in the model (torch.distributed.pipelining's stage-to-rank
styles): "loop", chunk v of stage s is virtual stage v P + s (Megatron's interleaving); "v",
two chunks a stage in a V (module docstring)."""
V_SHAPED = ("zbv",)
"""The --pipeline-schedule values that run the V placement."""


def placement_of(schedule: str) -> str:
    """The placement schedule `schedule` runs its stages' chunks in."""
    return "v" if schedule in V_SHAPED else "loop"


def virtual_stage(stage: int, chunk: int, stages: int, placement: str = "loop") -> int:
    """The virtual stage (position in the model, 0 first) chunk `chunk` of `stage` holds."""
    if placement == "v":
        return stage if chunk == 0 else 2 * stages - 1 - stage
    return chunk * stages + stage


def holder(virtual: int, stages: int, placement: str = "loop") -> tuple[int, int]:
    """The (stage, chunk) holding `virtual`: virtual_stage's inverse."""
    if placement == "v":
        return (virtual, 0) if virtual < stages else (2 * stages - 1 - virtual, 1)
    return virtual % stages, virtual // stages


def layer_split(num_layers: int, pp: int, chunks: int = 1, first: int | None = None,
                last: int | None = None, placement: str = "loop") -> list[list[tuple[int, int]]]:
    """Megatron's split: for each stage, the (start, end) of each of its chunks (virtual stage
    k of `placement` holding layers [k n, (k + 1) n))."""
    if chunks > 1:
        if first is not None or last is not None:
            raise ConfigError("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-"
                              "num-layers cannot be combined with a virtual pipeline: the "
                              "virtual stages need a uniform plan")
        if num_layers % (pp * chunks):
            raise ConfigError(f"--num-layers={num_layers} is invalid with a virtual pipeline: it "
                              f"must be divisible by pipeline size {pp} x virtual stages {chunks}")
        per = num_layers // (pp * chunks)
        starts = [[virtual_stage(s, v, pp, placement) * per for v in range(chunks)]
                  for s in range(pp)]
        return [[(start, start + per) for start in stage] for stage in starts]
    counts = _stage_counts(num_layers, pp, first, last)
    bounds = [sum(counts[:s]) for s in range(pp + 1)]
    return [[(bounds[s], bounds[s + 1])] for s in range(pp)]


def _stage_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    for flag, value in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and not 1 <= value <= num_layers:
            raise ConfigError(f"{flag}={value} is invalid: it must be between 1 and --num-layers "
                              f"({num_layers})")
    fixed = [value for value in (first, last) if value is not None]
    middle = pp - len(fixed)
    rest = num_layers - sum(fixed)
    if pp == 1 and fixed:
        raise ConfigError("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-"
                          "layers need --pipeline-model-parallel-size > 1")
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and (rest % middle or rest == 0)):
        flags = " and ".join(flag for flag, value in
                             (("--decoder-first-pipeline-num-layers", first),
                              ("--decoder-last-pipeline-num-layers", last)) if value is not None)
        raise ConfigError(
            f"--num-layers={num_layers} does not split over --pipeline-model-parallel-size={pp}"
            + (f" with {flags}: the remaining {rest} layers must divide evenly (and non-empty) "
               f"over the other {middle} stages" if flags else
               ": it must be divisible by the pipeline size (or set "
               "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)"))
    each = rest // middle if middle else 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts
