"""`--pipeline-plan auto`: the run's plan, made once the world's process group exists and before
`ParallelDims` is built from it (cli/launch.py), every rank returning the same plan.

    measure   every rank's GEMM speed and the links between every pair (measure.py), gathered:
              the same `Machine` on every rank
    plan      --pipeline-planner's plan (planners.py), a pure function of the workload, the
              machine and the rules, so the same on every rank (checked: the ranks compare it)
    check     the plan's rules (config/pipeline_plan.py's check_plan, check_composition), which
              config/pipeline_auto.py made sure a planned plan meets
    report    rank 0 prints the measurement, the plan as a --pipeline-plan file's table and its
              predicted step time, and writes plan.json (a --pipeline-plan file) and
              links.json (the measurement and the prediction) to --pipeline-placement-dir
              (default: --save's directory; neither: printed only)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import torch.distributed as dist

from megadomino.config import Config
from megadomino.config.pipeline_plan import (
    AUTO,
    PipelinePlan,
    check_composition,
    check_plan,
    plan_file,
)
from megadomino.distributed import comm
from megadomino.models.blocks import DTYPES
from megadomino.pipeline.placement.chains import Rules
from megadomino.pipeline.placement.cost import Machine, Workload
from megadomino.pipeline.placement.measure import describe, measure_machine
from megadomino.pipeline.placement.planners import Placement, plan_placement


def rules_of(config: Config) -> Rules:
    """The rules every planned plan meets (chains.py), from the config."""
    model, pp = config.model, config.parallel.pipeline_model_parallel_size
    return Rules(model.num_layers, config.train.schedule.micro_batch_size,
                 not model.untie_embeddings_and_output_weights, pp if pp > 1 else None)


def resolve_auto(config: Config, log: Callable[[str], None] = print,
                 machine: Machine | None = None) -> tuple[Config, PipelinePlan]:
    """The config (its --pipeline-model-parallel-size the plan's stage count) and the plan of
    --pipeline-plan auto on the world (module docstring); collective over the world.
    `machine`: a measurement to plan on instead of measuring (tests, replays)."""
    parallel, model = config.parallel, config.model
    if machine is None:
        machine = measure_machine(model.seq_length, model.hidden_size, model.ffn_hidden_size,
                                  DTYPES[config.train.precision.params_dtype],
                                  delay=parallel.pipeline_link_delay,
                                  slowdown=parallel.slowdown(dist.get_rank()))
    work = Workload.from_config(config, nccl=dist.get_backend() == "nccl")
    placement = plan_placement(parallel.pipeline_planner, work, machine, rules_of(config))
    plan = placement.plan
    text = plan_file(plan)
    if len(set(comm.all_gather_object(text))) != 1:
        raise RuntimeError("--pipeline-plan auto: the ranks planned different plans from one "
                           "measurement (a planner that is not a pure function is a bug)")
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        parallel, pipeline_model_parallel_size=plan.size))
    check_plan(AUTO, plan, model.num_layers, dist.get_world_size())
    check_composition(AUTO, plan, config.parallel, model,
                      config.train.schedule.micro_batch_size)
    if dist.get_rank() == 0:
        _report(config, machine, placement, text, log)
    return config, plan


def _report(config: Config, machine: Machine, placement: Placement, text: str,
            log: Callable[[str], None]) -> None:
    """Rank 0's lines and files (module docstring)."""
    log(describe(machine))
    note = f" ({placement.note})" if placement.note else ""
    log(f"pipeline plan (--pipeline-plan auto, --pipeline-planner {placement.planner}){note}:\n"
        f"{placement.plan.table().rstrip()}\n{placement.estimate.describe()}")
    where = config.parallel.pipeline_placement_dir or config.train.checkpoint.save
    if where is None:
        return
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "plan.json"), "w", encoding="utf-8") as handle:
        handle.write(text)
    record = {"planner": placement.planner, "objective": placement.objective,
              "predicted_step": placement.estimate.step,
              "estimate": dataclasses.asdict(placement.estimate),
              "machine": json.loads(machine.to_json())}
    with open(os.path.join(where, "links.json"), "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
        handle.write("\n")
    log(f"pipeline plan written to {os.path.join(where, 'plan.json')} (measurement: links.json)")
