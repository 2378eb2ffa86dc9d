"""Byte accounting: what one training step hands to collectives, ZeRO-3 vs ZeRO++, per rank.

    python benchmarks/zero_bytes.py [--hidden-size 256 --num-layers 4 --block-size 2048]
                                    [--out zero_bytes.json]

4 CPU ranks (gloo on localhost) stand in for 2 nodes x 2 GPUs (DP=4, gpus_per_node=2). A small
bf16 GPT runs one warm-up step, then the counters of the engine's `CommCounter` are reset and one
more step is counted: the bytes each rank hands to every collective it issues, split by whether
the receiving peer is on its node (see megadomino/zero/collectives.py), averaged over the ranks.
Rows add qwZ (int8 weights), hpZ and qgZ (int4 gradients; then int8) to ZeRO-3 one at a time.

The paper (arXiv 2306.10209) counts ZeRO-3's cross-node volume as 3M (M = model bytes in fp16:
forward all-gather, backward all-gather, gradient reduce-scatter) and ZeRO++'s as 0.75M (0.5M
int8 forward gather, 0 for the backward gather inside the node, 0.25M int4 gradients). The ratio
printed last must be <= 0.26 (0.25 plus the fp32 block scales).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megadomino.distributed import ParallelDims

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_common import CONFIGS, NOT_DEFAULT, add_model_args, build_engine, train_step  # noqa: E402

TAGS = ("weights forward", "weights backward", "gradients", "scalars")


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    dims = ParallelDims(tp=1, gpus_per_node=2)
    rows = {}
    for name in (c for c in CONFIGS if c not in NOT_DEFAULT):  # variants of the bytes shown
        engine = build_engine(name, dims, args, device="cpu")
        train_step(engine, dims, args, 0)
        engine.comm.reset()
        train_step(engine, dims, args, 1)
        counts = torch.tensor([[engine.comm.bytes[tag][side] for side in ("intra", "inter")]
                               for tag in TAGS], dtype=torch.float64)
        dist.all_reduce(counts)
        counts /= dist.get_world_size()
        rows[name] = {tag: {"intra": int(c[0]), "inter": int(c[1])}
                      for tag, c in zip(TAGS, counts.tolist())}
        model_bytes = sum(u.numel for u in engine.units) * 2
    if rank == 0:
        report(rows, model_bytes, args)
    dist.destroy_process_group()


def report(rows: dict, model_bytes: int, args: argparse.Namespace) -> None:
    baseline = sum(v["inter"] for v in rows["zero3"].values())
    print(f"one step, bytes per rank (mean of 4), 2 nodes x 2, bf16 GPT of {model_bytes / 2:.3g} "
          f"parameters (M = {model_bytes / 1e6:.2f} MB in bf16), block {args.block_size}")
    header = (f"{'config':<18} {'fwd gather':>11} {'bwd gather':>11} {'gradients':>11} "
              f"{'inter total':>12} {'intra total':>12} {'inter / M':>10} {'vs ZeRO-3':>10}")
    print(header + "\n" + "-" * len(header))
    for name, row in rows.items():
        inter = sum(v["inter"] for v in row.values())
        intra = sum(v["intra"] for v in row.values())
        print(f"{name:<18} " + " ".join(f"{row[tag]['inter'] / 1e6:>9.3f}MB" for tag in TAGS[:3])
              + f" {inter / 1e6:>10.3f}MB {intra / 1e6:>10.3f}MB {inter / model_bytes:>10.3f}"
              f" {inter / baseline:>10.3f}")
    print("(columns 2-4: inter-node bytes; 'scalars', the grad-norm all-reduce, is in the totals)")
    for name in ("zero++", "zero++ int8 grads"):
        ratio = sum(v["inter"] for v in rows[name].values()) / baseline
        print(f"{name}: inter-node bytes per step = {ratio:.4f} x ZeRO-3's")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model_bytes_bf16": model_bytes, "block_size": args.block_size,
                       "bytes_per_rank": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, "gpt-tiny", hidden=256, layers=4, seq=64)
    parser.add_argument("--out", default=None, help="write the counts as JSON here")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(worker, args=(port, args), nprocs=4, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
