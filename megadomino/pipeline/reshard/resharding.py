"""The plan of one resharding: what every rank sends, receives and forwards, in which order.

`make_plan` is a pure function of its arguments (a solver is one too), so every rank that
calls it with the same arguments holds the same plan without any communication; the executor of
a pipeline builds the plans of every stage boundary on every rank. `plan.backward()` is the plan
of the gradient going back (destination layout -> source layout, same strategy and solver): the
gradient of a replicated activation is the same on every replica, so any replica may send it.

The `network` (network.py) says which links each edge loads (senders balanced per host or per
device) and what the backend's broadcast and all-gather are; cost.py prices a plan in seconds
(`predicted_time`), and strategy "auto" takes the candidate with the lowest prediction.
`describe()` is the line a transport prints at start-up for each boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import cost
from .layout import Layout
from .network import DEFAULT_NETWORK, Network
from .plan import (
    STRATEGIES,
    Edge,
    Link,
    Work,
    add_edge_bytes,
    edge_loads,
    exchange_edges,
    make_works,
    plan_transfers,
    work_edges,
)
from .solvers import Solution, Solver, makespan, solve


@dataclass(frozen=True)
class Step:
    """One work with its chosen sender and the edges that carry it (each edge: the whole
    work's bytes)."""

    work: Work
    sender: int
    edges: tuple[Edge, ...]


@dataclass(frozen=True)
class ReshardPlan:
    """A `shape` tensor of `dtype` moved from layout `src` to layout `dst` (disjoint meshes).

    steps: the works in the order they run, with their senders; exchanges: the all-gather phase
    of `send_recv_allgather` (empty otherwise); rates: bytes/s of each host's uplink and downlink
    (of each of its NICs; 1.0 each when not given: times are then in bytes); chunks: how many
    pieces a chained broadcast streams per work; exact: whether the solver proved its choice
    optimal; network: the links and backend planned for; considered: (strategy,
    predicted seconds) of each candidate when `auto` chose this plan, else empty."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    src: Layout
    dst: Layout
    strategy: str
    solver: str | Solver
    chunks: int
    rates: tuple[tuple[str, float], ...]
    steps: tuple[Step, ...]
    exchanges: tuple[Step, ...]
    exact: bool
    network: Network = DEFAULT_NETWORK
    considered: tuple[tuple[str, float], ...] = ()

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def host_of(self) -> dict[int, str]:
        return {**dict(zip(self.src.mesh.ranks, self.src.mesh.hosts)),
                **dict(zip(self.dst.mesh.ranks, self.dst.mesh.hosts))}

    def link_rates(self) -> dict[Link, float]:
        return self.network.link_rates(dict(self.rates), self.host_of())

    def edge_bytes(self) -> dict[Edge, int]:
        """Bytes over each (source rank, destination rank) pair, all steps and exchanges."""
        sent: dict[Edge, int] = {}
        for step in (*self.steps, *self.exchanges):
            for edge in step.edges:
                sent[edge] = sent.get(edge, 0) + step.work.numel * self.itemsize
        return sent

    def link_bytes(self) -> dict[Link, int]:
        """Bytes on every link (see plan.py's module docstring)."""
        host_of, loads = self.host_of(), {}
        for edge, nbytes in self.edge_bytes().items():
            add_edge_bytes(loads, edge, nbytes, host_of, self.network)
        return loads

    def makespan(self) -> float:
        """The bound: bytes on the most loaded link / its rate."""
        return makespan(self.link_bytes(), self.link_rates())

    def predicted_time(self) -> float:
        """Seconds (with rates in bytes/s) that cost.py predicts for running the plan."""
        return cost.predict(self)

    def describe(self) -> str:
        """One printable line: the boundary's choice and its predicted time (cost.describe)."""
        return cost.describe(self)

    def backward(self) -> ReshardPlan:
        """The plan moving a gradient of the destination layout back to the source layout: the
        same strategy, or, when `auto` chose this plan, `auto` again over the same candidates
        (the best strategy of a direction need not be the other's: a TP1 -> TP2 activation
        wants a broadcast, its gradient a single send)."""
        strategy, candidates = ("auto", tuple(name for name, _ in self.considered)) \
            if self.considered else (self.strategy, STRATEGIES)
        return make_plan(self.shape, self.dtype, self.dst, self.src, strategy, self.solver,
                         chunks=self.chunks, rates=dict(self.rates),
                         network=self.network, candidates=candidates)


def make_plan(shape: tuple[int, ...], dtype: torch.dtype, src: Layout, dst: Layout,
              strategy: str = "auto", solver: str | Solver = "least_bytes", *,
              chunks: int = 16, rates: dict[str, float] | None = None,
              network: Network | None = None, candidates: tuple[str, ...] = STRATEGIES
              ) -> ReshardPlan:
    """Plan moving a `shape` tensor from `src` to `dst` (see plan.py for the strategies and
    solvers.py for the solvers: a name, or a Solver). rates: bytes/s of each host's links
    (each NIC's), default 1.0 each; network: the links and backend (network.py), default gloo
    with one NIC per host.

    strategy "auto": of `candidates` (the strategies the caller can run), the one whose plan
    has the lowest predicted time (cost.py), the first of them on a tie (within 1e-9), so a
    broadcast is taken only where it is faster and plain send/recv where all are the same."""
    network = network if network is not None else DEFAULT_NETWORK
    if strategy == "auto":
        unknown = [name for name in candidates if name not in STRATEGIES]
        if unknown or not candidates:
            raise ValueError(f"candidates {tuple(candidates)}: choose one or more of "
                             f"{', '.join(STRATEGIES)}")
        plans = [make_plan(shape, dtype, src, dst, name, solver, chunks=chunks, rates=rates,
                           network=network) for name in candidates]
        times = [plan.predicted_time() for plan in plans]
        chosen = next(plan for plan, seconds in zip(plans, times)
                      if seconds <= min(times) * (1 + 1e-9))
        return replace(chosen, considered=tuple(zip(candidates, times)))
    if chunks < 1:
        raise ValueError(f"chunks={chunks}: a chained broadcast needs at least one chunk")
    shape = tuple(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    host_of = {**dict(zip(src.mesh.ranks, src.mesh.hosts)),
               **dict(zip(dst.mesh.ranks, dst.mesh.hosts))}
    host_rates = {host: 1.0 for host in host_of.values()} | dict(rates or {})
    link_rates = network.link_rates(host_rates, host_of)
    works = make_works(strategy, plan_transfers(shape, src, dst))
    options, fixed = work_options(strategy, works, host_of, itemsize, network)
    exchanges = tuple(Step(work, work.receivers[0],
                           tuple(exchange_edges(work, host_of, network)))
                      for work in works if strategy == "send_recv_allgather")
    solution: Solution = solve(options, fixed, link_rates, solver)
    steps = []
    for index in solution.order:
        work = works[index]
        sender = work.transfer.senders[solution.choice[index]]
        steps.append(Step(work, sender,
                          tuple(work_edges(strategy, work, sender, host_of, network))))
    return ReshardPlan(shape, dtype, src, dst, strategy, solver, chunks,
                       tuple(sorted(host_rates.items())), tuple(steps), exchanges,
                       solution.exact, network)


def work_options(strategy: str, works: list[Work], host_of: dict[int, str], itemsize: int,
                 network: Network = DEFAULT_NETWORK
                 ) -> tuple[list[list[dict[Link, int]]], dict[Link, int]]:
    """The solver's problem: per work, per candidate sender, the bytes it puts on each link;
    and the bytes that are there whatever the choice (the all-gather exchange)."""
    options = [[edge_loads(work_edges(strategy, work, sender, host_of, network),
                           work.numel * itemsize, host_of, network)
                for sender in work.transfer.senders] for work in works]
    fixed: dict[Link, int] = {}
    for work in works if strategy == "send_recv_allgather" else ():
        for edge in exchange_edges(work, host_of, network):
            add_edge_bytes(fixed, edge, work.numel * itemsize, host_of, network)
    return options, fixed
