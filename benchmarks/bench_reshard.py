"""Cross-mesh resharding microbenchmarks (arXiv 2211.05322, Alpa's benchmark/alpa/resharding
suite, scaled to CPU) over emulated hosts: each strategy's and solver's time against its bound,
bytes on the most loaded link / its rate.

    sudo bash benchmarks/bench_reshard_netns.sh                 # every case, 400 Mbit/s links
    python benchmarks/bench_reshard.py plan                     # the plans' link bytes only

Cases: `1-to-m/...` move one replicated tensor from one rank on host A to every rank of
1-3 hosts x 2 ranks (Alpa's perf_1_to_m_suite, 16 MiB); `1-to-m/2x2` is the headline (A -> B B
C C, 64 MiB).
`n-to-m/caseK` are Alpa's perf_n_to_m_suite cases with each (hosts, ranks) mesh of (2, 4)
scaled to (2, 2) and the tensor to 16 MiB; mesh axis 0 is the host. Every host's uplink and
downlink are limited to the same rate (tbf: no added latency). Modes: `plan` prints the plans,
`hosts CASE` the host index of each rank, `cases` the case names, `worker` is one rank (started
by the netns script), `report DIR` merges the ranks' rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megadomino.pipeline.reshard import STRATEGIES, Layout, Mesh, make_plan
from megadomino.pipeline.reshard.layout import box_shape
from megadomino.pipeline.reshard.solvers import solver_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reshard_runner import GroupCache, Reshard  # noqa: E402
from reshard_solvers import solvers  # noqa: E402

MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    """src_hosts / dst_hosts: one letter per rank (its host); meshes row-major, axis 0 the
    host; dims: per tensor dim the mesh axes splitting it."""

    src_hosts: str
    dst_hosts: str
    src_shape: tuple[int, ...]
    dst_shape: tuple[int, ...]
    shape: tuple[int, ...]
    src_dims: tuple[tuple[int, ...], ...]
    dst_dims: tuple[tuple[int, ...], ...]

    def layouts(self) -> tuple[Layout, Layout]:
        n_src = len(self.src_hosts)
        src = Mesh(tuple(range(n_src)), tuple(self.src_hosts), self.src_shape)
        dst = Mesh(tuple(range(n_src, n_src + len(self.dst_hosts))), tuple(self.dst_hosts),
                   self.dst_shape)
        return Layout(src, self.src_dims), Layout(dst, self.dst_dims)

    def host_index(self) -> list[int]:
        """Host index of every rank (hosts lettered A, B, ...)."""
        return [ord(letter) - ord("A") for letter in self.src_hosts + self.dst_hosts]


ONE = (16 * MIB,)  # 64 MiB of fp32: the headline
SMALL = (4 * MIB,)  # 16 MiB, the other 1-to-m cases
NM = (256, 256, 64)  # 16 MiB of fp32
R1 = ((),)
R3, D0, D1, D2 = ((), (), ()), ((0,), (), ()), ((), (0,), ()), ((), (), (0,))
CASES = {
    "1-to-m/1x2": Case("A", "BB", (1,), (2,), SMALL, R1, R1),
    "1-to-m/2x2": Case("A", "BBCC", (1,), (2, 2), ONE, R1, R1),
    "1-to-m/3x2": Case("A", "BBCCDD", (1,), (3, 2), SMALL, R1, R1),
    "n-to-m/case1": Case("AABB", "CCDD", (2, 2), (2, 2), NM, D0, D0),
    "n-to-m/case2": Case("AABB", "CCDD", (2, 2), (2, 2), NM, R3, D0),
    "n-to-m/case3": Case("AABB", "CCDD", (2, 2), (2, 2), NM, D1, D0),
    "n-to-m/case4": Case("AABB", "CCDD", (2, 2), (2, 2), NM, ((), (0, 1), ()), ((0, 1), (), ())),
    "n-to-m/case5": Case("AABB", "CCDD", (2, 2), (2, 2), NM, ((1,), (), ()), D0),
    "n-to-m/case6": Case("AABB", "CCDDEE", (2, 2), (3, 2), (384, 256, 43), D0, D0),
    "n-to-m/case7": Case("AA", "BBCC", (1, 2), (2, 2), NM, ((1,), (), ()), R3),
    "n-to-m/case9": Case("AABB", "CCDD", (2, 2), (2, 2), NM, D1, D2),
}


def configs(case: Case, rate: float) -> dict[tuple[str, ...], object]:
    """(strategy, solver, ...) -> plan, one entry per distinct plan: solvers that choose the
    same senders and order share it (the key names all of them)."""
    src, dst = case.layouts()
    found: dict = {}
    for strategy in STRATEGIES:
        for solver in solvers():
            plan = make_plan(case.shape, torch.float32, src, dst, strategy, solver, chunks=32,
                             rates={host: rate for host in case.src_hosts + case.dst_hosts})
            name = solver_name(solver)
            for key, other in found.items():
                if key[0] == strategy and other.steps == plan.steps:
                    del found[key]
                    found[key + (name,)] = other
                    break
            else:
                found[(strategy, name)] = plan
    return found


def wire(veth: str) -> tuple[int, int]:
    """(tx, rx) bytes of this namespace's `veth`."""
    stats = f"/sys/class/net/{veth}/statistics"
    return tuple(int(open(f"{stats}/{way}_bytes").read()) for way in ("tx", "rx"))


