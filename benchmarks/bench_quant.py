"""Quantization kernels (kernels/block_*.py) against DeepSpeed 0.19.8's CUDA quantizer and
the copy bandwidth, on one GPU, in one run.

    python benchmarks/bench_quant.py --out bench_quant.json [--sweep]

DeepSpeed is optional (its column reads "-" without it): install the wheels carried in .whl/
with `pip install --no-index --no-deps --target /tmp/dsw .whl/*.whl` and run with
PYTHONPATH=/tmp/dsw; the script sets TORCH_CUDA_ARCH_LIST=9.0 for the JIT build of its
quantizer ops (about a minute).

128M elements (256 MB of fp16) per op; groups (= our blocks) of 256, 2048 and 8192. Bandwidth
counts the bytes an op must read and write (data and scales); dequantize-reduce-quantize also in
input bytes read, as GPU.md reports DeepSpeed's. Each time is the median over repeats of the mean
of back-to-back calls queued behind a GPU sleep (so launch overhead is not timed), inputs
rotating between two random buffers. Every number is also a fraction of the copy bandwidth
(x.clone) measured in the same run. --sweep also times other tile shapes (--tiles) for our ops,
to tune the default (passed as Variant(tile=...)); --ops limits the run to some ops. (The kernel
paths that `Variant` chooses were picked by A/B runs of this script; their numbers are in
benchmarks/reports/2026-11-22-zeropp-quantization-kernels.md.)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megadomino import kernels as quant  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import queued_ms  # noqa: E402

TILES = [(4096, 2), (4096, 4), (8192, 4), (8192, 16), (16384, 8), (16384, 16),
         (32768, 16)]  # --sweep's; the default is quant_launch.default_tile


def load_deepspeed():
    """DeepSpeed's quantizer ops, or (None, reason)."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if not arch or "a" in arch:  # its builder cannot parse "9.0a"
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    try:
        import deepspeed
        from deepspeed.ops.op_builder import QuantizerBuilder

        return QuantizerBuilder().load(), deepspeed.__version__
    except Exception as error:  # report and go on without the column
        return None, f"DeepSpeed not available: {type(error).__name__}: {error}"


class Bench:
    def __init__(self, numel: int, ds, ops: list[str] | None = None):
        self.numel = numel
        self.ds = ds
        self.ops = ops  # record only ops starting with one of these (None: all)
        gen = torch.Generator(device="cuda").manual_seed(0)
        base = [torch.randn(numel, device="cuda", generator=gen) for _ in range(2)]
        self.x = {"fp16": [b.half() for b in base], "bf16": [b.bfloat16() for b in base]}
        del base
        self.rows: list[dict] = []
        self.copy_tbps = self.bandwidth(lambda i: self.x["fp16"][i % 2].clone(), 4 * numel)

    def bandwidth(self, fn, nbytes: float) -> float:
        return nbytes / queued_ms(fn) / 1e9  # TB/s

    def record(self, op: str, impl: str, group: int, dtype: str, fn, nbytes: float,
               input_bytes: float | None = None, **extra) -> None:
        if self.ops and not any(op.startswith(prefix) for prefix in self.ops):
            return
        row = {"op": op, "impl": impl, "group": group, "dtype": dtype, **extra}
        try:
            ms = queued_ms(fn)
            row.update(ms=ms, tbps=nbytes / ms / 1e9, fraction_of_copy=nbytes / ms / 1e9
                       / self.copy_tbps)
            if input_bytes is not None:
                row["input_tbps"] = input_bytes / ms / 1e9
        except Exception as error:  # one failing row must not cost the run
            row["error"] = f"{type(error).__name__}: {error}"
        print(json.dumps(row), flush=True)
        self.rows.append(row)

    def ours(self, group: int, dtypes=("fp16", "bf16"), impl: str = "ours",
             full_range: bool = False, variant: quant.Variant | None = None) -> None:
        """Our ops; `full_range`: quantizing with DeepSpeed's levels (kernels'
        full_range=True; the dequantize rows are then the same kernel as without); `variant`:
        every op's (the sweep's tiles; default: the measured best)."""
        n = self.numel
        variant = variant or quant.Variant()
        quantize, swizzled_quantize, dequantize_reduce_quantize = (
            functools.partial(quant.quantize, full_range=full_range, variant=variant),
            functools.partial(quant.swizzled_quantize, full_range=full_range, variant=variant),
            functools.partial(quant.dequantize_reduce_quantize, full_range=full_range,
                              variant=variant))
        dequantize = functools.partial(quant.dequantize, variant=variant)
        scale_bytes = 4 * n / group
        for dtype in dtypes:
            xs = self.x[dtype]
            for bits in (8, 4):
                q_bytes = n * bits / 8
                self.record(f"quantize int{bits}", impl, group, dtype,
                            lambda i, xs=xs, b=bits: quantize(xs[i % 2], b, group),
                            2 * n + q_bytes + scale_bytes)
                qs = [quantize(x, bits, group) for x in xs]
                self.record(f"dequantize int{bits}", impl, group, dtype,
                            lambda i, qs=qs, b=bits, d=xs[0].dtype: dequantize(
                                *qs[i % 2], n, b, group, d), q_bytes + scale_bytes + 2 * n)
            self.record("swizzled quantize int4 (2x4)", impl, group, dtype,
                        lambda i, xs=xs: swizzled_quantize(xs[i % 2], 4, group, 2, 4),
                        2 * n + n / 2 + scale_bytes)
        for bits in (4, 8):  # 4 intra-node inputs of 2 partitions: qgZ step 3 on 2 x 4 ranks
            qs = [swizzled_quantize(x, bits, group, 2, 4) for x in self.x["fp16"]]
            read = n * bits / 8 + scale_bytes
            self.record(f"dequant-reduce-quant int{bits} (4 inputs)", impl, group, "fp16",
                        lambda i, qs=qs, b=bits: dequantize_reduce_quantize(
                            *qs[i % 2], 4, b, b, group, n // 8), read * 1.25, read)

    def deepspeed(self, group: int) -> None:
        ds, n, groups = self.ds, self.numel, self.numel // group
        sym = ds.Symmetric
        scale_bytes = 4 * n / group
        xs = self.x["fp16"]
        for bits in (8, 4):
            q_bytes = n * bits / 8
            self.record(f"quantize int{bits}", "deepspeed", group, "fp16",
                        lambda i, b=bits: ds.quantize(xs[i % 2], groups, b, sym),
                        2 * n + q_bytes + scale_bytes)
            qs = [ds.quantize(x, groups, bits, sym) for x in xs]
            self.record(f"dequantize int{bits}", "deepspeed", group, "fp16",
                        lambda i, qs=qs, b=bits: ds.dequantize(*qs[i % 2], groups, b, sym),
                        q_bytes + scale_bytes + 2 * n)
        self.record("swizzled quantize int4 (2x4)", "deepspeed", group, "fp16",
                    lambda i: ds.swizzle_quant(xs[i % 2], groups, 4, sym, 1, 2, 4),
                    2 * n + n / 2 + scale_bytes)
        for bits in (4, 8):
            qs = [ds.swizzle_quant(x, groups, bits, sym, 1, 2, 4) for x in xs]
            read = n * bits / 8 + scale_bytes
            self.record(f"dequant-reduce-quant int{bits} (4 inputs)", "deepspeed", group,
                        "fp16", lambda i, qs=qs, b=bits: ds.quantized_reduction(
                            *qs[i % 2], groups, groups // 4, b, sym, 4), read * 1.25, read)

    def errors(self, group: int) -> None:
        """Relative L2 error of dequantize(quantize(x)), fp16 input, ours and DeepSpeed's; ours
        must equal the torch reference bit for bit (checked on the first 4M elements)."""
        x = self.x["fp16"][0]
        x64 = x.double()
        for bits in (8, 4):
            q, s = quant.quantize(x, bits, group)
            ours = (quant.dequantize(q, s, self.numel, bits, group).double() - x64).norm()
            head = 2**22
            q_ref, s_ref = quant.quantize_reference(x[:head].cpu(), bits, group)
            q_head = q[: head if bits == 8 else head // 2].cpu()
            row = {"op": f"relative error int{bits}", "group": group,
                   "ours": (ours / x64.norm()).item(),
                   "ours_equals_reference": torch.equal(q_head, q_ref)
                   and torch.equal(s[: head // group].cpu(), s_ref)}
            q, s = quant.quantize(x, bits, group, full_range=True)  # DeepSpeed's levels
            full = (quant.dequantize(q, s, self.numel, bits, group).double() - x64).norm()
            q_ref, s_ref = quant.quantize_reference(x[:head].cpu(), bits, group, True)
            row["ours_full_range"] = (full / x64.norm()).item()
            row["full_range_equals_reference"] = (
                torch.equal(q[: head if bits == 8 else head // 2].cpu(), q_ref)
                and torch.equal(s[: head // group].cpu(), s_ref))
            if self.ds is not None:
                groups = self.numel // group
                q_ds, s_ds = self.ds.quantize(x, groups, bits, self.ds.Symmetric)
                deq = self.ds.dequantize(q_ds, s_ds, groups, bits, self.ds.Symmetric)
                row["deepspeed"] = ((deq.double() - x64).norm() / x64.norm()).item()
            print(json.dumps(row), flush=True)
            self.rows.append(row)

    def sweep(self, group: int, dtypes=("fp16",), tiles=TILES) -> None:
        """Every op of ours (`dtypes`) again at other (elements per program, warps) tiles,
        passed to the public entry points as Variant(tile=...), which times them."""
        for tile in tiles:
            self.ours(group, dtypes=dtypes, impl=f"ours tile {tile}",
                      variant=quant.Variant(tile=tile))


def find(rows, op, impl, group, dtype="fp16", key="tbps"):
    for row in rows:
        if (row.get("op"), row.get("impl"), row.get("group"), row.get("dtype")) == (
                op, impl, group, dtype) and key in row:
            return row[key]
    return None


def targets(rows: list[dict], copy_tbps: float, groups: list[int]) -> list[dict]:
    """The kernels' targets (against DeepSpeed's quantizer and the copy rate), each with the
    numbers it was judged on."""
    checks = []

    def check(name, ok, **numbers):
        checks.append({"target": name, "met": ok, **numbers})

    for group in groups:
        for op in ("quantize int8", "quantize int4", "dequantize int8", "dequantize int4"):
            ours, ds = find(rows, op, "ours", group), find(rows, op, "deepspeed", group)
            need = max(0.95 * ds if ds else 0.0, 0.8 * copy_tbps)
            check(f"{op} g{group} >= max(0.95x DeepSpeed, 0.8x copy)",
                  ours is not None and ours >= need, ours=ours, deepspeed=ds, need=need)
        for op in ("quantize int8", "quantize int4", "dequantize int8", "dequantize int4",
                   "swizzled quantize int4 (2x4)"):
            fp16, bf16 = find(rows, op, "ours", group), find(rows, op, "ours", group, "bf16")
            check(f"{op} g{group} bf16 >= 0.95x fp16", None not in (fp16, bf16)
                  and bf16 >= 0.95 * fp16, fp16=fp16, bf16=bf16)
        for op, key in (("quantize int8", "tbps"), ("quantize int4", "tbps"),
                        ("dequant-reduce-quant int4 (4 inputs)", "input_tbps"),
                        ("dequant-reduce-quant int8 (4 inputs)", "input_tbps")):
            if op.startswith("quantize") and group != 256:
                continue
            ours, ds = find(rows, op, "ours", group, key=key), find(rows, op, "deepspeed",
                                                                    group, key=key)
            if ds is not None:
                check(f"{op} g{group} >= 2x DeepSpeed", ours is not None and ours >= 2 * ds,
                      ours=ours, deepspeed=ds)
    for row in rows:
        if row.get("op", "").startswith("relative error") and "deepspeed" in row:
            check(f"{row['op']} g{row['group']} <= DeepSpeed's",
                  row["ours"] <= row["deepspeed"] * 1.0001, ours=row["ours"],
                  deepspeed=row["deepspeed"])
            if "ours_full_range" in row:
                check(f"{row['op']} g{row['group']} full range <= DeepSpeed's",
                      row["ours_full_range"] <= row["deepspeed"] * 1.0001,
                      ours=row["ours_full_range"], deepspeed=row["deepspeed"])
    return checks


def table(rows: list[dict], copy_tbps: float, groups: list[int]) -> str:
    timed = [r for r in rows if "tbps" in r]
    main_rows = [r for r in timed if not r["impl"].startswith("ours tile")]
    keys = sorted({(r["op"], r["impl"], r["dtype"]) for r in main_rows},
                  key=lambda k: (k[0], k[2], k[1]))
    lines = [f"copy (x.clone): {copy_tbps:.2f} TB/s (read + write)", "",
             "| op | impl | dtype | " + " | ".join(f"g{g} TB/s (x copy)" for g in groups) + " |",
             "| --- | --- | --- |" + " --- |" * len(groups)]
    for op, impl, dtype in keys:
        cells = []
        for group in groups:
            row = next((r for r in main_rows if (r["op"], r["impl"], r["dtype"], r["group"])
                        == (op, impl, dtype, group)), None)
            cell = "-" if row is None else f"{row['tbps']:.2f} ({row['fraction_of_copy']:.2f})"
            if row is not None and "input_tbps" in row:
                cell += f", in {row['input_tbps']:.2f}"
            cells.append(cell)
        lines.append(f"| {op} | {impl} | {dtype} | " + " | ".join(cells) + " |")
    for r in rows:
        if r.get("op", "").startswith("relative error"):
            lines.append(f"{r['op']} g{r['group']}: ours {r['ours']:.5f}, DeepSpeed "
                         f"{r.get('deepspeed', float('nan')):.5f}, ours == torch reference: "
                         f"{r['ours_equals_reference']}; full range "
                         f"{r.get('ours_full_range', float('nan')):.5f} (== reference: "
                         f"{r.get('full_range_equals_reference')})")
    for r in rows:
        if "error" in r:
            lines.append(f"FAILED {r['op']} {r['impl']} g{r['group']} {r['dtype']}: {r['error']}")
    swept = [r for r in timed if r["impl"].startswith("ours tile")]
    for op, group, dtype in sorted({(r["op"], r["group"], r["dtype"]) for r in swept}):
        best = max((r for r in swept if (r["op"], r["group"], r["dtype"]) == (op, group, dtype)),
                   key=lambda r: r["tbps"])
        default = find(rows, op, "ours", group, dtype)
        lines.append(f"sweep {op} g{group} {dtype}: best {best['impl'][5:]} {best['tbps']:.2f} "
                     f"TB/s, default {default if default is None else round(default, 2)} TB/s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=2**27)
    parser.add_argument("--groups", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also time other tile shapes")
    parser.add_argument("--sweep-dtypes", nargs="+", default=["fp16"], choices=["fp16", "bf16"])
    parser.add_argument("--tiles", nargs="+", metavar="ELEMENTSxWARPS",
                        help="--sweep's tiles, e.g. 8192x8 (default: "
                        + " ".join(f"{e}x{w}" for e, w in TILES) + ")")
    parser.add_argument("--ops", nargs="+", metavar="PREFIX",
                        help="time only ops starting with one of these, e.g. 'quantize int4'")
    parser.add_argument("--full-range", action="store_true",
                        help="also time our quantizing ops with full_range=True (DeepSpeed's "
                             "levels), rows 'ours full range'")
    parser.add_argument("--out", default="bench_quant.json")
    args = parser.parse_args()
    if args.numel % (8 * max(args.groups)):
        parser.error("--numel must be a multiple of 8 x the largest group")
    ds, ds_note = (None, "skipped (--no-deepspeed)") if args.no_deepspeed else load_deepspeed()
    print(f"DeepSpeed: {ds_note if ds is None else ds_note + ' loaded'}", flush=True)
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles] if args.tiles else TILES
    bench = Bench(args.numel, ds, args.ops)
    for group in args.groups:
        bench.ours(group)
        if args.full_range:
            bench.ours(group, impl="ours full range", full_range=True)
        if ds is not None:
            bench.deepspeed(group)
        if not args.ops:
            bench.errors(group)
        if args.sweep:
            bench.sweep(group, tuple(args.sweep_dtypes), tiles)
    import triton

    checks = targets(bench.rows, bench.copy_tbps, args.groups)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "deepspeed": ds_note, "numel": args.numel,
              "copy_tbps": bench.copy_tbps, "rows": bench.rows, "targets": checks}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    for c in checks:
        print(("MET    " if c["met"] else "MISSED ") + c["target"] + "  " + json.dumps(
            {k: round(v, 4) if isinstance(v, float) else v for k, v in c.items()
             if k not in ("target", "met")}))
    print(f"\n{result['device']}, torch {torch.__version__}, triton {triton.__version__}, "
          f"DeepSpeed: {ds_note}; {args.numel} elements; JSON: {args.out}\n")
    print(table(bench.rows, bench.copy_tbps, args.groups))


if __name__ == "__main__":
    main()
