"""Where an FP8 linear's time goes, role by role, beside bf16 (one GPU): the cases
`--fp8-linears auto` times at start-up (megadomino/train/fp8_linears.py: role_case), each
timed as auto times it and then profiled, so that a role's FP8 time can be split into the GPU's
work and the host's.

    python3 benchmarks/bench_fp8_linear.py --preset gpt3-1.3b --micro-batch-size 4 \
        --micro-batches 4 --out fp8_linear.json

For every role (qkv, proj, fc1, fc2 at TP = 1: M = micro-batch x seq tokens) and variant
(bf16's F.linear; FP8 hybrid with delayed scaling, eager and with the compiled pieces' casts;
tensorwise with them), one forward + backward (dx and dW) costs, per call:

    wall_ms      time_step's mean over a pass (the device synchronized around it), the median
                 of --rounds passes: what auto compares
    gpu_busy_ms  the kernels' busy time in one profiled pass (timeline.profile_summary)
    gpu_events   kernels, copies and sets launched
    top_host_ops the host's top operations by self time (ms per call, calls per call)

A call whose wall_ms is well above its gpu_busy_ms is the host's: its launches, not its GEMMs,
set the pace. The weight is cast once per --micro-batches calls, as a step reuses it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megadomino.config import FP8Recipe, ModelConfig  # noqa: E402
from megadomino.config.train import FP8_ROLES  # noqa: E402
from megadomino.overlap.domino.autotune import time_step  # noqa: E402
from megadomino.tp.fp8 import FP8State  # noqa: E402
from megadomino.train.fp8_linears import calls_per_cast, role_case, role_shapes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import profile_summary  # noqa: E402

VARIANTS = {"bf16": (None, False),
            "fp8 delayed eager": (FP8Recipe("hybrid", "delayed"), False),
            "fp8 delayed compiled": (FP8Recipe("hybrid", "delayed"), True),
            "fp8 tensorwise compiled": (FP8Recipe("hybrid", "tensorwise"), True)}


def measure(case, per_step: int, rounds: int) -> dict:
    """One case's wall ms per call (median of `rounds` passes) and its profiled pass."""
    linear, x, grad, iters = case
    walls = [time_step(linear, x, grad, None, per_step, iters) for _ in range(rounds)]
    profile = profile_summary(lambda: time_step(linear, x, grad, None, 0, iters), top=8,
                              host=True)
    per_call = {name: [round(ms / iters, 4), round(count / iters, 2)]
                for name, (ms, count) in profile["top_host_ops"].items()}
    return {"wall_ms": statistics.median(walls), "walls_ms": walls,
            "gpu_busy_ms": profile["compute_busy_ms"] / iters,
            "gpu_events": profile["gpu_events"] / iters, "top_host_ops": per_call,
            "top_kernels": profile["top_kernels"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt3-1.3b")
    parser.add_argument("--micro-batch-size", type=int, nargs="+", default=[4])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="a step's micro-batches: the weight is cast once per this many calls")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_linear.py needs CUDA")
    device = torch.device("cuda", 0)
    model = ModelConfig.preset(args.preset, seq_length=args.seq_length)
    per_step = calls_per_cast(args.micro_batches)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "args": vars(args), "rows": []}
    for micro_batch in args.micro_batch_size:
        shapes = role_shapes(model, 1, micro_batch * args.seq_length)
        for role in FP8_ROLES:
            for name, (recipe, compiled) in VARIANTS.items():
                generator = torch.Generator(device=device).manual_seed(1234)
                case = role_case(shapes[role], torch.bfloat16, device, recipe,
                                 lambda r=recipe, c=compiled: FP8State(r, device, None, c),
                                 per_step, generator)
                row = {"micro_batch": micro_batch, "role": role, "shape": shapes[role],
                       "variant": name, **measure(case, per_step, args.rounds)}
                result["rows"].append(row)
                print(f"mb {micro_batch} {role:<5} {str(shapes[role]):<22} {name:<24} "
                      f"wall {row['wall_ms']:.3f} ms, GPU busy {row['gpu_busy_ms']:.3f} ms, "
                      f"{row['gpu_events']:.1f} launches", flush=True)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