def worker(args: argparse.Namespace) -> None:
    """One rank: every distinct plan of the case built on every rank (the broadcast groups are
    collective), one warm-up run each, then `repeats` rounds running each plan in turn, so that
    all see the same load from whatever else runs on the machine."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                            rank=args.rank, world_size=args.world)
    case = CASES[args.case]
    rank = args.rank
    hosts = case.host_index()
    reads_wire = hosts.index(hosts[rank]) == rank  # the first rank of its host
    plans = configs(case, args.rate_mbit * 1e6 / 8)
    groups = GroupCache()
    transports = {key: Reshard(plan, groups) for key, plan in plans.items()}
    src, _ = case.layouts()
    local = (torch.ones(box_shape(src.tile(case.shape, rank))) if rank in src.mesh.ranks
             else None)
    seconds = {key: [] for key in plans}
    wire_bytes = {key: [0, 0] for key in plans}
    for repeat in range(-1, args.repeats):
        for key, transport in transports.items():
            dist.barrier()
            before = wire(args.veth) if reads_wire else (0, 0)
            start = time.perf_counter()
            transport.run(local)
            dist.barrier()
            if repeat >= 0:
                seconds[key].append(time.perf_counter() - start)
                after = wire(args.veth) if reads_wire else (0, 0)
                for way in (0, 1):
                    wire_bytes[key][way] += after[way] - before[way]
    rows = [None] * args.world
    dist.all_gather_object(rows, {"host": hosts[rank], "wire": wire_bytes} if reads_wire else {})
    if rank == 0:
        write_rows(args, case, plans, seconds, [row for row in rows if row])
    dist.destroy_process_group()


def write_rows(args, case: Case, plans: dict, seconds: dict, wire_rows: list[dict]) -> None:
    """One JSON line per distinct plan: times, bound, the cost model's prediction for gloo
    (reshard/cost.py: latency 0, as the links add none), the plan's link bytes and the wire
    bytes per run that each host's veth counted (uplink: its tx; downlink: its rx)."""
    with open(os.path.join(args.out, "results.jsonl"), "a") as out:
        for key, plan in plans.items():
            measured = {}
            for row in wire_rows:
                host = chr(ord("A") + row["host"])
                tx, rx = row["wire"][key]
                measured |= {f"up {host}": tx // args.repeats, f"down {host}": rx // args.repeats}
            out.write(json.dumps({
                "case": args.case, "strategy": key[0], "solvers": list(key[1:]),
                "rate_mbit": args.rate_mbit, "tensor_bytes": 4 * torch.Size(case.shape).numel(),
                "seconds": seconds[key], "median_s": statistics.median(seconds[key]),
                "bound_s": plan.makespan(), "predicted_s": plan.predicted_time(),
                "exact": plan.exact,
                "link_bytes": {f"{way} {host}": n for (way, host), n in
                               sorted(plan.link_bytes().items()) if way != "local"},
                "wire_bytes": measured,
            }) + "\n")


def plan_mode(args: argparse.Namespace) -> None:
    for name, case in CASES.items():
        for key, plan in configs(case, args.rate_mbit * 1e6 / 8).items():
            busiest = max(plan.link_bytes().items(), key=lambda item: item[1]
                          if item[0][0] != "local" else -1)
            print(f"{name:<13} {key[0]:<20} {'/'.join(key[1:]):<40} bound "
                  f"{plan.makespan():6.3f} s  predicted (gloo) {plan.predicted_time():6.3f} s  "
                  f"busiest {busiest[0]} {busiest[1] / MIB:.1f} MiB")


def report(args: argparse.Namespace) -> None:
    """The table, and the targets: on the headline case the chained broadcast within 1.25x of
    its bound and at least 3x faster than send/recv; on every case no solver slower than no
    balancing (same strategy)."""
    with open(os.path.join(args.dir, "results.jsonl")) as file:
        rows = [json.loads(line) for line in file]
    print("median s of the runs (min-max); bound = bytes on the most loaded link / its rate")
    header = (f"{'case':<13} {'strategy':<20} {'solvers':<36} {'median s':>9} {'min-max':>12} "
              f"{'bound s':>8} {'x bound':>8} {'vs send_recv':>12}")
    print(header + "\n" + "-" * len(header))
    for row in rows:
        peer = next(r for r in rows if r["case"] == row["case"] and r["strategy"] == "send_recv"
                    and "none" in r["solvers"])
        spread = f"{min(row['seconds']):.2f}-{max(row['seconds']):.2f}"
        print(f"{row['case']:<13} {row['strategy']:<20} {'/'.join(row['solvers']):<36} "
              f"{row['median_s']:>9.3f} {spread:>12} {row['bound_s']:>8.3f} "
              f"{row['median_s'] / row['bound_s']:>7.2f}x "
              f"{peer['median_s'] / row['median_s']:>11.2f}x")
    for line in check_targets(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


def check_targets(rows: list[dict]) -> list[str]:
    lines = []
    head = [r for r in rows if r["case"] == "1-to-m/2x2"]
    if head:
        chain = next(r for r in head if r["strategy"] == "chained_broadcast")
        send = next(r for r in head if r["strategy"] == "send_recv")
        lines.append(f"headline: chained broadcast {chain['median_s'] / chain['bound_s']:.2f}x "
                     f"its bound (target <= 1.25x), {send['median_s'] / chain['median_s']:.2f}x "
                     "faster than send/recv (target >= 3x)")
    for row in rows:
        plain = next(r for r in rows if r["case"] == row["case"]
                     and r["strategy"] == row["strategy"] and "none" in r["solvers"])
        if row["median_s"] > plain["median_s"]:
            lines.append(f"slower than no balancing: {row['case']} {row['strategy']} "
                         f"{'/'.join(row['solvers'])}: {row['median_s']:.3f} s > "
                         f"{plain['median_s']:.3f} s (bounds {row['bound_s']:.3f} / "
                         f"{plain['bound_s']:.3f} s)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    modes.add_parser("cases")
    hosts = modes.add_parser("hosts")
    hosts.add_argument("case", choices=list(CASES))
    plan = modes.add_parser("plan")
    plan.add_argument("--rate-mbit", type=float, default=400.0)
    run = modes.add_parser("worker")
    run.add_argument("--case", choices=list(CASES), required=True)
    run.add_argument("--rank", type=int, required=True)
    run.add_argument("--world", type=int, required=True)
    run.add_argument("--master", required=True, help="rank 0's address")
    run.add_argument("--port", type=int, required=True)
    run.add_argument("--veth", required=True, help="this namespace's end of its link")
    run.add_argument("--rate-mbit", type=float, required=True, help="every link's rate")
    run.add_argument("--repeats", type=int, default=5)
    run.add_argument("--out", required=True, help="directory for results.jsonl")
    merge = modes.add_parser("report")
    merge.add_argument("dir")
    merge.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.mode == "cases":
        print(" ".join(CASES))
    elif args.mode == "hosts":
        print(" ".join(map(str, CASES[args.case].host_index())))
    else:
        {"plan": plan_mode, "worker": worker, "report": report}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
