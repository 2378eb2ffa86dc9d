"""Cross-mesh resharding (arXiv 2211.05322): moving a tensor laid out over one device mesh to
another mesh of a different shape or layout, by send/recv, send/recv plus an all-gather inside
the destination mesh, or broadcasts (gloo's, or a chunk-pipelined chain) with load-balanced
sender choice.

    src = Layout.sharded(Mesh((0, 1), ("a", "a")), ndim=3, dim=0)      # sequence-parallel
    dst = Layout.replicated(Mesh((2, 3, 4), ("b", "b", "c")), ndim=3)
    plan = make_plan((s, b, h), torch.float32, src, dst, "chained_broadcast", "least_bytes")

    # on GPUs: NCCL's ring broadcast, one NIC per GPU, the strategy chosen by predicted time
    net = Network("nccl", latency=10e-6, gpus_per_host=8, nics_per_host=8)
    plan = make_plan((s, b, h), torch.bfloat16, src, dst, network=net, rates=nic_bytes_per_s)
    print(plan.describe())                     # the choice, its predicted time, the others

Modules: `layout` (meshes, layouts, tiles), `network` (links per host or per device, the
backend), `plan` (tile-to-slice planning, strategies, link bytes), `solvers` (sender choice:
training's least_bytes; the paper's randomized greedy and an exact search are the benchmark's,
benchmarks/reshard_solvers.py, passed to make_plan as a Solver),
`cost` (predicted time per backend), `resharding` (the plan), `boundary` (a pipeline boundary's
routes and groups, as the training transport runs them). A blocking runner of any plan, the
chained broadcast's too, is the benchmark's (benchmarks/reshard_runner.py). See docs/reshard.md.
"""

from .layout import Layout, Mesh
from .network import BACKENDS, Network
from .plan import STRATEGIES
from .resharding import ReshardPlan, make_plan
from .solvers import SOLVERS

__all__ = ["BACKENDS", "SOLVERS", "STRATEGIES", "Layout", "Mesh", "Network", "ReshardPlan",
           "make_plan"]
