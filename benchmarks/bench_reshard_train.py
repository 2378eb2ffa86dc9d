"""Cross-mesh resharding in training, measured: each boundary of a heterogeneous --pipeline-plan
moved through the training transport (ReshardTransport) under every --pipeline-reshard
strategy, activation forward and gradient backward, against its bound: the bytes on the busiest
GPU link over the point-to-point bandwidth this run measures at that message size.

    torchrun --standalone --nproc_per_node 3 benchmarks/bench_reshard_train.py --out rt3.json
    torchrun --standalone --nproc_per_node 4 benchmarks/bench_reshard_train.py --out rt4.json
    # the same on GPUs with each row's kernel timeline (where a transfer's time goes)
    torchrun --standalone --nproc_per_node 3 benchmarks/bench_reshard_train.py \
        --plans dp2_dp1 --profile --out rt3_profile.json
    # CPU, gloo, a tiny shape (tests/test_bench_reshard_train.py)
    torchrun --nproc_per_node 3 benchmarks/bench_reshard_train.py --device cpu --seq 8 \
        --micro-batch 2 --hidden 16 --out rt_cpu.json

Plans (`PLANS`, tests/test_pipeline_hetero.py's): on 3 ranks TP2 -> TP1, DP2 -> DP1 and
TP1 -> TP2; on 4 a TP2 -> TP1 -> TP1 chain, TP1 -> TP2 -> TP1, DP2 -> TP2 and DP2 -> DP1 -> TP1
(a boundary between same layouts is a rank-to-rank copy, the same under every strategy).
The activation is one micro-batch's (seq, batch, hidden), gpt3-1.3b's by default (2048, 4,
2048), bf16 on GPUs, fp32 on CPUs.

What is timed: per plan, one ReshardTransport per strategy (send-recv, broadcast,
scatter-gather, auto), built on every rank as training builds it; a transfer is the sending
stage's send_activation (send_grad) and the receiving stage's recv_activation (recv_grad), a
flush and each handle's wait, as the executor posts them. `--warmup` transfers, then per round
`--iters` transfers back to back between a barrier and a device synchronize; a round's time per
transfer is the slowest rank's; median and range over `--rounds`. The point-to-point bandwidth:
ranks 0 -> 1 on their own group (comm's send/recv), timed the same way, at each busiest-link
size. Bytes on the busiest GPU link: the most any rank sends or receives in one transfer under
the plan (its edges: a broadcast's ring hops, an all-gather's ring), what plan.link_bytes()
puts on the GPU ports of one host. A row's bound is its own plan's; the boundary's is the least
over the three strategies; the targets (printed, not enforced): auto's choice within 1.3x the
boundary's bound and 1.1x the fastest strategy.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_reshard import wire  # noqa: E402
from timeline import profile_summary  # noqa: E402

from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.distributed import comm
from megadomino.pipeline.reshard.boundary import STRATEGY_OF, Route
from megadomino.pipeline.reshard.layout import box_shape
from megadomino.pipeline.transport_reshard import ReshardTransport

PLANS = {  # name -> stages as (ranks, tp)
    "tp2_tp1": (((0, 1), 2), ((2,), 1)),
    "dp2_dp1": (((0, 1), 1), ((2,), 1)),
    "tp1_tp2": (((0,), 1), ((1, 2), 2)),
    "tp2_tp1_tp1": (((0, 1), 2), ((2,), 1), ((3,), 1)),
    "tp1_tp2_tp1": (((0,), 1), ((1, 2), 2), ((3,), 1)),
    "dp2_tp2": (((0, 1), 1), ((2, 3), 2)),
    "dp2_dp1_tp1": (((0, 1), 1), ((2,), 1), ((3,), 1)),
}
STRATEGIES = (*STRATEGY_OF, "auto")
FLAG_OF = {plan_name: flag for flag, plan_name in STRATEGY_OF.items()}
DIRECTIONS = ("activation", "gradient")
TARGET_BOUND, TARGET_FASTEST = 1.3, 1.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--plans", nargs="+", choices=list(PLANS), default=None,
                        help="default: every plan of the world's rank count")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="TP stages split the seq dim (else replicate the activation)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="the hosts the cost model sees (default: the world, one host)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON of the run (rank 0 writes it)")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: after each row's rounds, profile --iters more transfers "
                             "(benchmarks/timeline.py: NCCL, copy and compute busy ms, idle, "
                             "top kernels and host ops; each rank's in its row's 'profile')")
    parser.add_argument("--veth", default=None,
                        help="emulated hosts (bench_reshard_train_netns.sh): this network "
                             "namespace's interface, whose bytes each row counts")
    parser.add_argument("--host-of", type=int, nargs="+", default=None,
                        help="with --veth: each rank's host; the first rank of a host reads "
                             "its interface")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if min(args.seq, args.micro_batch, args.hidden, args.iters, args.rounds) < 1 \
            or args.warmup < 0:
        parser.error("--seq, --micro-batch, --hidden, --iters and --rounds take >= 1, "
                     "--warmup >= 0")
    if (args.veth is None) != (args.host_of is None):
        parser.error("--veth and --host-of go together")
    if args.profile and args.device != "cuda":
        parser.error("--profile profiles CUDA kernels: it needs --device cuda")
    return args


def reads_wire(args: argparse.Namespace) -> str | None:
    """This rank's interface when it is the first rank of its host, else None."""
    if args.veth is None:
        return None
    rank = dist.get_rank()
    return args.veth if args.host_of.index(args.host_of[rank]) == rank else None


