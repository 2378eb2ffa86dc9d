"""The layer cut: L layers into S contiguous, non-empty stages, exactly.

Given costs[s, a, b] (stage s holding layers [a, b); inf where b <= a) and a floor (the chain's
slowest boundary, which no cut changes), `best_cut` minimises the bottleneck

    max(floor, max_s costs[s, a_s, a_{s+1}])        a_0 = 0 < a_1 < ... < a_S = L

and, among the cuts that reach it, the sum of the stages' costs (the pipeline's fill and drain).
Both by dynamic programming over (stages placed, layers covered), each pass O(S L^2):
  pass 1  best[s][b] = min_a max(best[s-1][a], costs[s-1, a, b]), best[0][0] = floor
  pass 2  total[s][b] = min_a total[s-1][a] + costs[s-1, a, b] over costs <= the bottleneck
`brute_cut` tries every cut (C(L-1, S-1) of them): the oracle tests compare the two with.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Cut:
    spans: tuple[tuple[int, int], ...]
    """Each stage's [start, end)."""
    bottleneck: float
    total: float

    @property
    def key(self) -> tuple[float, float]:
        """What the cut minimises, in order."""
        return self.bottleneck, self.total


def best_cut(costs: np.ndarray, floor: float = 0.0) -> Cut | None:
    """The exact cut (module docstring); None when there are more stages than layers."""
    stages, layers = costs.shape[0], costs.shape[1] - 1
    if not 1 <= stages <= layers:
        return None
    best = np.full(layers + 1, math.inf)
    best[0] = floor
    for s in range(stages):
        best = np.min(np.maximum(best[:, None], costs[s]), axis=0)
    bottleneck = float(best[layers])
    allowed = np.where(costs <= bottleneck, costs, math.inf)
    total = np.full(layers + 1, math.inf)
    total[0] = 0.0
    choices = []
    for s in range(stages):
        candidates = total[:, None] + allowed[s]
        choice = np.argmin(candidates, axis=0)
        total = candidates[choice, np.arange(layers + 1)]
        choices.append(choice)
    end, spans = layers, []
    for choice in reversed(choices):
        start = int(choice[end])
        spans.append((start, end))
        end = start
    return Cut(tuple(reversed(spans)), bottleneck, float(total[layers]))


def brute_cut(costs: np.ndarray, floor: float = 0.0) -> Cut | None:
    """Every cut tried; the least (bottleneck, total), the first found on ties."""
    stages, layers = costs.shape[0], costs.shape[1] - 1
    if not 1 <= stages <= layers:
        return None
    found = None
    for inner in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *inner, layers)
        spans = tuple(zip(bounds, bounds[1:]))
        each = [float(costs[s, a, b]) for s, (a, b) in enumerate(spans)]
        cut = Cut(spans, max(floor, *each), sum(each))
        if found is None or cut.key < found.key:
            found = cut
    return found
