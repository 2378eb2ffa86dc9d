"""Weight-gradient GEMM into an fp32 accumulation buffer, three ways, on one GPU: what Megatron's
gradient-accumulation fusion would save here.

    python3 benchmarks/bench_wgrad_accumulate.py --out wgrad.json

For each linear of the GPT-3 1.3B and 6.7B layers (tokens = seq 2048 x micro-batch 4) and bf16
operands: (a) `separate`: the bf16 GEMM, then `main_grad.add_(grad)` (what the engine's hook does
today); (b) `addmm_fp32`: `torch.addmm(main_grad, g^T, x, out_dtype=float32, out=main_grad)`, the
GEMM accumulating into the fp32 buffer in its epilogue (None when torch refuses it); (c)
`mm_fp32_add`: an fp32-output GEMM, then an fp32 add. Median ms (CUDA events) and the largest
difference from an fp64 reference, so that speed is not bought with accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import median_ms  # noqa: E402

LINEARS = {"gpt3-1.3b": {"qkv": (6144, 2048), "proj": (2048, 2048), "fc1": (8192, 2048),
                         "fc2": (2048, 8192)},
           "gpt3-6.7b": {"qkv": (12288, 4096), "proj": (4096, 4096), "fc1": (16384, 4096),
                         "fc2": (4096, 16384)}}


def row(out_features: int, in_features: int, tokens: int) -> dict:
    g = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    main = torch.randn(out_features, in_features, device="cuda")
    exact = main.double() + g.double().t() @ x.double()
    ways = {
        "separate": lambda m: m.add_(g.t() @ x),
        "addmm_fp32": lambda m: torch.addmm(m, g.t(), x, out_dtype=torch.float32, out=m),
        "mm_fp32_add": lambda m: m.add_(torch.mm(g.t(), x, out_dtype=torch.float32)),
    }
    result = {}
    for name, way in ways.items():
        buffer = main.clone()
        try:
            way(buffer)
        except (RuntimeError, TypeError) as error:
            result[name] = {"error": str(error).splitlines()[0][:160]}
            continue
        error = ((buffer.double() - exact).abs().max() / exact.abs().max()).item()
        ms = median_ms(lambda way=way, buffer=buffer: way(buffer))
        result[name] = {"ms": ms, "max_rel_error": error}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048 * 4)
    parser.add_argument("--out", default="wgrad.json")
    args = parser.parse_args()
    rows = []
    for model, linears in LINEARS.items():
        for name, (out_features, in_features) in linears.items():
            rows.append({"model": model, "linear": name,
                         **row(out_features, in_features, args.tokens)})
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
