"""Megatron's split of the layers over pipeline stages, as arithmetic (the validator checks it;
config/pipeline_plan.py builds the plan from it).

    virtual pipeline (V chunks a stage): L / (P V) layers a chunk; chunk v of stage s holds
        virtual stage v P + s, layers [(v P + s) n, (v P + s + 1) n)
    --decoder-first/last-pipeline-num-layers: the first / last stage hold that many layers, the
        stages between share the rest evenly (one chunk a stage)
"""

from __future__ import annotations

from megadomino.config.check import ConfigError


def layer_split(num_layers: int, pp: int, chunks: int = 1, first: int | None = None,
                last: int | None = None) -> list[list[tuple[int, int]]]:
    """Megatron's split: for each stage, the (start, end) of each of its chunks."""
    if chunks > 1:
        if first is not None or last is not None:
            raise ConfigError("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-"
                              "num-layers cannot be combined with a virtual pipeline: the "
                              "interleaved schedule needs a uniform plan")
        if num_layers % (pp * chunks):
            raise ConfigError(f"--num-layers={num_layers} is invalid with a virtual pipeline: it "
                              f"must be divisible by pipeline size {pp} x virtual stages {chunks}")
        per = num_layers // (pp * chunks)
        return [[((v * pp + s) * per, (v * pp + s + 1) * per) for v in range(chunks)]
                for s in range(pp)]
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