def pipeline_plan(name: str) -> PipelinePlan:
    """The plan of `PLANS[name]`, one layer a stage (the transport reads ranks and TP only)."""
    stages = tuple(Stage(index, ranks, tp, ((index, index + 1),))
                   for index, (ranks, tp) in enumerate(PLANS[name]))
    return PipelinePlan(stages, len(stages), batch_split=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(once, args: argparse.Namespace, device: torch.device) -> list[float]:
    """Seconds per call of `once(i)` (this rank's part of transfer i, maybe nothing), per
    round: the slowest rank's (module docstring). Collective over the world."""
    for index in range(args.warmup):
        once(index)
    rounds = []
    for _ in range(args.rounds):
        comm.barrier()
        synchronize(device)
        start = time.perf_counter()
        for index in range(args.iters):
            once(index)
        synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                               device=device)
        comm.all_reduce(elapsed, op=comm.ReduceOp.MAX)
        rounds.append(elapsed.item() / args.iters)
    return rounds


def transfer(transport: ReshardTransport, boundary: int, direction: str,
             tensor: torch.Tensor, micro: int) -> None:
    """This rank's part of one transfer across `boundary` (stage b -> b + 1 for the
    activation, back for the gradient), as the executor posts it: post, flush, wait."""
    sender, receiver = ((boundary, boundary + 1) if direction == "activation"
                        else (boundary + 1, boundary))
    if transport.stage == sender:
        send = (transport.send_activation if direction == "activation"
                else transport.send_grad)
        handle = send(tensor, micro, 0)
    elif transport.stage == receiver:
        receive = (transport.recv_activation if direction == "activation"
                   else transport.recv_grad)
        handle, _ = receive(micro, 0)
    else:
        return
    transport.flush()
    handle.wait()


def _transfer_index(transport: ReshardTransport, boundary: int, direction: str,
                    tensor: torch.Tensor, index: int) -> None:
    """Transfer `index` of a timing loop: its micro-batch tag cycles through the transport's."""
    transfer(transport, boundary, direction, tensor, index % transport.micro)


def busiest_bytes(route: Route, itemsize: int) -> int:
    """The most bytes one rank sends or receives in one transfer of `route` (module
    docstring): its plan's edges, or the rank-to-rank messages between same layouts."""
    if route.plan is not None:
        edges = route.plan.edge_bytes()
    else:
        edges = {(m.sender, m.receiver): (m.piece.stop - m.piece.start) * itemsize
                 for m in route.messages}
    ports: dict[tuple[str, int], int] = {}
    for (source, target), nbytes in edges.items():
        for port in (("out", source), ("in", target)):
            ports[port] = ports.get(port, 0) + nbytes
    return max(ports.values(), default=0)


