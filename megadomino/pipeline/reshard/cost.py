"""What a plan costs in time, per backend: a latency term, pipelined chunks, and the order.

Notation: B the bytes of a work, beta the rate of the slowest rated link an edge crosses (inf
for the unrated loopback), alpha = network.latency, gamma = network.chunk_cost (network.py).

- One message (send_recv, the scatter of send_recv_allgather): alpha + B / beta.
- Fan-out (gloo's broadcast tree; gloo's point-to-point exchange): a rank holding the whole
  message posts its sends to all its children at once (gloo/broadcast.cc; the exchange's one
  batch), so the copies that start together share the links they cross: a copy starting at
  t (when its sender has the message) arrives at t + alpha + B max_links(k_link / rate_link),
  k_link the copies starting at t on that link. gloo's tree gives the root of n receivers
  ceil(log2(n + 1)) children, so its time is at least ceil(log2(n + 1)) B / beta and grows
  with n: 1 -> 4 on four hosts takes the root's three copies, then the one forwarded,
  4 B / beta; A -> B B C C D D (7 ranks) 3 copies out of A, then 3 out of B, 6 B / beta.
- Chain of h hops in c chunks, hop j taking t_j = per_chunk + (B / c) / beta_j a chunk (a flow
  shop of c equal jobs): h per_hop + sum_j t_j + (c - 1) max_j t_j, which is about
  h alpha + B / beta when c >> h: independent of the receiver count to first order (nccl-tests'
  PERFORMANCE.md: broadcast t = S / B, its bus bandwidth its algorithm bandwidth).
  NCCL's broadcast ring and the parts of its all-gather ring pipeline inside the kernel:
  per_hop = alpha, per_chunk = gamma, c = ceil(B / chunk_bytes). The chained broadcast sends
  each chunk as a message that the host forwards: per_hop = 0, per_chunk = alpha + gamma,
  c = min(plan.chunks, elements). NCCL's ring all-gather of B over n replicas (each part B / n
  travels n - 1 hops, every ring edge carries n - 1 parts) then costs, with the link bound,
  (n - 1) alpha + (n - 1) / n B / beta (PERFORMANCE.md: all-gather t = S (n - 1) / (n B)).

A phase (the steps; then, for send_recv_allgather, the exchange) takes the larger of its link
bound (bytes on its most loaded link / that link's rate: its steps share links) and its critical
path: the slowest step, as every step is posted at once (point-to-point; gloo runs each
broadcast group on its own threads), except NCCL's collectives (a broadcast step; the exchange's
all-gather of one slice), which a rank runs one after another in the plan's order (one stream):
there the path is simulated, each collective starting when all its ranks are free. Predictions
are first-order lower bounds: contention enters through the link bound only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .network import Link
from .plan import add_edge_bytes
from .solvers import makespan, solver_name

if TYPE_CHECKING:
    from .resharding import ReshardPlan, Step


def chain_time(nbytes: float, hop_rates: list[float], chunks: int, per_chunk: float,
               per_hop: float) -> float:
    """A message of `nbytes` pipelined in `chunks` along hops of the given rates."""
    hop_times = [per_chunk + nbytes / chunks / rate for rate in hop_rates]
    return len(hop_rates) * per_hop + sum(hop_times) + (chunks - 1) * max(hop_times, default=0)


def fanout_time(plan: ReshardPlan, edges: tuple[tuple[int, int], ...], nbytes: float,
                rates: dict[Link, float]) -> float:
    """Store and forward from edges[0]'s source, in waves: the copies whose senders have the
    message at the same time start together and share the links they cross."""
    network, host_of = plan.network, plan.host_of()
    have, pending = {edges[0][0]: 0.0}, list(edges)
    while pending:
        start = min(have[source] for source, _ in pending if source in have)
        wave = [edge for edge in pending if have.get(edge[0]) == start]
        copies: dict[Link, int] = {}
        for edge in wave:
            for link in network.edge_links(edge, host_of):
                copies[link] = copies.get(link, 0) + 1
        for edge in wave:
            share = max((copies[link] / rates[link] for link in network.edge_links(edge, host_of)
                         if link in rates), default=0.0)
            have[edge[1]] = start + network.latency + nbytes * share
        pending = [edge for edge in pending if edge not in wave]
    return max(have.values())


def step_time(plan: ReshardPlan, step: Step, exchange: bool, rates: dict[Link, float]) -> float:
    """The step alone on the machine (see the module docstring for each form)."""
    if not step.edges:
        return 0.0
    network, host_of = plan.network, plan.host_of()
    nbytes = step.work.numel * plan.itemsize
    hop_rates = [network.edge_rate(edge, host_of, rates) for edge in step.edges]
    if plan.strategy == "chained_broadcast" and not exchange:
        return chain_time(nbytes, hop_rates, min(plan.chunks, step.work.numel),
                          network.latency + network.chunk_cost, 0.0)
    if _collective(plan, exchange):
        return chain_time(nbytes, hop_rates, max(1, math.ceil(nbytes / network.chunk_bytes)),
                          network.chunk_cost, network.latency)
    return fanout_time(plan, step.edges, nbytes, rates)


def _collective(plan: ReshardPlan, exchange: bool) -> bool:
    """Whether the phase's steps are NCCL collectives (serial on each rank)."""
    return plan.network.rings and (exchange or plan.strategy == "broadcast")


