"""On the GPU machine: cross-mesh resharding with NCCL, every strategy (send/recv, scatter +
all-gather exchange, broadcast, chained broadcast), each case running every layout pair of 4
ranks (source + destination meshes of 1 + 3, 2 + 2 and 3 + 1 ranks: replicated or sharded along
each dim of an odd (5, 7, 3) tensor, some tiles uneven, some empty) under every sender solver,
forward and backward: tests/test_reshard_dist.py's `check_strategy`, whose reference is slicing
the full tensor (bit-identical tiles) and the plan's edges (bytes sent per pair). fp32 only:
resharding moves bits, it does no arithmetic, and no case of its twin trains.
The gpu tier: `python -m pytest tests --tier gpu -q`; it needs 4 GPUs.

The twin writes its case for gloo; the setup swaps two of its names in each rank: `Reshard`
allocates received tiles on the CPU unless told a device (here it is told the rank's GPU), and
`torch.randn` draws the full tensors from a CPU generator (drawn so, then moved: the CPU run's
values). See tests/gpu/gpu_twins.py.
"""

from __future__ import annotations

import test_reshard_dist as twin
from gpu_twins import TorchDrawingOnCpu, adopt, built_on, patch, rank_device

from dist_utils import DistSuite
from megadomino.pipeline.reshard import STRATEGIES

GroupCache, Reshard = twin.GroupCache, twin.Reshard  # the benchmark's runner (reshard_runner.py)

SUITE = DistSuite(worlds=(4,), backend="nccl", timeout=120.0)


@SUITE.setup
def _setup(world: int) -> dict:
    device = rank_device()
    patch(twin, Reshard=built_on(Reshard, device), torch=TorchDrawingOnCpu(device))
    return {"groups": GroupCache()}


for _strategy in STRATEGIES:
    adopt(SUITE, twin.SUITE, f"reshard-{_strategy}", 4, prefix="nccl", timeout=120.0)

test_gpu_reshard = SUITE.test()