class PointToPoint:
    """Ranks 0 -> 1's send/recv on a group of their own, timed per message size (cached)."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.group = dist.new_group([0, 1])  # collective over the world
        self.rounds: dict[int, list[float]] = {}

    def seconds(self, nbytes: int) -> float:
        """The median seconds of one `nbytes` message (0 for none)."""
        if nbytes and nbytes not in self.rounds:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            rank = dist.get_rank()

            def once(_index: int) -> None:
                if rank in (0, 1):
                    op = (comm.send_op(buffer, 1, group=self.group) if rank == 0
                          else comm.recv_op(buffer, 0, group=self.group))
                    comm.batch_p2p([op]).wait()

            self.rounds[nbytes] = timed(once, self.args, self.device)
        return statistics.median(self.rounds[nbytes]) if nbytes else 0.0

    def rows(self) -> list[dict]:
        return [{"bytes": nbytes, "ms_rounds": [s * 1e3 for s in rounds],
                 "gbps": nbytes / statistics.median(rounds) / 1e9}
                for nbytes, rounds in sorted(self.rounds.items())]


def measure_plan(name: str, args: argparse.Namespace, device: torch.device,
                 p2p: PointToPoint) -> list[dict]:
    """One row per (boundary, direction, strategy) of plan `name`."""
    plan, rank = pipeline_plan(name), dist.get_rank()
    dtype = getattr(torch, args.dtype)
    shape = (args.seq, args.micro_batch, args.hidden)
    stage = next(stage for stage in plan.stages if rank in stage.ranks)
    transports = {strategy: ReshardTransport(
        plan, stage, rank, shape, dtype, device, micro=4,
        sequence_parallel=args.sequence_parallel,
        gpus_per_node=args.gpus_per_node or dist.get_world_size(), strategy=strategy)
        for strategy in STRATEGIES}  # every rank, in this order: their groups are collective
    if rank == 0:
        print("\n".join(f"{name} auto: {line}" for line in transports["auto"].describe()))
    tile = transports["auto"].tiles[stage.index]
    tensor = torch.randn(box_shape(tile), device=device).to(dtype)
    itemsize = tensor.element_size()
    rows = []
    for boundary in range(plan.size - 1):
        for direction in DIRECTIONS:
            for strategy, transport in transports.items():
                ways = transport.forward if direction == "activation" else transport.backward
                route = ways[boundary].route
                once = functools.partial(_transfer_index, transport, boundary, direction,
                                         tensor)
                veth = reads_wire(args)
                before = wire(veth) if veth else (0, 0)
                seconds = timed(once, args, device)
                after = wire(veth) if veth else (0, 0)
                transfers = args.warmup + args.rounds * args.iters
                profile = profiled(once, args) if args.profile else None
                nbytes = busiest_bytes(route, itemsize)
                rows.append({
                    "plan": name, "boundary": boundary, "direction": direction,
                    "strategy": strategy,
                    "runs": FLAG_OF[route.plan.strategy] if route.plan else "same layout",
                    "ms_rounds": [s * 1e3 for s in seconds],
                    "ms": statistics.median(seconds) * 1e3,
                    "busiest_bytes": nbytes, "p2p_ms": p2p.seconds(nbytes) * 1e3,
                    "predicted_ms": route.plan.predicted_time() * 1e3 if route.plan else None,
                    "describe": route.describe(),
                    "wire": [(b - a) / transfers for a, b in zip(before, after)],
                    "profile": profile,
                    "activation_bytes": math.prod(shape) * itemsize})
    return rows


def profiled(once, args: argparse.Namespace) -> list[dict]:
    """Every rank's timeline summary of `--iters` more transfers (rank order): where a
    transfer's time goes (NCCL kernels, copies, idle GPU, host calls). Collective."""
    comm.barrier()
    summary = profile_summary(lambda: [once(index) for index in range(args.iters)], host=True)
    every: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, summary)
    return every


def gather_wire(rows: list[dict], args: argparse.Namespace) -> None:
    """Each row's interface bytes per transfer by host, {host: [tx, rx]}, from the ranks that
    read them (collective over the world); without --veth, nothing."""
    counts = [row.pop("wire") for row in rows]
    mine = {args.host_of[dist.get_rank()]: counts} if reads_wire(args) else {}
    if args.veth is None:
        return
    every: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    hosts = {host: counts for part in every for host, counts in part.items()}
    for index, row in enumerate(rows):
        row["wire_per_host"] = {host: counts[index] for host, counts in sorted(hosts.items())}


def print_wire(rows: list[dict]) -> None:
    """Bytes each host's link carried per transfer, in activations (one activation: the
    whole (seq, batch, hidden) tensor); TCP/IP headers and the timing's barriers add a few
    percent."""
    print("host link bytes per transfer, in activations (tx / rx per host)")
    for row in rows:
        hosts = "  ".join(f"host {host}: {tx / row['activation_bytes']:.2f} / "
                          f"{rx / row['activation_bytes']:.2f}"
                          for host, (tx, rx) in row["wire_per_host"].items())
        print(f"{row['plan']:<12} {row['boundary']} {row['direction']:<10} "
              f"{row['strategy']:<14} {row['runs']:<14} {hosts}")


def add_ratios(rows: list[dict]) -> None:
    """Each row's bound (its busiest bytes at the measured P2P time), the boundary's (the
    least over the three strategies), its ratios to them and to the fastest strategy, and
    auto's choice and prediction for its boundary and direction."""
    for row in rows:
        same = [r for r in rows if (r["plan"], r["boundary"], r["direction"])
                == (row["plan"], row["boundary"], row["direction"])]
        named = [r for r in same if r["strategy"] != "auto"]
        auto = next(r for r in same if r["strategy"] == "auto")
        row["bound_ms"] = row["p2p_ms"]
        row["boundary_bound_ms"] = min(r["p2p_ms"] for r in named)
        row["x_bound"] = row["ms"] / row["bound_ms"] if row["bound_ms"] else None
        row["x_boundary_bound"] = (row["ms"] / row["boundary_bound_ms"]
                                   if row["boundary_bound_ms"] else None)
        row["x_fastest"] = row["ms"] / min(r["ms"] for r in named)
        row["auto_choice"], row["auto_predicted_ms"] = auto["runs"], auto["predicted_ms"]


