"""Sender solvers: which holder of a slice sends each work, and in which order the works run.

The problem, abstracted from tensors: work w may be sent by any of its candidates c, which then
puts `options[w][c]` bytes on links (a host's uplink, its downlink; see plan.py); `fixed` bytes
are on the links whatever the choice (the all-gather exchange). The simulated makespan of a
choice is the time of the most loaded link, max over links of bytes / rate (links without a rate,
loopback, do not count): the lower bound of any schedule of those bytes, and what the link-bound
benchmarks approach. Solvers:

- `none`: no balancing: every work from its first candidate (the lowest rank holding it).
- `least_bytes` (what training plans with): works by decreasing size, each from the candidate
  that leaves the lowest makespan (ties: the least loaded links it touches, then the lower rank).
- any `Solver` a caller passes instead of a name: the resharding benchmark's randomized greedy
  and branch and bound (benchmarks/reshard_solvers.py) compare against `least_bytes` so.

Every solver returns the better of its answer and `none`'s, so balancing never loses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

Link = tuple[str, str]
Loads = dict[Link, int]

SOLVERS = ("none", "least_bytes")
"""The solvers make_plan takes by name."""


@dataclass(frozen=True)
class Solution:
    """choice[w]: the index of work w's candidate; order: the works in the order they run;
    makespan: the simulated makespan (seconds if rates are bytes/s); exact: whether the solver
    proved it optimal (neither of the library's does)."""

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


class Solver(Protocol):
    """A sender solver passed to make_plan in place of a name: a pure function of the problem
    (every rank must plan alike), `name` shown in the plan's description."""

    name: str

    def __call__(self, options: list[list[Loads]], fixed: Loads,
                 rates: dict[Link, float]) -> Solution: ...


def solver_name(solver: str | Solver) -> str:
    return solver if isinstance(solver, str) else solver.name


def solve(options: list[list[Loads]], fixed: Loads, rates: dict[Link, float],
          solver: str | Solver) -> Solution:
    """Choose a candidate for every work (options[w][c]: the loads of work w from candidate c)."""
    if isinstance(solver, str) and solver not in SOLVERS:
        raise ValueError(f"solver {solver!r}: choose from {', '.join(SOLVERS)}, or pass a "
                         "Solver (benchmarks/reshard_solvers.py has the paper's)")
    plain = tuple(0 for _ in options)
    baseline = Solution(plain, tuple(range(len(options))),
                        makespan(choice_loads(options, fixed, plain), rates))
    if solver == "none":
        return baseline
    found = (least_bytes(options, fixed, rates) if solver == "least_bytes"
             else solver(options, fixed, rates))
    return baseline if baseline.makespan < found.makespan else found


def largest_first(options: list[list[Loads]]) -> list[int]:
    """Work indices, largest first (a work's size: its first candidate's bytes), stable."""
    return sorted(range(len(options)), key=lambda w: -sum(options[w][0].values()))


def least_bytes(options: list[list[Loads]], fixed: Loads, rates: dict[Link, float]) -> Solution:
    loads, choice = dict(fixed), [0] * len(options)
    for work in largest_first(options):
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