def phase_time(plan: ReshardPlan, steps: tuple[Step, ...], exchange: bool) -> float:
    """max(link bound of the phase, its critical path)."""
    rates, host_of, loads = plan.link_rates(), plan.host_of(), {}
    for step in steps:
        for edge in step.edges:
            add_edge_bytes(loads, edge, step.work.numel * plan.itemsize, host_of, plan.network)
    times = [step_time(plan, step, exchange, rates) for step in steps]
    if not _collective(plan, exchange):
        return max(makespan(loads, rates), max(times, default=0.0))
    jobs: dict = {}  # one collective per broadcast step / per slice's all-gather, in plan order
    for step, seconds in zip(steps, times):
        key = step.work.transfer if exchange else step
        members = step.work.transfer.receivers if exchange else (step.sender,
                                                                 *step.work.receivers)
        jobs[key] = (members, max(seconds, jobs.get(key, ((), 0.0))[1]))
    free: dict[int, float] = {}
    for members, seconds in jobs.values():
        end = max(free.get(rank, 0.0) for rank in members) + seconds
        free.update(dict.fromkeys(members, end))
    return max(makespan(loads, rates), max(free.values(), default=0.0))


def predict(plan: ReshardPlan) -> float:
    """The plan's predicted time: its phases one after the other."""
    total = phase_time(plan, plan.steps, False)
    return total + phase_time(plan, plan.exchanges, True) if plan.exchanges else total


def describe(plan: ReshardPlan) -> str:
    """One line: the boundary, the strategy and solver, the network, the predicted time and
    link bound, the busiest link, and the strategies `auto` weighed with their times."""
    loads = {link: n for link, n in plan.link_bytes().items() if link in plan.link_rates()}
    busiest = (f", busiest {' '.join(max(loads, key=loads.get))} "
               f"{_bytes(max(loads.values()))}" if loads else "")
    weighed = ("; weighed " + ", ".join(f"{name} {_seconds(seconds)}"
                                        for name, seconds in plan.considered)
               if plan.considered else "")
    return (f"ranks {_span(plan.src.mesh.ranks)} -> {_span(plan.dst.mesh.ranks)} "
            f"{tuple(plan.shape)} {str(plan.dtype).removeprefix('torch.')}: {plan.strategy} "
            f"({solver_name(plan.solver)}; {plan.network.describe()}) predicted "
            f"{_seconds(plan.predicted_time())}, link bound {_seconds(plan.makespan())}"
            f"{busiest}{weighed}")


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def _bytes(value: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _span(ranks: tuple[int, ...]) -> str:
    ordered = sorted(ranks)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, ordered))
