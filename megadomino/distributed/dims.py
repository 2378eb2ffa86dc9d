"""ParallelDims: the degrees of parallelism, the rank grid and every process group, in one object.

The grid is Megatron's order, tensor-parallel fastest and pipeline slowest, so that a TP group is
made of neighbouring ranks and stays inside a node:

    grid = arange(world).view(pp, dp, tp)
    tp_group  of rank r: grid[p, d, :]     dp_group: grid[p, :, t]     pp_group: grid[:, d, t]

Built from the run's pipeline plan (config/pipeline_plan.py; the launcher resolves it once), the
grid's grid[p] is stage p's DP x TP block: Megatron's uniform plan gives the grid above, a
heterogeneous one (--pipeline-plan) gives each stage its own TP degree and DP size, the groups
cut from each block the same way; ranks of different stages then have different `tp` and `dp`.

For ZeRO++ the DP group is further cut by node: `intra_node_group` holds the DP peers on the same
node, `inter_node_group` the DP peers with the same position on other nodes. `gpus_per_node`
defaults to LOCAL_WORLD_SIZE and may be set smaller so that one host stands in for several nodes.

For DiLoCo (zero/diloco.py) the DP ranks of each column are cut into `sites` runs of
site_dp = dp / sites consecutive ranks: DP rank d is in site d // site_dp at position
d % site_dp. `site_view()` is the grid as the data-parallel engine inside a site sees it (its
DP group, node groups and replica group the site's); `cross_site_group` holds the ranks at the
same position of every site of the column, which hold the same parameters of the same shape.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import torch
import torch.distributed as dist

from megadomino.config.parallel import check_degrees, check_gpus_per_node
from megadomino.config.pipeline_plan import PipelinePlan
from megadomino.config.pipeline_split import holder
from megadomino.distributed import comm


class ParallelDims:
    """Create after `torch.distributed.init_process_group`; every rank must construct it alike.
    timeout: how long the groups' collectives wait for a silent rank (None: torch's default for
    new groups, not the world group's; the launcher passes --distributed-timeout-minutes).
    gpus_per_node: ranks per node (consecutive ranks share a node); None: the whole world is one
    node. The launcher passes torchrun's LOCAL_WORLD_SIZE (or --gpus-per-node).
    plan: the run's pipeline plan, whose stages' ranks are their DP x TP blocks in Megatron's
    order; then tp, pp and dp are this rank's stage's (each stage has its own TP and DP groups)
    and the arguments tp / pp / dp are not used. Without it the grid is the degrees' (as tests
    build it), and `plan` is None.
    sites: DiLoCo's sites (the module docstring); 1: none, and `site_view()` is the grid."""

    def __init__(self, tp: int = 1, pp: int = 1, dp: int | None = None,
                 gpus_per_node: int | None = None, timeout: datetime.timedelta | None = None,
                 plan: PipelinePlan | None = None, sites: int = 1,
                 nccl: Mapping[str, dict] | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims needs torch.distributed.init_process_group() first")
        world = dist.get_world_size()
        rank = dist.get_rank()
        if plan is None:
            if dp is None:
                dp = world // (tp * pp) if tp >= 1 and pp >= 1 and world % (tp * pp) == 0 else -1
            check_degrees(world, tp, pp, dp)
            grid = torch.arange(world).view(pp, dp, tp)
            blocks = [grid[p] for p in range(pp)]
        else:
            blocks = [torch.tensor(stage.ranks).view(-1, stage.tp) for stage in plan.stages]
        if gpus_per_node is None:  # one node (the launcher passes the node's process count)
            gpus_per_node = world
        for block in blocks:
            check_gpus_per_node(world, block.shape[1], gpus_per_node)

        self.world_size, self.rank = world, rank
        self.plan = plan
        """The pipeline plan the grid was built from (every later step takes it), or None."""
        self.pp_rank = next(p for p, block in enumerate(blocks) if rank in block)
        (self.dp_rank, self.tp_rank), = (blocks[self.pp_rank] == rank).nonzero().tolist()
        self.dp, self.tp = blocks[self.pp_rank].shape
        self.pp = len(blocks)
        self.gpus_per_node = gpus_per_node
        self.rng = None
        """The TP RNG tracker (`distributed.random.RNGStatesTracker`) that
        `distributed.random.model_parallel_seed` makes: dropout on TP-sharded activations draws
        from it. None until seeded."""
        self.timeout = timeout
        self.uniform = len({block.shape for block in blocks}) == 1
        """Every stage has the same (dp, tp) shape (Megatron's grid)."""
        self.stages = tuple((tuple(block.flatten().tolist()), block.shape[1]) for block in blocks)
        """Each stage's (ranks, TP degree): what a checkpoint records of the plan."""
        self._writers_group, self._writers_made = None, False
        self._channels: dict[tuple[int, str], dict] = {}
        self.nccl = dict(nccl or {})
        """NCCL settings per group name (--nccl-communicator-config-path, config/nccl.py):
        the tp, dp, pp (the pipeline group and its channels) and embd groups are made with
        them (`options`)."""
        self.replica_group = dist.group.WORLD
        """The ranks that hold one replica of the model between them (ZeRO's global reductions
        run over it): the world, or in a site view the site's ranks."""
        self.sites, self.site, self.cross_site_group = sites, 0, None
        self._site_view: ParallelDims | _SiteView = self

        # new_group is collective over the whole world: every rank creates every group, in order.
        self.tp_group = _groups_containing(rank, [row for block in blocks for row in block],
                                           self.options("tp"), timeout=timeout)
        self.dp_group = _groups_containing(rank, [block[:, t] for block in blocks
                                                  for t in range(block.shape[1])],
                                           self.options("dp"), timeout=timeout)
        self._pipeline_groups(rank, blocks, timeout)
        self._node_groups(rank, blocks, gpus_per_node, timeout)
        if sites != 1:
            self._site_groups(rank, blocks, sites, timeout)

    def _pipeline_groups(self, rank: int, blocks: list[torch.Tensor], timeout) -> None:
        """Megatron's grid: one rank per stage, grid[:, d, t]. Stages of different shapes
        have no such columns: the pipeline group is then the world, holding every rank of each
        stage; `pp_replicas` says how many, so that a sum over stages of a value every rank of a
        stage holds is all_reduce(value / pp_replicas, pp_group)."""
        if self.uniform:
            grid = torch.stack(blocks)
            self.pp_group = _groups_containing(rank, [grid[:, d, t]
                                                      for d in range(grid.shape[1])
                                                      for t in range(grid.shape[2])],
                                               self.options("pp"), timeout=timeout)
            self.pp_replicas = 1
        else:
            self.pp_group = dist.group.WORLD
            self.pp_replicas = blocks[self.pp_rank].numel()

    def _node_groups(self, rank: int, blocks: list[torch.Tensor], gpus_per_node: int,
                     timeout) -> None:
        """A node holds gpus_per_node consecutive ranks; the DP ranks of one (stage, t) column
        that share a node form the intra-node group, those at the same offset on each node the
        inter-node group."""
        intra, inter = [], []
        for block in blocks:
            dp, tp = block.shape
            dp_per_node = max(1, min(dp, gpus_per_node // tp))
            for t in range(tp):
                column = block[:, t]
                for n in range(0, dp, dp_per_node):
                    intra.append(column[n:n + dp_per_node])
                for j in range(dp_per_node):
                    inter.append(column[j::dp_per_node])
        dp_per_node = max(1, min(self.dp, gpus_per_node // self.tp))
        self.dp_per_node = dp_per_node
        self.num_nodes_dp = (self.dp + dp_per_node - 1) // dp_per_node
        self.intra_node_group = _groups_containing(rank, intra, timeout=timeout)
        self.inter_node_group = _groups_containing(rank, inter, timeout=timeout)
        self.intra_node_rank = self.dp_rank % dp_per_node
        self.inter_node_rank = self.dp_rank // dp_per_node

    def _site_groups(self, rank: int, blocks: list[torch.Tensor], sites: int, timeout) -> None:
        """DiLoCo's groups (module docstring): per site its DP groups, node groups and the
        group of all its ranks, for the site view; the cross-site groups, for the grid."""
        if not self.uniform or self.dp % sites:
            raise ValueError(f"{sites} DiLoCo sites need stages of one shape whose data-parallel "
                             f"size ({self.dp}) they divide")
        site_dp = self.dp // sites
        runs = [block[s * site_dp:(s + 1) * site_dp] for block in blocks for s in range(sites)]
        view = _SiteView(self, dp=site_dp, dp_rank=self.dp_rank % site_dp, sites=1, site=0,
                         cross_site_group=None)
        view.dp_group = _groups_containing(rank, [run[:, t] for run in runs
                                                  for t in range(self.tp)], timeout=timeout)
        view.replica_group = _groups_containing(
            rank, [torch.cat([block[s * site_dp:(s + 1) * site_dp].flatten() for block in blocks])
                   for s in range(sites)], timeout=timeout)
        ParallelDims._node_groups(view, rank, runs, self.gpus_per_node, timeout)
        self.site = self.dp_rank // site_dp
        self.cross_site_group = _groups_containing(
            rank, [block[j::site_dp, t] for block in blocks for t in range(self.tp)
                   for j in range(site_dp)], timeout=timeout)
        self._site_view = view

    def site_view(self) -> ParallelDims | _SiteView:
        """The grid as the data-parallel engine inside this rank's DiLoCo site sees it: `dp`,
        `dp_rank`, `dp_group`, the node groups and `replica_group` are the site's, everything
        else the grid's; the grid itself without sites."""
        return self._site_view

    def stage_writers_group(self):
        """The group of every stage's first rank (TP and DP rank 0 of each stage, the writers
        of a torch_dist checkpoint), on those ranks; None on the others. Made on first use,
        collectively over the world like every group here (every rank calls this, in the same
        order), on the world's backend, and kept. Not a gloo group of the members alone: on
        NCCL a world-wide new_group of another backend leaves the non-members in an
        ncclCommSplit the members never join, and torch 2.11 hangs the members of a
        members-only gloo group (both seen at PP 2 x TP 2 on 4 GPUs)."""
        if not self._writers_made:
            writers = torch.tensor([ranks[0] for ranks, _ in self.stages])
            self._writers_group = _groups_containing(self.rank, [writers], timeout=self.timeout)
            self._writers_made = True
        return self._writers_group

    def pipeline_channels(self, chunks: int, placement: str = "loop"
                          ) -> dict[tuple[str, int], object]:
        """This rank's point-to-point channels of a same-layout pipeline: a group of two ranks
        for each (pass, boundary) it sends or receives on, keyed ("F" activations or "B"
        gradients, b) as transport_p2p.channel names them: under the loop placement b is the
        boundary between stages b and b + 1 (mod P; the wrap-around boundary P - 1 only with
        virtual stages, `chunks` > 1), under ZBV's V placement each virtual boundary between
        stages (not the V's turn, which stays on the last stage). Each channel carries one
        direction's messages of one pass, in one order on both ends.

        Why not the pipeline group: NCCL runs a communicator's operations one after the other
        on one stream, so a receive posted early (prefetched) holds up every later send on that
        communicator until its message arrives, and the peer's message may need one of those
        sends first (1F1B, interleaved and ZB-H1 hung on 2 and 4 GPUs that way). On its own
        channel a prefetched receive waits only behind receives of its own pass from the same
        stage. Made once (every rank calls this alike, the groups collectively over the world
        on the world's backend, as stage_writers_group's reason says), each channel's connection
        opened at once in one order on every rank (comm.open_links says why), and kept."""
        if not self.uniform:
            raise ValueError("pipeline channels join same-layout stages (Megatron's grid)")
        if (chunks, placement) not in self._channels:
            stages = [ranks for ranks, _ in self.stages]
            count = len(stages)
            ends = {}  # boundary -> (the stages of the virtual stages it joins), in order
            for virtual in range(count * chunks - 1):
                low, high = (holder(v, count, placement)[0] for v in (virtual, virtual + 1))
                if low != high:
                    ends.setdefault(virtual % count if placement == "loop" else virtual,
                                    (low, high))
            mine, links = {}, []
            for b, (low, high) in ends.items():
                for pass_ in ("F", "B"):
                    pairs = list(zip(stages[low], stages[high]))
                    group = _groups_containing(self.rank, [torch.tensor(pair) for pair in pairs],
                                               self.options("pp"), timeout=self.timeout)
                    if group is not None:
                        mine[(pass_, b)] = group
                    links += [("p2p", group if self.rank in pair else None,
                               *(pair if pass_ == "F" else pair[::-1])) for pair in pairs]
            comm.open_links(links)
            self._channels[chunks, placement] = mine
        return self._channels[chunks, placement]

    def options(self, name: str):
        """`ProcessGroupNCCL.Options` for new groups of Megatron-LM's name `name` from the
        run's NCCL settings (`nccl`), or None: no settings for it, or not NCCL."""
        entry = self.nccl.get(name)
        if not entry or dist.get_backend() != "nccl":
            return None
        options = dist.ProcessGroupNCCL.Options(
            is_high_priority_stream=bool(entry.get("is_high_priority_stream", False)))
        for key, value in entry.items():
            if key != "is_high_priority_stream":
                setattr(options.config, key, value)
        return options

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def __repr__(self) -> str:
        return (f"ParallelDims(world={self.world_size}, tp={self.tp}, pp={self.pp}, dp={self.dp}, "
                f"gpus_per_node={self.gpus_per_node}, rank={self.rank}: tp_rank={self.tp_rank}, "
                f"dp_rank={self.dp_rank}, pp_rank={self.pp_rank})")


class _SiteView:
    """A DiLoCo site's view of a ParallelDims: the attributes given here, every other one (and
    every method: pipeline channels, writer groups) the grid's."""

    def __init__(self, grid: ParallelDims, **overrides):
        self._grid = grid
        self.__dict__.update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


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
