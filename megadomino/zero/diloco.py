"""DiLoCo's outer optimizer: data parallelism across slow links (Douillard et al., "DiLoCo:
Distributed Low-Communication Training of Language Models", arXiv 2311.08105; OpenDiLoCo and
torchft's DiLoCo follow it).

The data-parallel ranks are cut into S sites (ParallelDims' `sites`: runs of consecutive DP
ranks, by default one a node). Inside a site the engine trains as always: ZeRO at its stage over
the site's DP group (`ParallelDims.site_view()`), with the site's own optimizer state. For H
inner steps (`--diloco-inner-steps`) nothing crosses the sites but a few scalars (the log line's
loss mean every --log-interval, evaluation's, an early stop's vote); then every rank runs the outer
step on its own chunk of the fp32 masters (its pipeline stage's parameters, its TP shard and at
ZeRO 1/3 its DP chunk), which the ranks at the same position of every site (the cross-site
group) hold alike, with the global parameters theta kept since the last outer step:

    delta_i = theta - theta_i                          site i's pseudo-gradient
    delta   = (1/S) sum_i decode(encode(delta_i))      all-gathered, summed in site order (fp32)
    m       = mu m + delta                             Nesterov momentum (torch.optim.SGD's)
    theta   = theta - lr (delta + mu m)                outer lr 0.7, mu 0.9 by default
    theta_i = theta                                    every site starts the next round alike

encode is the identity (fp32), a rounding to bfloat16, or the kernels' int8 block quantization
(`collectives.all_gather_mean`). Every rank of the cross-site group sums the same decoded rows in
the same order, so the sites compute the same bits; the parameters' checksums (the int64 sum of
the fp32 masters' bit patterns, per unit) are then compared across the sites after each outer
step, and a difference stops the run on every rank with one line (`ReplicaMismatchError`).
Each pipeline stage syncs only its own parameters; a tied embedding's two copies (first and
last stage) get the same update from the same values.

Memory: the snapshot theta and the momentum m, two fp32 copies of this rank's masters. Traffic
per outer step: this rank's chunk once to each other site (4, 2 or about 1 bytes an element),
counted by the engine's CommCounter under 'pseudo-gradients'. The state (theta, m, the inner
steps since the last outer step) is `state_dict()`; train/checkpoint/diloco.py saves it, and
each site's own inner state where the model shards hold only site 0's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadomino.config import DilocoConfig
from megadomino.distributed import comm as dist_comm
from megadomino.zero.collectives import all_gather_mean


class ReplicaMismatchError(RuntimeError):
    """The sites' replicas differ after an outer step: raised on every rank, with one line."""


