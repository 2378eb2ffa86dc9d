"""The pipeline boundary codecs' own cost (megadomino/pipeline/codec.py), on one device, in one
run: int8 and int4 encode and decode against the copy bandwidth measured beside them, and
adatopk's top-k selection and packing against the int8 codec's time.

    python benchmarks/bench_codec.py --out bench_codec.json          # GPU: gpt3-1.3b boundary
    python benchmarks/bench_codec.py --seq 64 --micro-batch 2 --hidden 256   # CPU, small

The default shape is gpt3-1.3b's boundary at micro-batch 4: (2048, 4, 2048) bf16. Bandwidth
counts the bytes an op reads and writes: encode reads the activation and writes the message,
decode the reverse; copy is x.clone() (read + write of the activation). Top-k, at each
--densities: `select` selects and packs each row's k entries of largest magnitude into int16
indices and values, once by per-row torch.topk of |x| and a gather (the baseline,
`row_topk_reference`) and once by the Triton kernel (`row_topk`: exact radix select per row,
kernels/row_topk.py; GPU only), each also as a ratio to the int8 encode; `encode` is the codec's
whole adatopk encode (its select is the kernel on a GPU, torch.topk on a CPU). On a GPU each
time is timeline.queued_ms's (calls queued behind a GPU spin: the GPU's time); on a CPU the
median of timed loops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megadomino.kernels.row_topk import row_topk, row_topk_reference  # noqa: E402
from megadomino.pipeline.codec import Format, Setting, decode, encode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import queued_ms  # noqa: E402


def timed_ms(fn, device: torch.device, iters: int) -> float:
    """fn's milliseconds a call: queued_ms on a GPU, else the median of `iters` timed calls."""
    if device.type == "cuda":
        return queued_ms(lambda _: fn(), calls=10, iters=iters)
    fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure(seq: int, micro_batch: int, hidden: int, dtype: torch.dtype,
            densities: list[float], iters: int, device: torch.device) -> dict:
    """Every row of the module docstring, with its bytes and its share of the copy bandwidth."""
    torch.manual_seed(0)
    x = torch.randn(seq, micro_batch, hidden, dtype=dtype, device=device)
    fmt = Format(seq * micro_batch, hidden, dtype)
    dense = x.numel() * x.element_size()
    copy_ms = timed_ms(lambda: x.clone(), device, iters)
    copy_gbps = 2 * dense / copy_ms / 1e6
    rows = [{"op": "copy", "ms": copy_ms, "bytes": 2 * dense, "gbps": copy_gbps}]
    out = torch.empty_like(x)
    for codec in ("int8", "int4"):
        setting = Setting(codec)
        wire, _ = encode(x, setting, fmt, "F")
        moved = dense + wire.numel()
        for op, fn in (("encode", lambda s=setting: encode(x, s, fmt, "F")),
                       ("decode", lambda w=wire, s=setting: decode(w, s, fmt, "F", out))):
            ms = timed_ms(fn, device, iters)
            rows.append({"op": f"{codec} {op}", "ms": ms, "bytes": moved,
                         "gbps": moved / ms / 1e6, "of_copy": moved / ms / 1e6 / copy_gbps})
    int8_ms = next(r["ms"] for r in rows if r["op"] == "int8 encode")
    for density in densities:
        rows += _topk_rows(x, fmt, fmt.k_of(density), density, int8_ms, iters)
    return {"shape": [seq, micro_batch, hidden], "dtype": str(dtype), "device": str(device),
            "rows": rows}


def _topk_rows(x: torch.Tensor, fmt: Format, k: int, density: float, int8_ms: float,
               iters: int) -> list[dict]:
    """adatopk at k: the select and pack by torch.topk and by the radix kernel (on a GPU) into
    the same int16 indices and values, then the codec's encode; ms and the ratio to int8's."""
    flat = x.view(fmt.rows, fmt.hidden)
    indices = torch.empty((fmt.rows, k), dtype=torch.int16, device=x.device)
    values = torch.empty((fmt.rows, k), dtype=x.dtype, device=x.device)
    ops = [("select (torch.topk)",
            lambda: row_topk_reference(flat, k, indices=indices, values=values))]
    if x.is_cuda:
        ops.append(("select (radix kernel)",
                    lambda: row_topk(flat, k, indices=indices, values=values)))
    ops.append(("encode", lambda: encode(x, Setting("adatopk", k), fmt, "F")))
    rows = []
    for op, fn in ops:
        ms = timed_ms(fn, x.device, iters)
        rows.append({"op": f"adatopk {op} d={density:g}", "k": k, "ms": ms,
                     "of_int8_encode": ms / int8_ms})
    return rows


def table(result: dict) -> str:
    lines = [f"{result['shape']} {result['dtype']} on {result['device']}",
             "| op | ms | GB/s | of copy | of int8 encode |", "| --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        gbps = f"{row['gbps']:.1f}" if "gbps" in row else ""
        of_copy = f"{row['of_copy']:.2f}" if "of_copy" in row else ""
        of_int8 = f"{row['of_int8_encode']:.2f}x" if "of_int8_encode" in row else ""
        lines.append(f"| {row['op']} | {row['ms']:.3f} | {gbps} | {of_copy} | {of_int8} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05, 0.1])
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    result = measure(args.seq, args.micro_batch, args.hidden, dtype, args.densities,
                     args.iters, device)
    print(table(result))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)
    return result


if __name__ == "__main__":
    main()