def targets(rows: list[dict]) -> list[str]:
    """Per boundary and direction: auto's row against the boundary's bound and the fastest."""
    lines = []
    for row in (r for r in rows if r["strategy"] == "auto"):
        bound, fastest = row["x_boundary_bound"], row["x_fastest"]
        ok = (bound is None or bound <= TARGET_BOUND) and fastest <= TARGET_FASTEST
        shown = "n/a" if bound is None else f"{bound:.2f}x"
        lines.append(f"target {'met' if ok else 'MISSED'}: {row['plan']} boundary "
                     f"{row['boundary']} {row['direction']}: auto ({row['runs']}) {shown} the "
                     f"boundary's bound (<= {TARGET_BOUND}x), {fastest:.2f}x the fastest "
                     f"strategy (<= {TARGET_FASTEST}x)")
    return lines


def print_table(rows: list[dict], p2p: list[dict]) -> None:
    for row in p2p:
        print(f"P2P ranks 0 -> 1: {row['bytes'] / 2**20:.2f} MiB at {row['gbps']:.1f} GB/s")
    print("ms per transfer: median of the rounds (min-max); bound = busiest-link bytes at the "
          "measured P2P time")
    header = (f"{'plan':<12} {'b':>1} {'direction':<10} {'strategy':<14} {'runs':<14} "
              f"{'ms':>8} {'min-max':>15} {'MiB':>7} {'bound ms':>9} {'x bound':>8} "
              f"{'x fastest':>9} {'pred ms':>8} {'auto':<14} {'auto pred':>9}")
    print(header + "\n" + "-" * len(header))
    for row in rows:
        spread = f"{min(row['ms_rounds']):.3f}-{max(row['ms_rounds']):.3f}"
        ratio = "n/a" if row["x_bound"] is None else f"{row['x_bound']:.2f}x"
        predicted = "" if row["predicted_ms"] is None else f"{row['predicted_ms']:.3f}"
        auto = ("" if row["auto_predicted_ms"] is None
                else f"{row['auto_predicted_ms']:.3f}")
        print(f"{row['plan']:<12} {row['boundary']:>1} {row['direction']:<10} "
              f"{row['strategy']:<14} {row['runs']:<14} {row['ms']:>8.3f} {spread:>15} "
              f"{row['busiest_bytes'] / 2**20:>7.2f} {row['bound_ms']:>9.3f} {ratio:>8} "
              f"{row['x_fastest']:>8.2f}x {predicted:>8} {row['auto_choice']:<14} {auto:>9}")


def plans_for(asked: list[str] | None, world: int) -> tuple[list[str], str | None]:
    """The plans to run on `world` ranks (`asked`, default every plan of that many), or the
    one error line when a plan does not fit."""
    sizes = {name: sum(len(ranks) for ranks, _ in stages) for name, stages in PLANS.items()}
    names = asked or [name for name, size in sizes.items() if size == world]
    wrong = [f"{name} takes {sizes[name]}" for name in names if sizes[name] != world]
    if not names:
        return names, f"error: no plan of {world} ranks; plans by ranks: {sizes}"
    if wrong:
        return names, (f"error: --plans: {', '.join(wrong)} ranks, this world has {world}; "
                       f"plans by ranks: {sizes}")
    return names, None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # torchrun's contract, read before any process group starts
    names, error = plans_for(args.plans, int(os.environ.get("WORLD_SIZE", "1")))
    if error:
        if os.environ.get("RANK", "0") == "0":
            print(error, file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    p2p = PointToPoint(args, device)
    rows = [row for name in names for row in measure_plan(name, args, device, p2p)]
    gather_wire(rows, args)
    add_ratios(rows)
    if rank == 0:
        print_table(rows, p2p.rows())
        if args.veth is not None:
            print_wire(rows)
        lines = targets(rows)
        print("\n".join(lines))
        run = {"device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                          else "cpu"), "backend": dist.get_backend(), "world": world,
               "shape": [args.seq, args.micro_batch, args.hidden], "dtype": args.dtype,
               "sequence_parallel": args.sequence_parallel, "warmup": args.warmup,
               "iters": args.iters, "rounds": args.rounds, "plans": names,
               "p2p": p2p.rows(), "rows": rows, "targets": lines}
        if args.out:
            with open(args.out, "w") as file:
                json.dump(run, file, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
