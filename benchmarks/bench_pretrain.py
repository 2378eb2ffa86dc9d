"""End-to-end pretrain throughput on the GPU machine: pretrain_gpt.py / pretrain_llama.py runs at
several TP degrees, one after the other, parsed from their log lines.

    python benchmarks/bench_pretrain.py --preset gpt3-1.3b --tp 1 2 4 --iters 20 \
        --micro-batch-size 4 --out bench_pretrain.json [--sequence-parallel] [--num-layers N]

Each run uses TP x DP GPUs (`--dp`, default 1: rows then differ only in the TP degree; the
global batch is micro-batch x accumulation x DP). The reported numbers are
the last log interval's (after warm-up): ms/iter, tokens/s, TFLOP/s per GPU (Megatron's formula),
MFU against 989 TFLOP/s, and peak allocated memory per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import torch

LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| loss (\S+) \| lr \S+ \| global batch \d+ \| "
                  r"grad norm \S+ \| "
                  r"([\d.]+) ms/iter \| ([\d.]+) tokens/s \| ([\d.]+) TFLOP/s/GPU \| "
                  r"MFU ([\d.]+)% \| peak mem ([\d.]+) GiB")


def run(args, tp: int, sequence_parallel: bool, variant: str) -> dict:
    script = "pretrain_llama.py" if args.preset.startswith("llama") else "pretrain_gpt.py"
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={tp * args.dp}", script,
           "--model-preset", args.preset, "--tensor-model-parallel-size", str(tp),
           "--bf16", "--mock-data", "--micro-batch-size", str(args.micro_batch_size),
           "--global-batch-size", str(args.micro_batch_size * args.accumulation * args.dp),
           "--train-iters", str(args.iters), "--lr", "1e-4", "--lr-warmup-iters", "2",
           "--log-interval", str(args.log_interval), "--eval-interval", "100000",
           "--eval-iters", "1", "--seq-length", str(args.seq_length), "--peak-tflops", "989"]
    if args.num_layers:
        cmd += ["--num-layers", str(args.num_layers)]
    if sequence_parallel:
        cmd.append("--sequence-parallel")
    cmd += variant.split()
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    matches = LINE.findall(proc.stdout)
    if proc.returncode != 0 or not matches:
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
        return {"tp": tp, "sequence_parallel": sequence_parallel, "variant": variant,
                "error": proc.returncode}
    it, total, loss, ms, tokens, tflops, mfu, mem = matches[-1]
    first_loss = float(matches[0][2])
    return {"tp": tp, "sequence_parallel": sequence_parallel, "variant": variant,
            "iteration": int(it),
            "first_logged_loss": first_loss, "loss": float(loss), "ms_per_iter": float(ms),
            "tokens_per_s": float(tokens), "tflops_per_gpu": float(tflops),
            "mfu_percent": float(mfu), "peak_mem_gib": float(mem)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt3-1.3b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size of every run")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="also run each TP > 1 with --sequence-parallel")
    parser.add_argument("--variants", nargs="+", default=[""],
                        help="extra flags per variant, e.g. '' '--domino-batch-slices 2'")
    parser.add_argument("--out", default="bench_pretrain.json")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    rows = []
    for tp in args.tp:
        if tp * args.dp > gpus:
            print(f"skip tp={tp} x dp={args.dp}: only {gpus} GPUs", flush=True)
            continue
        for variant in args.variants:
            rows.append(run(args, tp, False, variant))
            print("row:", json.dumps(rows[-1]), flush=True)
            if args.sequence_parallel and tp > 1:
                rows.append(run(args, tp, True, variant))
                print("row:", json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    result = {"device": device, "gpus": gpus, "torch": torch.__version__, "args": vars(args),
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{args.preset}, seq {args.seq_length}, micro-batch {args.micro_batch_size}, "
          f"DP {args.dp}, bf16, {device}")
    print("| TP | SP | variant | ms/iter | tokens/s | TFLOP/s/GPU | MFU | peak GiB | "
          "loss first->last |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['tp']} | {r['sequence_parallel']} | {r['variant']} | "
                  f"failed ({r['error']}) |")
            continue
        print(f"| {r['tp']} | {r['sequence_parallel']} | {r['variant'] or '-'} | "
              f"{r['ms_per_iter']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {r['tflops_per_gpu']:.1f} | {r['mfu_percent']:.1f}% | "
              f"{r['peak_mem_gib']:.1f} | {r['first_logged_loss']:.2f}->{r['loss']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
