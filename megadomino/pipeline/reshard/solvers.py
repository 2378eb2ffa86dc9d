"""Sender solvers: which holder of a slice sends each work, and in which order the works run.

The problem, abstracted from tensors: work w may be sent by any of its candidates c, which then
puts `options[w][c]` bytes on links (a host's uplink, its downlink; see plan.py); `fixed` bytes
are on the links whatever the choice (the all-gather exchange). The simulated makespan of a
choice is the time of the most loaded link, max over links of bytes / rate (links without a rate,
loopback, do not count): the lower bound of any schedule of those bytes, and what the link-bound
benchmarks approach. Solvers:

- `none`: no balancing: every work from its first candidate (the lowest rank holding it).
- `least_bytes`: works by decreasing size, each from the candidate that leaves the lowest
  makespan (ties: the least loaded links it touches, then the lower rank).
- `random_greedy`: the randomized max-concurrency greedy of the paper's implementation: round by
  round, sample `trials` random orders of the remaining works, in each take every work whose
  links (the sender's and receivers') are still free this round, from a free candidate drawn
  with weight (max load - its load + 1); keep the sample with the most works (ties: the lowest
  makespan). Rounds run in order. Deterministic for a fixed seed (`random.Random(seed)`).
- `search`: branch and bound over every candidate of every work (largest works first), pruned
  by the makespan so far (loads only grow); exact when it finishes within `max_nodes` nodes, else
  the best found. Starts from the better of `least_bytes` and `none`.

Every solver returns the better of its answer and `none`'s, so balancing never loses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

Link = tuple[str, str]
Loads = dict[Link, int]

SOLVERS = ("none", "least_bytes", "random_greedy", "search")


@dataclass(frozen=True)
class Solution:
    """choice[w]: the index of work w's candidate; order: the works in the order they run;
    makespan: the simulated makespan (seconds if rates are bytes/s); exact: whether it is the
    optimum (search only)."""

    choice: tuple[int, ...]
    order: tuple[int, ...]
    makespan: float
    exact: bool = False


def add_loads(total: Loads, extra: Loads) -> Loads:
    merged = dict(total)
    for link, nbytes in extra.items():
        merged[link] = merged.get(link, 0) + nbytes
    return merged


def makespan(loads: Loads, rates: dict[Link, float]) -> float:
    """max over rated links of bytes / rate (0 with no rated link loaded)."""
    return max((nbytes / rates[link] for link, nbytes in loads.items() if link in rates),
               default=0.0)


def choice_loads(options: list[list[Loads]], fixed: Loads, choice: tuple[int, ...]) -> Loads:
    loads = dict(fixed)
    for work, index in enumerate(choice):
        loads = add_loads(loads, options[work][index])
    return loads


def solve(options: list[list[Loads]], fixed: Loads, rates: dict[Link, float], solver: str,
          seed: int = 0, trials: int = 32, max_nodes: int = 200_000) -> Solution:
    """Choose a candidate for every work (options[w][c]: the loads of work w from candidate c)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r}: choose from {', '.join(SOLVERS)}")
    plain = tuple(0 for _ in options)
    baseline = Solution(plain, tuple(range(len(options))),
                        makespan(choice_loads(options, fixed, plain), rates))
    if solver == "none":
        return baseline
    if solver == "least_bytes":
        found = least_bytes(options, fixed, rates)
    elif solver == "random_greedy":
        found = random_greedy(options, fixed, rates, random.Random(seed), trials)
    else:
        start = min(least_bytes(options, fixed, rates), baseline, key=lambda s: s.makespan)
        found = search(options, fixed, rates, start, max_nodes)
    return baseline if baseline.makespan < found.makespan else found


def _by_size(options: list[list[Loads]]) -> list[int]:
    """Work indices, largest first (a work's size: its first candidate's bytes), stable."""
    return sorted(range(len(options)), key=lambda w: -sum(options[w][0].values()))


def least_bytes(options: list[list[Loads]], fixed: Loads, rates: dict[Link, float]) -> Solution:
    loads, choice = dict(fixed), [0] * len(options)
    for work in _by_size(options):
        choice[work] = min(range(len(options[work])),
                           key=lambda index: _greedy_key(loads, options[work][index], rates, index))
        loads = add_loads(loads, options[work][choice[work]])
    return Solution(tuple(choice), tuple(range(len(options))), makespan(loads, rates))


def _greedy_key(loads: Loads, extra: Loads, rates: dict[Link, float],
                index: int) -> tuple[float, float, int]:
    """The makespan after adding `extra`, then the time of the busiest link it touches."""
    after = add_loads(loads, extra)
    touched = {link: after[link] for link in extra}
    return makespan(after, rates), makespan(touched, rates), index


def random_greedy(options: list[list[Loads]], fixed: Loads, rates: dict[Link, float],
                  rng: random.Random, trials: int) -> Solution:
    loads, choice, order = dict(fixed), [0] * len(options), []
    remaining = list(range(len(options)))
    while remaining:
        best: tuple[tuple[int, float], list[tuple[int, int]]] | None = None
        for _ in range(trials):
            picked = _one_round(options, loads, remaining, rng)
            after = loads
            for work, index in picked:
                after = add_loads(after, options[work][index])
            score = (len(picked), -makespan(after, rates))
            if best is None or score > best[0]:
                best = (score, picked)
        for work, index in best[1]:
            choice[work] = index
            order.append(work)
            loads = add_loads(loads, options[work][index])
            remaining.remove(work)
    return Solution(tuple(choice), tuple(order), makespan(loads, rates))


def _one_round(options: list[list[Loads]], loads: Loads, remaining: list[int],
               rng: random.Random) -> list[tuple[int, int]]:
    """One random set of works whose links do not overlap (the first always fits)."""
    used: set[Link] = set()
    picked = []
    for work in rng.sample(remaining, len(remaining)):
        free = [i for i, extra in enumerate(options[work]) if not used & extra.keys()]
        if not free:
            continue
        sender_load = [max((loads.get(link, 0) for link in options[work][i]), default=0)
                       for i in free]
        weights = [max(sender_load) - load + 1 for load in sender_load]
        index = rng.choices(free, weights=weights)[0]
        used |= options[work][index].keys()
        picked.append((work, index))
    return picked


def search(options: list[list[Loads]], fixed: Loads, rates: dict[Link, float], start: Solution,
           max_nodes: int) -> Solution:
    """Branch and bound from `start` (see the module docstring)."""
    order = _by_size(options)
    best = {"makespan": start.makespan, "choice": list(start.choice)}
    current = [0] * len(options)
    nodes = 0

    def visit(depth: int, loads: Loads) -> bool:
        """False once the node budget is spent."""
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes:
            return False
        if depth == len(order):
            span = makespan(loads, rates)
            if span < best["makespan"]:
                best["makespan"], best["choice"] = span, list(current)
            return True
        work = order[depth]
        branches = sorted(((makespan(add_loads(loads, extra), rates), i)
                           for i, extra in enumerate(options[work])))
        for span, index in branches:
            if span >= best["makespan"]:
                break  # sorted: the remaining branches are no better
            current[work] = index
            if not visit(depth + 1, add_loads(loads, options[work][index])):
                return False
        return True

    exact = visit(0, dict(fixed))
    return Solution(tuple(best["choice"]), tuple(range(len(options))), best["makespan"], exact)
