"""ParallelDims: Megatron's rank grid (TP fastest, PP slowest), the groups, ZeRO++'s node groups,
and refusals that happen before any collective."""

from __future__ import annotations

import torch.distributed as dist

from dist_utils import C, DistSuite
from megadomino.config import ConfigError
from megadomino.distributed import ParallelDims


def members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


# A world of 4 as two pairs: the expected members of a group, as a function of the rank.
def pair(rank: int) -> list[int]:  # {0,1},{2,3}
    return [0, 1] if rank < 2 else [2, 3]


def column(rank: int) -> list[int]:  # {0,2},{1,3}
    return [0, 2] if rank % 2 == 0 else [1, 3]


def alone(rank: int) -> list[int]:
    return [rank]


def everyone(rank: int) -> list[int]:
    return [0, 1, 2, 3]


def check_grid(tp: int, pp: int, rank: int, expected: dict[str, object]):
    dims = ParallelDims(tp=tp, pp=pp)
    for name, members_of in expected.items():
        ranks = members_of(rank)
        assert members(getattr(dims, name)) == ranks, (name, members(getattr(dims, name)), ranks)
    assert dims.tp * dims.pp * dims.dp == dims.world_size


def check_nodes(tp: int, gpus_per_node: int, rank: int, intra, inter):
    dims = ParallelDims(tp=tp, gpus_per_node=gpus_per_node)
    assert members(dims.intra_node_group) == intra(rank), members(dims.intra_node_group)
    assert members(dims.inter_node_group) == inter(rank), members(dims.inter_node_group)


def check_refused(kwargs: dict, words: str):
    try:
        ParallelDims(**kwargs)
    except ConfigError as error:
        assert words in str(error), str(error)
    else:
        raise AssertionError(f"ParallelDims({kwargs}) was accepted")


SUITE = DistSuite(worlds=(4,))
# tp=2 -> tp groups {0,1},{2,3}; dp groups {0,2},{1,3}
SUITE.case("tp2", check_grid, 2, 1, C.rank,
           {"tp_group": pair, "dp_group": column, "pp_group": alone})
SUITE.case("tp1", check_grid, 1, 1, C.rank, {"tp_group": alone, "dp_group": everyone})
# pp=2, tp=2: grid (pp, dp, tp) = (2, 1, 2): pp groups {0,2},{1,3}
SUITE.case("pp2tp2", check_grid, 2, 2, C.rank,
           {"tp_group": pair, "pp_group": column, "dp_group": alone})
# 2 "nodes" of 2 GPUs, DP=4: intra {0,1},{2,3}; inter {0,2},{1,3}
SUITE.case("nodes-dp4", check_nodes, 1, 2, C.rank, pair, column)
# TP=2 fills a node: each node holds one DP rank of each TP column
SUITE.case("nodes-tp2", check_nodes, 2, 2, C.rank, alone, column)
SUITE.case("refuse-tp3", check_refused, {"tp": 3}, "--tensor-model-parallel-size=3")
SUITE.case("refuse-dp", check_refused, {"tp": 2, "dp": 3}, "world size 4")
SUITE.case("refuse-gpus-per-node", check_refused, {"tp": 2, "gpus_per_node": 3},
           "--gpus-per-node=3")
# after refusals no rank is stuck: one more collective must complete
SUITE.case("alive", dist.barrier)

test_parallel_dims = SUITE.test()