class DiLoCo:
    """The outer optimizer of one rank, over the fp32 masters of its site's engine (a
    ZeroPlusPlus built on `dims.site_view()`, whose `step` calls `after_inner_step`).
    `outer_step` and `check_replicas` are collective over the world (every rank runs them after
    the same inner step)."""

    def __init__(self, engine, dims, config: DilocoConfig):
        if dims.sites < 2 or dims.cross_site_group is None:
            raise ValueError("DiLoCo needs a grid cut into 2 sites or more "
                             "(ParallelDims(sites=...))")
        self.engine, self.dims, self.config = engine, dims, config
        self.masters: list[torch.Tensor] = engine.optimizer.masters
        """This rank's fp32 masters, flat per unit: what the outer step reads and writes."""
        self.snapshot = [master.detach().clone() for master in self.masters]
        """theta, the global parameters of the last outer step (this rank's chunk)."""
        self.momentum = [torch.zeros_like(master) for master in self.masters]
        self.inner_steps = 0
        """Inner steps since the last outer step."""
        self.outer_steps = 0

    @torch.no_grad()
    def reset(self) -> None:
        """Start from the current weights: theta the masters, no momentum, no inner step
        counted (a run whose weights did not come with a DiLoCo state)."""
        for snapshot, momentum, master in zip(self.snapshot, self.momentum, self.masters):
            snapshot.copy_(master)
            momentum.zero_()
        self.inner_steps = self.outer_steps = 0

    def after_inner_step(self) -> bool:
        """Count an inner step (the engine's step just ran); at the H-th, run the outer step.
        Whether it ran: the masters and the parameter shards changed, the caller refreshes the
        parameters."""
        self.inner_steps += 1
        if self.inner_steps < self.config.inner_steps:
            return False
        self.outer_step()
        return True

    @torch.no_grad()
    def outer_step(self) -> None:
        """The module docstring's update, unit by unit (the next unit's exchange in flight
        while this one is applied), then the masters into the parameter shards and the
        replicas' checksums compared."""
        config, counter = self.config, self.engine.comm
        lr, mu = config.outer_lr, config.outer_momentum

        def launch(index: int):
            delta = self.snapshot[index] - self.masters[index]
            return all_gather_mean(counter, delta, self.dims.cross_site_group,
                                   config.pseudo_grad_dtype, config.int8_block_size,
                                   "pseudo-gradients")

        pending = launch(0) if self.masters else None
        for index, (master, snapshot, momentum) in enumerate(
                zip(self.masters, self.snapshot, self.momentum)):
            following = launch(index + 1) if index + 1 < len(self.masters) else None
            delta = pending.wait()
            momentum.mul_(mu).add_(delta)
            snapshot.sub_(delta.add_(momentum, alpha=mu), alpha=lr)
            master.copy_(snapshot)
            pending = following
        self.engine.optimizer.copy_masters_to_shards()
        self.inner_steps = 0
        self.outer_steps += 1
        self.check_replicas()

    def checksums(self) -> torch.Tensor:
        """[units] int64: each master's fp32 bit patterns summed as integers (exact, so equal
        masters give equal sums on any device)."""
        if not self.masters:
            return torch.zeros(0, dtype=torch.int64)
        return torch.stack([master.view(torch.int32).sum(dtype=torch.int64)
                            for master in self.masters])

    def check_replicas(self) -> None:
        """Compare the checksums across the sites; ReplicaMismatchError on every rank, with the
        same line, if any site's differ from site 0's. Collective over the world."""
        dims, counter = self.dims, self.engine.comm
        mine = self.checksums()
        gathered = mine.new_empty(dims.sites * mine.numel())
        counter.all_gather(gathered, mine, dims.cross_site_group, "scalars")
        rows = gathered.view(dims.sites, -1)
        differ = (rows != rows[0]).any(dim=1)
        flag = differ.any().to(torch.int32).reshape(1)
        counter.all_reduce(flag, dist.group.WORLD, "scalars", op=dist_comm.ReduceOp.MAX)
        if not flag.item():
            return
        mine = None
        if differ.any():
            site = int(differ.nonzero()[0])
            unit = int((rows[site] != rows[0]).nonzero()[0])
            mine = (f"DiLoCo's replicas differ after outer step {self.outer_steps}: site "
                    f"{site}'s parameters are not site 0's (pipeline stage {dims.pp_rank}, "
                    f"tensor-parallel rank {dims.tp_rank}, unit "
                    f"{self.engine.units[unit].name}); stopping the run, since every site must "
                    "compute the same outer step (a nondeterministic kernel, a corrupted "
                    "transfer or a faulty device)")
        first = next(line for line in dist_comm.all_gather_object(mine) if line is not None)
        raise ReplicaMismatchError(first)

    def state_dict(self) -> dict:
        """The outer state of this rank's chunk (references: serialize before the next outer
        step)."""
        return {"snapshot": self.snapshot, "momentum": self.momentum,
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
                "sites": self.dims.sites}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """The inverse of state_dict() at the same sites and layout (ValueError otherwise)."""
        if state["sites"] != self.dims.sites:
            raise ValueError(f"saved with {state['sites']} DiLoCo sites, this run has "
                             f"{self.dims.sites}")
        shapes = [tuple(t.shape) for t in state["snapshot"]]
        if shapes != [tuple(m.shape) for m in self.masters]:
            raise ValueError(f"the saved outer state's chunks {shapes} are not this engine's "
                             f"{[tuple(m.shape) for m in self.masters]}")
        for mine, saved in zip(self.snapshot + self.momentum,
                               list(state["snapshot"]) + list(state["momentum"])):
            mine.copy_(saved)
        self.inner_steps, self.outer_steps = state["inner_steps"], state["outer_steps"]
