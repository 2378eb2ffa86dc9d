"""ZeRO++ vs ZeRO-3 over a slow link between two emulated nodes: one rank of the four that
bench_zero_netns.sh starts in two network namespaces, and the report merging their results.

    sudo bash benchmarks/bench_zero_netns.sh                 # runs both rates, prints the table
    python benchmarks/bench_zero_netns.py worker --rate 100mbit --out DIR
        (env: RANK, WORLD_SIZE=4, MASTER_ADDR, MASTER_PORT, VETH = this namespace's end of the link)
    python benchmarks/bench_zero_netns.py report DIR [--json FILE]

Ranks 0-1 are node A, 2-3 node B (gpus_per_node=2, DP=4). For each configuration the worker
builds a small bf16 GPT under the engine and runs warm-up steps; then the configurations take
`--steps` steps in turn, one each, each timed on its own (wall clock between barriers, rank 0;
the median is reported, as other work on the machine makes single steps noisy). Bytes are counted
twice: logically, the inter-node bytes the engine's CommCounter saw, summed over the 4 ranks; and
on the wire, rank 0's `ip -s link` TX + RX of its veth around each step (every byte that crossed
between the nodes: headers, gloo's own forwarding and the barriers included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from megadomino.distributed import ParallelDims

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import CONFIGS, add_model_args, build_engine, train_step  # noqa: E402


def wire_bytes(veth: str) -> int:
    """TX + RX bytes of `veth` in this namespace, from `ip -s link`."""
    out = subprocess.run(["ip", "-s", "-j", "link", "show", "dev", veth], check=True,
                         capture_output=True, text=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["tx"]["bytes"] + stats["rx"]["bytes"]


def worker(args: argparse.Namespace) -> None:
    """Every configuration's engine side by side, their measured steps interleaved (one step of
    each in turn), so that all see the same load from whatever else runs on the machine."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dims = ParallelDims(tp=1, gpus_per_node=2)
    rank0 = dist.get_rank() == 0
    veth = os.environ["VETH"]
    engines = {name: build_engine(name, dims, args, device="cpu") for name in args.configs}
    for engine in engines.values():
        for step in range(args.warmup):
            train_step(engine, dims, args, step)
        engine.comm.reset()
    seconds = {name: [] for name in engines}
    wire = {name: 0 for name in engines}
    losses = {}
    for step in range(args.warmup, args.warmup + args.steps):
        for name, engine in engines.items():
            dist.barrier()
            wire_before = wire_bytes(veth) if rank0 else 0
            start = time.perf_counter()
            losses[name] = train_step(engine, dims, args, step)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
            wire[name] += wire_bytes(veth) - wire_before if rank0 else 0
    rows = []
    for name, engine in engines.items():
        totals = engine.comm.totals()
        logical = torch.tensor([totals["inter"], totals["intra"]], dtype=torch.float64)
        dist.all_reduce(logical)
        rows.append({"rate": args.rate, "config": name,
                     "s_per_step": statistics.median(seconds[name]), "s_steps": seconds[name],
                     "logical_inter_bytes_per_step": logical[0].item() / args.steps,
                     "logical_intra_bytes_per_step": logical[1].item() / args.steps,
                     "wire_bytes_per_step": wire[name] / args.steps, "last_loss": losses[name],
                     "parameters": sum(u.numel for u in engine.units)})
    if rank0:
        with open(os.path.join(args.out, "results.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def report(args: argparse.Namespace) -> None:
    with open(os.path.join(args.dir, "results.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    baseline = {r["rate"]: r for r in rows if r["config"] == "zero3"}
    print(f"4 CPU ranks as 2 nodes x 2, bf16 GPT of {rows[0]['parameters'] / 1e6:.2f}M parameters;"
          " median s/step; bytes per step, summed over ranks (logical) / crossing the veth (wire)")
    header = (f"{'link':<8} {'config':<18} {'s/step':>8} {'min-max':>13} {'speedup':>8} "
              f"{'logical inter':>14} {'wire':>10} {'wire/logical':>13}")
    print(header + "\n" + "-" * len(header))
    for r in rows:
        base = baseline.get(r["rate"])
        speedup = base["s_per_step"] / r["s_per_step"] if base else float("nan")
        logical = r["logical_inter_bytes_per_step"]
        spread = f"{min(r['s_steps']):.2f}-{max(r['s_steps']):.2f}"
        print(f"{r['rate']:<8} {r['config']:<18} {r['s_per_step']:>8.3f} {spread:>13} "
              f"{speedup:>7.2f}x "
              f"{logical / 1e6:>11.2f} MB {r['wire_bytes_per_step'] / 1e6:>7.2f} MB "
              f"{r['wire_bytes_per_step'] / logical:>13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    run = modes.add_parser("worker")
    add_model_args(run, "gpt-tiny", hidden=256, layers=4, seq=32)
    run.add_argument("--rate", required=True, help="the link's rate, for the record")
    run.add_argument("--out", required=True, help="directory for results.jsonl")
    run.add_argument("--configs", nargs="+", default=["zero3", "zero++"], choices=list(CONFIGS))
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--steps", type=int, default=5)
    merge = modes.add_parser("report")
    merge.add_argument("dir")
    merge.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    worker(args) if args.mode == "worker" else report(args)


if __name__ == "__main__":
    main()
