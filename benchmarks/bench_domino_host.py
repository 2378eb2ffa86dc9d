"""Host cost of Domino's executor on CPU: a proxy for bench_layer_tp1.py's `domino_2x1` host
column (the wall time to enqueue one layer's forward + backward), measured where no GPU is.
The layer runs at tiny shapes on the CPU (fp32, one thread), so its arithmetic is small and the
time is mostly the Python, autograd and dispatch work a GPU run spends enqueueing (GPT-3 6.7B
and Llama-2 7B layer structure, dropout 0, TP = 1: host work does not depend on the TP degree).

    python benchmarks/bench_domino_host.py --out host.json
    python benchmarks/bench_domino_host.py --tree before=/path/to/older/checkout --tree after=. \
        --out host.json

Variants: `plain` (the layers one after the other) and `domino_2x1` (DominoPlan(2, 1,
explicit_backward=True), bench_layer_tp1's column); `--compiled` adds both with
--compile-layer-pieces. Per row and variant, per layer: the median wall ms of forward +
backward, the same relative to `plain` (the steps of all variants alternate within one process,
so a loaded machine slows them alike: the ratio is the figure to compare across trees), and,
counted in one step, the `torch.autograd.grad` and `torch.autograd.backward` calls, the custom
autograd Functions applied, the aten operators dispatched (a GPU run launches a kernel for most
of those that compute) and the calls of the layer's element-wise pieces (with
--compile-layer-pieces each is a compiled call, forward and backward). With `--tree NAME=PATH`
each tree runs in its own subprocess with its megadomino imported from PATH, the trees
alternating over `--rounds`; a figure is the median over rounds, and each tree's ratio to plain
is compared with the first tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = {"gpt": "gpt3-6.7b", "llama": "llama2-7b"}
SHAPES = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
              seq_length=8, max_position_embeddings=8, hidden_dropout=0.0,
              attention_dropout=0.0, params_dtype="float32")
MICRO_BATCH = 2
COUNTS = ("autograd_grad", "autograd_backward", "function_apply", "aten_ops", "pieces")


def counted_step(step, layers: int) -> dict:
    """One step under counters, per layer: autograd entry points, Function applies, aten ops,
    and calls of the layer's element-wise pieces (models.elementwise: each is one compiled call,
    forward and backward, with --compile-layer-pieces)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megadomino.models import elementwise

    counts = dict.fromkeys(COUNTS, 0)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["aten_ops"] += 1
            return func(*args, **(kwargs or {}))

    grad, backward = torch.autograd.grad, torch.autograd.backward
    apply = torch.autograd.Function.apply.__func__

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    torch.autograd.grad = counted("autograd_grad", grad)
    torch.autograd.backward = counted("autograd_backward", backward)
    torch.autograd.Function.apply = classmethod(counted("function_apply", apply))
    pieces = vars(elementwise.EAGER).copy()
    for name, fn in pieces.items():
        setattr(elementwise.EAGER, name, counted("pieces", fn))
    try:
        with Ops():
            step()
    finally:
        torch.autograd.grad, torch.autograd.backward = grad, backward
        torch.autograd.Function.apply = classmethod(apply)
        vars(elementwise.EAGER).update(pieces)
    return {name: value / layers for name, value in counts.items()}


def make_steps(row: str, compiled: bool) -> dict:
    """variant -> a function running one forward + backward of the row's layer stack."""
    import torch

    from megadomino.config import DominoPlan, ModelConfig, ParallelConfig
    from megadomino.distributed import ParallelDims
    from megadomino.distributed.random import model_parallel_seed
    from megadomino.models.blocks import rotary_tables
    from megadomino.models.transformer import TransformerBlock
    from megadomino.overlap.domino.schedule import DominoRunner

    dims = ParallelDims(tp=1)
    config = ModelConfig.preset(ROWS[row], **SHAPES)
    rotary = None
    if config.position_embedding_type == "rope":
        cos, sin = rotary_tables(config.seq_length, config.kv_channels, config.rotary_base)
        rotary = (cos[:, None, None, :], sin[:, None, None, :])
    gen = torch.Generator().manual_seed(1)
    shape = (config.seq_length, MICRO_BATCH, config.hidden_size)
    x = torch.randn(shape, generator=gen).requires_grad_()
    grad_out = torch.randn(shape, generator=gen)
    variants = {"plain": {}, "domino_2x1": dict(domino=DominoPlan(2, 1, explicit_backward=True))}
    if compiled:
        variants.update({f"{name}_compiled": dict(fields, compile_layer_pieces=True)
                         for name, fields in list(variants.items())})
    steps = {}
    for name, fields in variants.items():
        model_parallel_seed(1, dims)
        block = TransformerBlock(config, dims, ParallelConfig(**fields))
        runner = DominoRunner(block, block.parallel.domino) if "domino" in fields else None
        params = [p for p in block.parameters() if p.requires_grad]

        def step(block=block, runner=runner, params=params):
            for p in params:
                p.grad = None
            x.grad = None
            out = block.run(x, rotary) if runner is None else runner(x, rotary)
            out.backward(grad_out)
        steps[name] = step
    return steps


