"""On the GPU machine: tests/test_open_links.py's cases under NCCL, each at its own world (2
GPUs: the pipeline channels with and without virtual stages; 3: a TP 2 -> TP 1 boundary's route
groups under each resharding strategy; 4: PP 4 and PP 2 x DP 2 channels): every communicator
connected at set-up in one order on every rank, then usable in an order no schedule has.
`python -m pytest tests --tier gpu -q` runs it.
"""

from __future__ import annotations

import test_open_links as twin
from gpu_twins import rank_device


def _setup(world: int) -> dict:
    rank_device()
    return {}


SUITE = twin.SUITE.derived(backend="nccl", setup=_setup, worlds=None)
test_gpu_open_links = SUITE.test()
