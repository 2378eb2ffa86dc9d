"""What a bias gradient (a column sum over the tokens) costs beside the pass that writes the
gradient it sums: the QKV split's backward (elementwise.qkv_grad: dq, dk, dv assembled into the
interleaved layout) and GELU's backward with fc1's bias, at the GPT-3 1.3B and 6.7B layer shapes
(seq 2048, micro-batch 4, bf16).

Per shape, side by side in one run, median ms per call: the pass alone compiled by torch.compile
(no bias: the floor), the pass with the sum compiled (torch.compile emits the sum as a kernel of
its own, reading the gradient again), and, for GELU, our Triton kernel that sums as it writes
(kernels/bias_grad.py, what --compile-layer-pieces runs).

    python3 benchmarks/bench_bias_grad.py --out bias_grad.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from megadomino.kernels.bias_grad import gelu_bias_backward, gelu_bias_backward_reference
from megadomino.models import elementwise

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import queued_ms  # noqa: E402

SHAPES = {"gpt3-1.3b": (2048, 16, 128), "gpt3-6.7b": (4096, 32, 128)}  # hidden, heads, head dim


def qkv_floor(dq, dk, dv):
    return elementwise.qkv_grad(dq, dk, dv, bias=False)[0]


def qkv_sum(dq, dk, dv):
    return elementwise.qkv_grad(dq, dk, dv, bias=True)


def gelu_floor(g, h, b):
    return gelu_bias_backward_reference(g, h, b)[0]  # the sum unused: compiled away


def gelu_sum(g, h, b):
    return gelu_bias_backward_reference(g, h, b)


def gelu_ours(g, h, b):
    return gelu_bias_backward(g, h, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default="bias_grad.json")
    args = parser.parse_args()
    device, dtype, s, b = torch.device("cuda"), torch.bfloat16, 2048, 4
    rows = []
    for name, (hidden, heads, d) in SHAPES.items():
        # SDPA's gradients as the layer sees them: (b, heads, s, d) memory, viewed (s, b, g, 1, d)
        dq, dk, dv = (torch.randn(b, heads, s, d, device=device, dtype=dtype)
                      .permute(2, 0, 1, 3).unsqueeze(3) for _ in range(3))
        g, h = (torch.randn(s * b, 4 * hidden, device=device, dtype=dtype) for _ in range(2))
        bias = torch.randn(4 * hidden, device=device, dtype=dtype)
        reference = qkv_sum(dq, dk, dv)[1].float()
        for label, fn, inputs, ref in (
                ("qkv floor", qkv_floor, (dq, dk, dv), None),
                ("qkv sum over s, b", qkv_sum, (dq, dk, dv), reference),
                ("gelu floor", gelu_floor, (g, h, bias), None),
                ("gelu sum over s, b", gelu_sum, (g, h, bias), None),
                ("gelu ours (Triton)", gelu_ours, (g, h, bias), None)):
            compiled = fn if fn is gelu_ours else torch.compile(fn, dynamic=False)
            ms = queued_ms(lambda _, f=compiled, a=inputs: f(*a), iters=args.iters)
            row = {"shape": name, "variant": label, "compiled_ms": round(ms, 4),
                   "eager_ms": round(queued_ms(lambda _, f=fn, a=inputs: f(*a),
                                               iters=args.iters), 4)}
            if ref is not None:
                got = compiled(*inputs)[1].float()
                row["max_rel_error"] = float((got - ref).abs().max() / ref.abs().max())
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
