"""ParallelDims: the degrees of parallelism, the rank grid and every process group, in one object.

The grid is Megatron's order, tensor-parallel fastest and pipeline slowest, so that a TP group is
made of neighbouring ranks and stays inside a node:

    grid = arange(world).view(pp, dp, tp)
    tp_group  of rank r: grid[p, d, :]     dp_group: grid[p, :, t]     pp_group: grid[:, d, t]

For ZeRO++ the DP group is further cut by node: `intra_node_group` holds the DP peers on the same
node, `inter_node_group` the DP peers with the same position on other nodes. `gpus_per_node`
defaults to LOCAL_WORLD_SIZE and may be set smaller so that one host stands in for several nodes.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megadomino.config.parallel import check_degrees, check_gpus_per_node


class ParallelDims:
    """Create after `torch.distributed.init_process_group`; every rank must construct it alike.
    timeout: how long the groups' collectives wait for a silent rank (None: torch's default for
    new groups, not the world group's; the launcher passes --distributed-timeout-minutes).
    gpus_per_node: ranks per node (consecutive ranks share a node); None: the whole world is one
    node. The launcher passes torchrun's LOCAL_WORLD_SIZE (or --gpus-per-node)."""

    def __init__(self, tp: int = 1, pp: int = 1, dp: int | None = None,
                 gpus_per_node: int | None = None, timeout: datetime.timedelta | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims needs torch.distributed.init_process_group() first")
        world = dist.get_world_size()
        rank = dist.get_rank()
        if dp is None:
            dp = world // (tp * pp) if tp >= 1 and pp >= 1 and world % (tp * pp) == 0 else -1
        check_degrees(world, tp, pp, dp)
        if gpus_per_node is None:  # one node (the launcher passes the node's process count)
            gpus_per_node = world
        check_gpus_per_node(world, tp, gpus_per_node)

        self.world_size, self.rank = world, rank
        self.tp, self.pp, self.dp = tp, pp, dp
        self.gpus_per_node = gpus_per_node
        self.rng = None
        """The TP RNG tracker (`distributed.random.RNGStatesTracker`) that
        `distributed.random.model_parallel_seed` makes: dropout on TP-sharded activations draws
        from it. None until seeded."""
        self.timeout = timeout
        grid = torch.arange(world).view(pp, dp, tp)
        (self.pp_rank, self.dp_rank, self.tp_rank), = (grid == rank).nonzero().tolist()

        # new_group is collective over the whole world: every rank creates every group, in order.
        self.tp_group = _groups_containing(rank, [grid[p, d, :] for p in range(pp)
                                                  for d in range(dp)], timeout=timeout)
        self.dp_group = _groups_containing(rank, [grid[p, :, t] for p in range(pp)
                                                  for t in range(tp)], timeout=timeout)
        self.pp_group = _groups_containing(rank, [grid[:, d, t] for d in range(dp)
                                                  for t in range(tp)], timeout=timeout)
        # A node holds gpus_per_node consecutive ranks; the DP ranks of one (p, t) column that
        # share a node form the intra-node group, those at the same offset on each node the
        # inter-node group.
        dp_per_node = max(1, min(dp, gpus_per_node // tp))
        self.dp_per_node = dp_per_node
        self.num_nodes_dp = (dp + dp_per_node - 1) // dp_per_node
        intra, inter = [], []
        for p in range(pp):
            for t in range(tp):
                column = grid[p, :, t]
                for n in range(0, dp, dp_per_node):
                    intra.append(column[n:n + dp_per_node])
                for j in range(dp_per_node):
                    inter.append(column[j::dp_per_node])
        self.intra_node_group = _groups_containing(rank, intra, timeout=timeout)
        self.inter_node_group = _groups_containing(rank, inter, timeout=timeout)
        self.intra_node_rank = self.dp_rank % dp_per_node
        self.inter_node_rank = self.dp_rank // dp_per_node

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return (f"ParallelDims(world={self.world_size}, tp={self.tp}, pp={self.pp}, dp={self.dp}, "
                f"gpus_per_node={self.gpus_per_node}, rank={self.rank}: tp_rank={self.tp_rank}, "
                f"dp_rank={self.dp_rank}, pp_rank={self.pp_rank})")


def _groups_containing(rank: int, rank_lists: list[torch.Tensor], pg_options=None,
                       timeout: datetime.timedelta | None = None):
    """Create a group for every rank list (collectively) and return the one holding `rank`."""
    mine = None
    for ranks in rank_lists:
        ranks = ranks.tolist()
        group = dist.new_group(ranks, pg_options=pg_options, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine
