"""ParallelDims: Megatron's rank grid (TP fastest, PP slowest), the groups, ZeRO++'s node groups,
and refusals that happen before any collective."""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

from dist_utils import CaseRunner, check_result, run_cases
from megadomino.config import ConfigError
from megadomino.parallel import ParallelDims


def members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def check_grid(tp: int, pp: int, expected: dict[str, list[int]]):
    dims = ParallelDims(tp=tp, pp=pp)
    for name, ranks in expected.items():
        assert members(getattr(dims, name)) == ranks, (name, members(getattr(dims, name)), ranks)
    assert dims.tp * dims.pp * dims.dp == dims.world_size


def check_nodes(tp: int, gpus_per_node: int, intra: list[int], inter: list[int]):
    dims = ParallelDims(tp=tp, gpus_per_node=gpus_per_node)
    assert members(dims.intra_node_group) == intra, members(dims.intra_node_group)
    assert members(dims.inter_node_group) == inter, members(dims.inter_node_group)


def check_refused(kwargs: dict, words: str):
    try:
        ParallelDims(**kwargs)
    except ConfigError as error:
        assert words in str(error), str(error)
    else:
        raise AssertionError(f"ParallelDims({kwargs}) was accepted")


def all_cases() -> dict[str, str | None]:
    rank = dist.get_rank()
    runner = CaseRunner()
    # world 4: tp=2 -> tp groups {0,1},{2,3}; dp groups {0,2},{1,3}
    runner.run("tp2", check_grid, 2, 1, {
        "tp_group": [0, 1] if rank < 2 else [2, 3],
        "dp_group": [0, 2] if rank % 2 == 0 else [1, 3],
        "pp_group": [rank]})
    runner.run("tp1", check_grid, 1, 1, {"tp_group": [rank], "dp_group": [0, 1, 2, 3]})
    # pp=2, tp=2: grid (pp, dp, tp) = (2, 1, 2): pp groups {0,2},{1,3}
    runner.run("pp2tp2", check_grid, 2, 2, {
        "tp_group": [0, 1] if rank < 2 else [2, 3],
        "pp_group": [0, 2] if rank % 2 == 0 else [1, 3],
        "dp_group": [rank]})
    # 2 "nodes" of 2 GPUs, DP=4: intra {0,1},{2,3}; inter {0,2},{1,3}
    runner.run("nodes-dp4", check_nodes, 1, 2,
               [0, 1] if rank < 2 else [2, 3], [0, 2] if rank % 2 == 0 else [1, 3])
    # TP=2 fills a node: each node holds one DP rank of each TP column
    runner.run("nodes-tp2", check_nodes, 2, 2, [rank], [0, 2] if rank % 2 == 0 else [1, 3])
    runner.run("refuse-tp3", check_refused, {"tp": 3}, "--tensor-model-parallel-size=3")
    runner.run("refuse-dp", check_refused, {"tp": 2, "dp": 3}, "world size 4")
    runner.run("refuse-gpus-per-node", check_refused, {"tp": 2, "gpus_per_node": 3},
               "--gpus-per-node=3")
    # after refusals no rank is stuck: one more collective must complete
    runner.run("alive", dist.barrier)
    return runner.results


CASES = ["tp2", "tp1", "pp2tp2", "nodes-dp4", "nodes-tp2", "refuse-tp3", "refuse-dp",
         "refuse-gpus-per-node", "alive"]


@functools.cache
def results() -> dict[str, str | None]:
    return run_cases(4, all_cases)


@pytest.mark.parametrize("case", CASES)
def test_parallel_dims(case: str):
    check_result(results(), case)
