"""One GPU: what cutting a tensor-parallel GEMM along M costs, for the fused-communication
paths of distributed/fused_matmul.py. For each GEMM of a GPT-3 6.7B layer at TP=4 (seq 2048 x
micro-batch 4 = 8192 rows, bf16) it times, CUDA-graphed, median of --iters replays:

  whole        one GEMM over all rows (plain TP + SP);
  4 x 1 stream the rows in 4 chunks (one per rank), back to back;
  4 x 2 streams the same chunks alternating between two streams (what torch's
               fused_all_gather_matmul / fused_matmul_reduce_scatter do);
  1 + 3        the local chunk, then the three remote ones as one GEMM;
  2 + 2        two halves.

    python benchmarks/bench_gemm_chunks.py [--tp 4] [--out gemm_chunks.json]
"""
import argparse
import functools
import json

import torch
from timeline import graphed, median_ms

SHAPES = {  # name: (K, N) at TP=tp for GPT-3 6.7B (hidden 4096, ffn 16384)
    "qkv fwd": lambda tp: (4096, 3 * 4096 // tp),
    "proj fwd": lambda tp: (4096 // tp, 4096),
    "fc1 fwd": lambda tp: (4096, 16384 // tp),
    "fc2 fwd": lambda tp: (16384 // tp, 4096),
    "qkv dgrad": lambda tp: (3 * 4096 // tp, 4096),
    "fc1 dgrad": lambda tp: (16384 // tp, 4096),
    "proj dgrad": lambda tp: (4096, 4096 // tp),
    "fc2 dgrad": lambda tp: (4096, 16384 // tp),
}


def split(a, b, out, streams, sizes, two_streams=False):
    """A function running out = a @ b as GEMMs over consecutive row blocks of `sizes`."""
    def run():
        start = 0
        main = torch.cuda.current_stream()
        streams[1].wait_stream(main)
        for i, size in enumerate(sizes):
            with torch.cuda.stream((main, streams[1])[i % 2] if two_streams else main):
                torch.mm(a[start:start + size], b, out=out[start:start + size])
            start += size
        main.wait_stream(streams[1])
    return run


def graphed_ms(fn, iters: int) -> float:
    """Median ms of fn over `iters` replays of a graph of 10 calls."""
    return median_ms(graphed(lambda: [fn() for _ in range(10)]), iters, warmup=0) / 10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="gemm_chunks.json")
    args = parser.parse_args()
    rows, tp = args.rows, args.tp
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    results = []
    for name, shape in SHAPES.items():
        k, n = shape(tp)
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        chunk = rows // tp

        gemms = functools.partial(split, a, b, out, streams)
        variants = {"whole": gemms([rows]), f"{tp} x 1 stream": gemms([chunk] * tp),
                    f"{tp} x 2 streams": gemms([chunk] * tp, True),
                    f"1 + {tp - 1}": gemms([chunk, rows - chunk]),
                    "2 + 2": gemms([rows // 2, rows // 2])}
        row = {"gemm": name, "m": rows, "k": k, "n": n}
        for label, fn in variants.items():
            ms = graphed_ms(fn, args.iters)
            row[label] = ms
        row["tflops_whole"] = 2 * rows * k * n / row["whole"] / 1e9
        results.append(row)
        print(json.dumps(row), flush=True)
    labels = [key for key in results[0] if key not in ("gemm", "m", "k", "n", "tflops_whole")]
    print(f"\n{torch.cuda.get_device_name()}, TP={tp}, M={rows}, bf16, ms (x whole)\n")
    print("| GEMM | M x K x N | " + " | ".join(labels) + " |")
    print("|" + " --- |" * (len(labels) + 2))
    totals = dict.fromkeys(labels, 0.0)
    for row in results:
        cells = [f"{row[label]:.4f} ({row[label] / row['whole']:.2f})" for label in labels]
        for label in labels:
            totals[label] += row[label]
        print(f"| {row['gemm']} | {row['m']} x {row['k']} x {row['n']} | " + " | ".join(cells)
              + " |")
    print("| sum | | " + " | ".join(f"{totals[label]:.4f} ({totals[label] / totals['whole']:.2f})"
                                   for label in labels) + " |")
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "tp": tp, "rows": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