def worker(args) -> dict:
    """Measure every row and variant in this process (megadomino from --worker-tree)."""
    sys.path.insert(0, os.path.abspath(args.worker_tree))
    import torch

    import megadomino

    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():  # one rank, in process: no address to agree on
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
    layers = SHAPES["num_layers"]
    result = {"megadomino": os.path.dirname(megadomino.__file__), "torch": torch.__version__,
              "rows": {}}
    for row in ROWS:
        steps = make_steps(row, args.compiled)
        wall: dict[str, list[float]] = {name: [] for name in steps}
        for n in range(args.warmup + args.iters):
            for name, step in steps.items():  # alternate: each variant sees the same load
                begin = time.perf_counter()
                step()
                if n >= args.warmup:
                    wall[name].append((time.perf_counter() - begin) * 1e3 / layers)
        entries = {}
        for name, step in steps.items():
            plain = "plain_compiled" if name.endswith("_compiled") else "plain"
            ratios = [w / p for w, p in zip(wall[name], wall[plain])]
            entries[name] = {"host_ms_per_layer": statistics.median(wall[name]),
                             "vs_plain": statistics.median(ratios),
                             **counted_step(step, layers)}
        result["rows"][row] = entries
    return result


def run_trees(args) -> dict:
    """Alternate the trees' worker subprocesses over the rounds; medians per tree."""
    trees = dict(spec.split("=", 1) for spec in args.tree)
    rounds: dict[str, list] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, path in trees.items():
            command = [sys.executable, os.path.abspath(__file__), "--worker-tree", path,
                       "--iters", str(args.iters), "--warmup", str(args.warmup)]
            if args.compiled:
                command.append("--compiled")
            done = subprocess.run(command, capture_output=True, text=True, check=True,
                                  timeout=args.timeout)
            rounds[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    for name, results in rounds.items():
        rows = {row: {variant: {key: statistics.median(r["rows"][row][variant][key]
                                                       for r in results)
                                for key in entry}
                      for variant, entry in variants.items()}
                for row, variants in results[0]["rows"].items()}
        summary[name] = {"megadomino": results[0]["megadomino"], "rows": rows,
                         "rounds_vs_plain": [{row: {v: e["vs_plain"] for v, e in vs.items()}
                                              for row, vs in r["rows"].items()}
                                             for r in results]}
    return summary


def table(summary: dict) -> str:
    first = next(iter(summary))
    lines = ["| tree | row | variant | wall ms/layer | vs plain | autograd.grad | "
             f"Function.apply | aten ops | pieces | vs plain, / {first}'s |",
             "|" + " --- |" * 10]
    for name, tree in summary.items():
        for row, variants in tree["rows"].items():
            for variant, entry in variants.items():
                base = summary[first]["rows"][row][variant]["vs_plain"]
                lines.append(
                    f"| {name} | {row} | {variant} | {entry['host_ms_per_layer']:.3f} "
                    f"| {entry['vs_plain']:.2f} | {entry['autograd_grad']:.1f} "
                    f"| {entry['function_apply']:.1f} | {entry['aten_ops']:.0f} "
                    f"| {entry['pieces']:.0f} | {entry['vs_plain'] / base:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=PATH of a checkout to measure (repeatable; default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--compiled", action="store_true",
                        help="also the variants with --compile-layer-pieces (needs a compiler)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    parser.add_argument("--worker-tree", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker_tree:
        print(json.dumps(worker(args)), flush=True)
        return
    if not args.tree:
        args.tree = [f"this={os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}"]
    summary = run_trees(args)
    print(table(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "shapes": dict(SHAPES, micro_batch=MICRO_BATCH),
                       "trees": summary}, f, indent=2)


if __name__ == "__main__":
    main()
