"""Causal SDPA forward + backward per backend (cuDNN, flash, memory-efficient) on one GPU, for the
attention shapes of our presets, as the layer calls it: q, k, v permuted views of the fused QKV
projection's output (s, b, heads, d) -> (b, heads, s, d), not contiguous copies.

    python3 benchmarks/bench_sdpa.py --out sdpa.json

Reports, per shape, backend and dropout, the median ms forward and forward + backward (CUDA
events, after warm-up) and TFLOP/s against the causal FLOPs (QK^T and PV, half the square:
2 * 2 * b * heads * s^2 * d / 2 forward, 2.5 times that backward), so that the backend torch
picks by default can be judged against the others on the same tensors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import median_ms  # noqa: E402

SHAPES = {"gpt3-1.3b": (4, 16, 2048, 128), "gpt3-6.7b": (4, 32, 2048, 128),
          "llama2-7b": (4, 32, 2048, 128)}
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def qkv_views(b: int, heads: int, s: int, d: int) -> list[torch.Tensor]:
    """q, k, v as the layer makes them: views of one (s, b, heads, 3, d) projection output."""
    qkv = torch.randn(s, b, heads, 3, d, device="cuda", dtype=torch.bfloat16)
    return [t.squeeze(3).permute(1, 2, 0, 3).detach().requires_grad_()
            for t in qkv.split(1, dim=3)]


def measure(shape: tuple[int, int, int, int], backend, dropout: float, iters: int) -> dict:
    b, heads, s, d = shape
    q, k, v = qkv_views(b, heads, s, d)
    grad = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)

    def forward():
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)

    def forward_backward():
        forward().backward(grad)

    flops = 2 * 2 * b * heads * s * s * d / 2
    try:
        with torch.no_grad():
            fwd = median_ms(forward, iters)
        both = median_ms(forward_backward, iters)
    except RuntimeError as error:  # the backend cannot serve these tensors
        return {"error": str(error).splitlines()[0][:160]}
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "fwd_tflops": flops / fwd / 1e9,
            "fwd_bwd_tflops": 3.5 * flops / both / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--dropouts", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="sdpa.json")
    args = parser.parse_args()
    rows = []
    for name in args.shapes:
        for dropout in args.dropouts:
            for backend_name, backend in BACKENDS.items():
                row = {"shape": name, "bhsd": SHAPES[name], "dropout": dropout,
                       "backend": backend_name,
                       **measure(SHAPES[name], backend, dropout, args.iters)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
