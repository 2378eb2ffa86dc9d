"""FP8 against bf16 on real text, end to end: pretrain_gpt.py twice from the same seed and data
order, bf16 and `--fp8-format hybrid` (both with --compile-layer-pieces), every iteration's loss
compared by the FP8 loss criterion (the mean of the last 50 losses within 1%, no iteration after
the 20th more than 3% apart) and the throughput of the last logged iterations.

    python3 benchmarks/text_corpus.py --out .text          # on a machine with this Python
    python3 benchmarks/bench_fp8_text.py --data .text --iters 200 --out fp8_text.json
    # --fp8-param-gather at ZeRO 1 on 2 GPUs: both arms sharded, the FP8 arm gathers FP8
    python3 benchmarks/bench_fp8_text.py --data .text --nproc-per-node 2 \
        --both=--use-distributed-optimizer --fp8-args="--fp8-format hybrid --fp8-param-gather"

Exit status 1 when the criterion fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
from compare_losses import read_losses  # noqa: E402

MS = re.compile(r"iteration\s+(\d+)/.*?\| ([\d.]+) ms/iter \| ([\d.]+) tokens/s")


def run(args, extra: list[str]) -> tuple[dict[int, float], list[tuple[float, float]], str]:
    data = os.path.abspath(args.data)
    batch = args.micro_batch_size * args.nproc_per_node
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={args.nproc_per_node}",
           "pretrain_gpt.py",
           "--model-preset", args.preset, "--num-layers", str(args.num_layers), "--bf16",
           "--compile-layer-pieces", "--data-path", f"{data}/corpus_text_document",
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
           f"{data}/tok.model", "--split", "100,0,0", "--micro-batch-size",
           str(args.micro_batch_size), "--global-batch-size", str(batch),
           "--seq-length", str(args.seq_length), "--train-iters", str(args.iters), "--lr",
           "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "20", "--log-interval", "1",
           "--eval-iters", "0", "--seed", "1234", *shlex.split(args.both), *extra]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
        raise SystemExit(f"run failed: {' '.join(extra) or 'bf16'}")
    losses = {int(key.split()[1]): value for key, value in read_losses(proc.stdout).items()
              if key.startswith("train")}
    speed = [(float(ms), float(tok)) for _, ms, tok in MS.findall(proc.stdout)]
    return losses, speed, proc.stdout


def criterion(bf16: dict[int, float], fp8: dict[int, float]) -> dict:
    steps = sorted(bf16)
    last = steps[-50:]
    mean_bf16 = statistics.fmean(bf16[i] for i in last)
    mean_fp8 = statistics.fmean(fp8[i] for i in last)
    worst = max(abs(fp8[i] - bf16[i]) / bf16[i] for i in steps if i > 20)
    return {"mean_last50_bf16": mean_bf16, "mean_last50_fp8": mean_fp8,
            "mean_rel_diff": abs(mean_fp8 - mean_bf16) / mean_bf16,
            "worst_step_rel_diff_after_20": worst,
            "passed": abs(mean_fp8 - mean_bf16) / mean_bf16 <= 0.01 and worst <= 0.03}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="text_corpus.py's --out directory")
    parser.add_argument("--preset", default="gpt3-6.7b")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--timeout", type=int, default=400)
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="GPUs (data parallel; the global batch is micro-batch x GPUs)")
    parser.add_argument("--both", default="", help="further flags of both runs, one string")
    parser.add_argument("--fp8-args", default="--fp8-format hybrid",
                        help="the FP8 run's flags, one string")
    parser.add_argument("--out", default="bench_fp8_text.json")
    args = parser.parse_args()
    variants = {"bf16": [], "fp8": shlex.split(args.fp8_args)}
    results = {name: run(args, extra) for name, extra in variants.items()}
    check = criterion(results["bf16"][0], results["fp8"][0])
    speed = {name: {"ms_per_iter": statistics.median(ms for ms, _ in result[1][-20:]),
                    "tokens_per_s": statistics.median(tok for _, tok in result[1][-20:])}
             for name, result in results.items()}
    report = {"args": vars(args), "criterion": check, "speed": speed,
              "losses": {name: result[0] for name, result in results.items()}}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({"criterion": check, "speed": speed}, indent=2))
    return 0 if check["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
