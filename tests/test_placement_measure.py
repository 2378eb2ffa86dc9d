"""The start-up measurement and the `--pipeline-plan auto` resolver on gloo worlds of 2 and 3
ranks on localhost: every rank returns the same matrices, bandwidth from every rank to every
other, an emulated link delay shows in every latency (a lower bound: a sleep never returns early),
GEMM speeds are positive; and resolve_auto on a given measurement returns the planner's plan on
every rank, the config's pipeline size its stage count, and writes the plan file and the
measurement beside it on rank 0. No timing targets: loopback speeds are whatever they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_utils import C, DistSuite
from megadomino.cli.arguments import parse_args
from megadomino.config.pipeline_plan import read_plan
from megadomino.distributed import comm
from megadomino.pipeline.placement.chains import Rules
from megadomino.pipeline.placement.cost import Machine, Workload
from megadomino.pipeline.placement.measure import describe, measure_links, measure_speed
from megadomino.pipeline.placement.planners import op_fence
from megadomino.pipeline.placement.resolve import resolve_auto

DELAY = 0.02


def _case_links(rank: int, world: int) -> None:
    bandwidth, latency = measure_links(budget=5.0, delay=DELAY)
    assert len(bandwidth) == len(latency) == world
    for i in range(world):
        assert bandwidth[i][i] == float("inf") and latency[i][i] == 0.0
        for j in range(world):
            if i != j:
                assert 0 < bandwidth[i][j] < float("inf"), (i, j, bandwidth)
                assert latency[i][j] >= DELAY and latency[i][j] == latency[j][i], latency
    gathered = comm.all_gather_object((bandwidth, latency))
    assert all(item == gathered[0] for item in gathered)


def _case_speed(rank: int, world: int) -> None:
    speeds = measure_speed(16, 32, 24, torch.float32, seconds=0.05)
    assert len(speeds) == world and all(speed > 0 for speed in speeds)
    assert all(item == speeds for item in comm.all_gather_object(speeds))


FLAGS = ["--model-preset", "gpt-tiny", "--num-layers", "4", "--mock-data",
         "--untie-embeddings-and-output-weights", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "1", "--pipeline-plan", "auto"]


def _machine(world: int) -> Machine:
    """Rank world - 1 sits behind a slow link; the others share a fast host."""
    fast, slow = 1.25e9, 1.25e6
    bandwidth = [[fast if max(i, j) < world - 1 else slow for j in range(world)]
                 for i in range(world)]
    return Machine.uniform([1e9] * world, bandwidth, latency=1e-4)


def _case_resolve(rank: int, world: int, root: str) -> None:
    config, _ = parse_args([*FLAGS, "--pipeline-placement-dir", root], "gpt")
    lines: list[str] = []
    machine = _machine(world)
    resolved, plan = resolve_auto(config, lines.append, machine=machine)
    expected = op_fence(Workload.from_config(config), machine,
                        Rules(4, 2, tied=False)).plan
    assert plan == expected
    assert resolved.parallel.pipeline_model_parallel_size == plan.size >= 2
    assert all(item == plan for item in comm.all_gather_object(plan))
    if rank == 0:
        text = "\n".join(lines)
        assert describe(machine) in text and plan.table().rstrip() in text
        assert read_plan(str(Path(root) / "plan.json"), 4) == plan
        record = json.loads((Path(root) / "links.json").read_text())
        assert record["planner"] == "op-fence" and Machine.from_json(
            json.dumps(record["machine"])) == machine
    else:
        assert lines == []


SUITE = DistSuite(worlds=(2, 3), timeout=120)


@pytest.fixture(scope="module")
def placement_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("placement")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"root": f"{root}/w{world}"}


SUITE.case("links", _case_links, C.rank, C.world)
SUITE.case("speed", _case_speed, C.rank, C.world)
SUITE.case("resolve", _case_resolve, C.rank, C.world, C.root)

test_placement_measure = SUITE.test(args_fixture="placement_root")
