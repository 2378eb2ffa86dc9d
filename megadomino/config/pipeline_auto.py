"""The validator's rules for `--pipeline-plan auto` and its flags, checked before any process
group: what the planners (pipeline/placement/) cannot plan is refused here, one line naming the
flag, so that planning after the group never fails on the configuration.

A planned plan has TP 1 stages whose ranks split the batch (config/pipeline_plan.py's file
plans), so it needs what a plan file needs (`check_flags_beside_plan`, `check_features`), and:
- at least 2 ranks;
- a stage count S: --pipeline-model-parallel-size when given (> 1), else any 2 <= S <= layers;
- each stage at most --micro-batch-size ranks (each computes at least one sequence), and with a
  tied embedding a first and last stage of one size (`_can_split`: some S admits such sizes);
- dt-fm: S equal groups (S divides the world, world / S <= --micro-batch-size).
--pipeline-planner and --pipeline-placement-dir are refused without auto, --pipeline-link-delay
without a pipeline. The emulations for experiments on slow and uneven machines are checked here
too: --pipeline-link-delay (seconds >= 0, its flag's range) and --emulate-slow-rank RANK:FACTOR
(a rank of the world, FACTOR >= 1).
"""

from __future__ import annotations

from megadomino.config.check import ConfigError, check, check_writable
from megadomino.config.parallel import PIPELINE_PLANNERS
from megadomino.config.pipeline_plan import AUTO, check_features, check_flags_beside_plan


def check_auto(config, world_size: int | None) -> None:
    """The rules of the module docstring on a `Config` (the world's with `world_size`)."""
    parallel = config.parallel
    check(parallel.pipeline_planner in PIPELINE_PLANNERS, "--pipeline-planner",
          parallel.pipeline_planner, "one of " + ", ".join(PIPELINE_PLANNERS))
    _check_slow_rank(parallel.emulate_slow_rank, world_size)
    if parallel.pipeline_plan != AUTO:
        for flag, given in (("--pipeline-planner", parallel.pipeline_planner != "op-fence"),
                            ("--pipeline-placement-dir",
                             parallel.pipeline_placement_dir is not None)):
            if given:
                raise ConfigError(f"{flag} needs --pipeline-plan auto: it chooses how the plan "
                                  "is made at start-up")
        if (parallel.pipeline_link_delay and parallel.pipeline_plan is None
                and parallel.pipeline_model_parallel_size == 1):
            raise ConfigError("--pipeline-link-delay delays pipeline messages: it needs "
                              "pipeline parallelism (--pipeline-model-parallel-size > 1 or "
                              "--pipeline-plan)")
        return
    if parallel.pipeline_placement_dir is not None:
        check_writable("--pipeline-placement-dir", parallel.pipeline_placement_dir)
    name = "--pipeline-plan auto"
    check_flags_beside_plan(name, parallel, config.model)
    check_features(AUTO, config)
    if world_size is not None:
        _check_world(config, world_size)


def _check_world(config, world_size: int) -> None:
    parallel, layers = config.parallel, config.model.num_layers
    micro = config.train.schedule.micro_batch_size
    tied = not config.model.untie_embeddings_and_output_weights
    pp = parallel.pipeline_model_parallel_size
    if world_size < 2:
        raise ConfigError("--pipeline-plan auto places pipeline stages on at least 2 ranks: "
                          f"launch 2 or more (the world has {world_size})")
    counts = [pp] if pp > 1 else list(range(2, layers + 1))
    check(pp == 1 or 2 <= pp <= min(layers, world_size), "--pipeline-model-parallel-size", pp,
          f"at most --num-layers ({layers}) and the world size ({world_size}) with "
          "--pipeline-plan auto (or leave it out: the planner picks the stage count)")
    if parallel.pipeline_planner == "dt-fm":
        if not any(world_size % s == 0 and world_size // s <= micro for s in counts):
            raise ConfigError(f"--pipeline-planner dt-fm needs stages of equal size: no stage "
                              f"count in {_span(counts)} divides the world of {world_size} ranks "
                              f"into groups of at most --micro-batch-size={micro} ranks; raise "
                              "--micro-batch-size or use --pipeline-planner op-fence")
        return
    if not any(_can_split(world_size, s, micro, tied) for s in counts):
        rule = " with a first and last stage of one size (tied embeddings)" if tied else ""
        raise ConfigError(f"--pipeline-plan auto cannot place {world_size} ranks in "
                          f"{_span(counts)} stages of at most --micro-batch-size={micro} ranks "
                          f"each{rule}: raise --micro-batch-size"
                          + (" or add --untie-embeddings-and-output-weights" if tied else ""))


def _check_slow_rank(value: str | None, world_size: int | None) -> None:
    if value is None:
        return
    slow, _, factor = value.partition(":")
    try:
        rank, times = int(slow), float(factor)
    except ValueError:
        rank, times = -1, 0.0
    world = f" of the world (0..{world_size - 1})" if world_size is not None else ""
    check(rank >= 0 and times >= 1 and (world_size is None or rank < world_size),
          "--emulate-slow-rank", value, f"RANK:FACTOR, a rank{world} and a factor >= 1 "
          "(e.g. 3:2 for rank 3 at half speed)")


def _can_split(world: int, stages: int, most: int, tied: bool) -> bool:
    """Whether `world` ranks split into `stages` stages of 1..`most` ranks (first and last of one
    size when `tied`)."""
    if not stages <= world <= stages * most:
        return False
    if not tied:
        return True
    for edge in range(1, most + 1):
        rest, middle = world - 2 * edge, stages - 2
        if middle <= rest <= middle * most:
            return True
    return False


def _span(counts: list[int]) -> str:
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}..{counts[-1]}"
