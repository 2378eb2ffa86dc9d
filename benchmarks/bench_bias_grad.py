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
import statistics

import torch

from megadomino.kernels.bias_grad import gelu_bias_backward

SHAPES = {"gpt3-1.3b": (2048, 16, 128), "gpt3-6.7b": (4096, 32, 128)}  # hidden, heads, head dim


def qkv_floor(dq, dk, dv):
    return torch.cat([dq, dk, dv], dim=3)


def qkv_sum(dq, dk, dv):
    dqkv = torch.cat([dq, dk, dv], dim=3)
    return dqkv, dqkv.sum((0, 1)).flatten()


def _gelu_grad(g, h, b):
    x = (h + b).float()
    k = 0.7978845608028654
    u = k * (x + 0.044715 * x * x * x)
    t = torch.tanh(u)
    return (g.float() * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x))
            ).to(g.dtype)


def gelu_floor(g, h, b):
    return _gelu_grad(g, h, b)


def gelu_sum(g, h, b):
    dh = _gelu_grad(g, h, b)
    return dh, dh.sum((0, 1))


def gelu_ours(g, h, b):
    width = h.shape[-1]
    return gelu_bias_backward(g.reshape(-1, width), h.reshape(-1, width), b)


def time_ms(fn, args, iters: int, calls: int = 20) -> float:
    """Median over `iters` of the mean of `calls` back-to-back calls (the GPU's time, not the
    host's: a compiled call's guards take longer than these kernels)."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # queue the calls behind a spin: the host runs ahead
        start.record()
        for _ in range(calls):
            fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


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
        g, h = (torch.randn(s, b, 4 * hidden, device=device, dtype=dtype) for _ in range(2))
        bias = torch.randn(4 * hidden, device=device, dtype=dtype)
        reference = qkv_sum(dq, dk, dv)[1].float()
        for label, fn, inputs, ref in (
                ("qkv floor", qkv_floor, (dq, dk, dv), None),
                ("qkv sum over s, b", qkv_sum, (dq, dk, dv), reference),
                ("gelu floor", gelu_floor, (g, h, bias), None),
                ("gelu sum over s, b", gelu_sum, (g, h, bias), None),
                ("gelu ours (Triton)", gelu_ours, (g, h, bias), None)):
            compiled = fn if fn is gelu_ours else torch.compile(fn, dynamic=False)
            ms = time_ms(compiled, inputs, args.iters)
            row = {"shape": name, "variant": label, "compiled_ms": round(ms, 4),
                   "eager_ms": round(time_ms(fn, inputs, args.iters), 4)}
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
