"""Sender solvers beyond the library's, for the resharding benchmark (bench_reshard.py) and the
library's tests: make_plan takes any `Solver` (megadomino/pipeline/reshard/solvers.py) in place
of a solver's name, and wraps it as it wraps its own (the better of its answer and `none`'s).
Training plans with `least_bytes`; these compare against it on the paper's cases.

- `RandomGreedy`: the randomized max-concurrency greedy of the paper's implementation: round by
  round, sample `trials` random orders of the remaining works, in each take every work whose
  links (the sender's and receivers') are still free this round, from a free candidate drawn
  with weight (max load - its load + 1); keep the sample with the most works (ties: the lowest
  makespan). Rounds run in order. Deterministic for a fixed seed (`random.Random(seed)`).
- `Search`: branch and bound over every candidate of every work (largest works first), pruned
  by the makespan so far (loads only grow); exact when it finishes within `max_nodes` nodes,
  else the best found. Starts from the better of `least_bytes` and `none`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megadomino.pipeline.reshard.solvers import (
    Link,
    Loads,
    Solution,
    add_loads,
    largest_first,
    least_bytes,
    makespan,
    solve,
)


def solvers(seed: int = 0) -> tuple:
    """Every solver, the library's by name, these seeded with `seed` where they draw."""
    return ("none", "least_bytes", RandomGreedy(seed), Search())


@dataclass(frozen=True)
class RandomGreedy:
    seed: int = 0
    trials: int = 32
    name = "random_greedy"

    def __call__(self, options: list[list[Loads]], fixed: Loads,
                 rates: dict[Link, float]) -> Solution:
        rng = random.Random(self.seed)
        loads, choice, order = dict(fixed), [0] * len(options), []
        remaining = list(range(len(options)))
        while remaining:
            best: tuple[tuple[int, float], list[tuple[int, int]]] | None = None
            for _ in range(self.trials):
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


@dataclass(frozen=True)
class Search:
    max_nodes: int = 200_000
    name = "search"

    def __call__(self, options: list[list[Loads]], fixed: Loads,
                 rates: dict[Link, float]) -> Solution:
        """Branch and bound (module docstring)."""
        start = min(least_bytes(options, fixed, rates), solve(options, fixed, rates, "none"),
                    key=lambda s: s.makespan)
        order = largest_first(options)
        best = {"makespan": start.makespan, "choice": list(start.choice)}
        current = [0] * len(options)
        nodes = 0

        def visit(depth: int, loads: Loads) -> bool:
            """False once the node budget is spent."""
            nonlocal nodes
            nodes += 1
            if nodes > self.max_nodes:
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
        return Solution(tuple(best["choice"]), tuple(range(len(options))), best["makespan"],
                        exact)
