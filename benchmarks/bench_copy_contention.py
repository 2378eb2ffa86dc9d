"""Do NVLink copy-engine transfers slow the GEMMs they overlap? (The question behind (f)'s chunk
GEMMs running 17% longer than whole GEMMs inside the fused TP path; the answer is in
benchmarks/reports/2026-11-22-tp-comm-overlap-h200.md.)

Each rank times a GPT-3 6.7B layer's 8 TP GEMMs (TP = --tp shapes, 8192 rows, bf16) on its
compute stream, CUDA events, median of --iters:
  alone        nothing else running;
  + p2p pulls  a side stream keeps pulling 16 MB chunks from the next rank's symmetric-memory
               buffer (cudaMemcpyAsync from peer memory: copy engines, as torch's fused ops do);
  + local copy the side stream keeps copying 16 MB chunks inside this GPU instead;
and how many bytes the side stream moved meanwhile.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_copy_contention.py [--tp 4]
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from bench_gemm_chunks import SHAPES

CHUNK = 16 << 20  # bytes per copy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=4, help="GEMM shapes of this TP degree")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--out", default="copy_contention.json")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group_name)
    buffer = symm_mem.empty(8 * CHUNK, dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buffer, group_name)
    peer = handle.get_buffer((rank + 1) % world, (8 * CHUNK,), torch.uint8)
    local_src = torch.empty(8 * CHUNK, dtype=torch.uint8, device="cuda")
    dst = torch.empty(8 * CHUNK, dtype=torch.uint8, device="cuda")
    gemms = []
    for shape in SHAPES.values():
        k, n = shape(args.tp)
        gemms.append((torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16),
                      torch.randn(k, n, device="cuda", dtype=torch.bfloat16)))
    side = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()

    def layer():
        for a, b in gemms:
            torch.mm(a, b)

    def run(source):
        """ms of the GEMMs, GB/s the side stream moved while they ran (median)."""
        times, rates = [], []
        for _ in range(args.iters):
            dist.barrier()
            torch.cuda.synchronize()
            copies = 0
            if source is not None:  # enough copies queued to outlast the GEMMs
                side_start = torch.cuda.Event(enable_timing=True)
                side_end = torch.cuda.Event(enable_timing=True)
                side_start.record(side)
                with torch.cuda.stream(side):
                    for i in range(48 if source is peer else 256):
                        offset = (i % 8) * CHUNK
                        dst[offset:offset + CHUNK].copy_(source[offset:offset + CHUNK])
                        copies += 1
                side_end.record(side)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(main_stream)
            layer()
            end.record(main_stream)
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            if source is not None:
                rates.append(copies * CHUNK / side_start.elapsed_time(side_end) / 1e6)
        times.sort()
        return times[len(times) // 2], (sorted(rates)[len(rates) // 2] if rates else None)

    layer()
    run(None)
    result = {"device": torch.cuda.get_device_name(), "world": world, "tp_shapes": args.tp}
    for name, source in (("alone", None), ("p2p pulls", peer), ("local copy", local_src)):
        ms, gbps = run(source)
        result[name] = {"gemm_ms": ms, "side_gbps": gbps}
    if rank == 0:
        alone = result["alone"]["gemm_ms"]
        print(json.dumps(result))
        for name in ("alone", "p2p pulls", "local copy"):
            row = result[name]
            extra = f", side stream {row['side_gbps']:.0f} GB/s" if row["side_gbps"] else ""
            print(f"{name:>11}: GEMMs {row['gemm_ms']:.3f} ms (x{row['gemm_ms'] / alone:.3f})"
                  f"{extra}")
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
