"""Before / after on one GPU machine: the same benchmarks run from two source trees, alternating,
in one call, so that a change (a restructuring that must not cost speed) is judged against the
run's own spread.

    git archive BEFORE_COMMIT | (mkdir -p .before && tar -x -C .before)     # on your machine
    python3 benchmarks/ab_trees.py --before .before --rounds 3 --out ab.json   # on the GPU one

Each tree runs from its own directory with its own package on PYTHONPATH (`megadomino.kernels`
is linked to the tree's kernels/, as setup.py maps it). Per round, both trees run, the order
alternating, the benchmarks `--benches` names: quant (benchmarks/bench_quant.py, our ops, no
DeepSpeed: fixed groups), pretrain (benchmarks/bench_pretrain.py at TP=1, gpt3-1.3b by
default; `--pp` stages of `--accumulation` micro-batches a step), domino
(benchmarks/bench_domino.py's core layer rows at TP=1: plain TP and Domino 1x1 and 2x1, device
and host ms per layer) and domino-graph (the same under CUDA graphs). The report gives, per row,
each tree's median and range over the rounds and after / before of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def prepare(tree: Path) -> dict:
    """The environment that runs `tree`'s package: PYTHONPATH at it, megadomino.kernels linked."""
    link = tree / "megadomino" / "kernels"
    if not link.exists():
        link.symlink_to(Path("..") / "kernels")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tree.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]))


def run(tree: Path, env: dict, args: list[str], out: Path, timeout: int) -> dict | None:
    """Run benchmark `args` in `tree` writing `out`; its JSON, or None (the error is printed)."""
    command = [sys.executable, *args, "--out", str(out)]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0 or not out.exists():
        print(f"{tree}: {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-2000:]}"
              f"\n{done.stderr[-3000:]}", flush=True)
        return None
    return json.loads(out.read_text())


def quant_rows(result: dict) -> dict[str, float]:
    return {f"{r['op']} g{r['group']} {r.get('dtype', '')} (TB/s)": r["tbps"]
            for r in result["rows"] if r.get("impl") == "ours" and "tbps" in r}


def pretrain_rows(result: dict) -> dict[str, float]:
    rows = {}
    for r in result["rows"]:
        if "error" not in r:
            name = f"pretrain tp{r['tp']}{r.get('variant') or ''}"
            rows[f"{name} (ms/iter)"] = r["ms_per_iter"]
            rows[f"{name} (MFU %)"] = r["mfu_percent"]
    return rows


def domino_rows(result: dict) -> dict[str, float]:
    """Per layer row and column: device and host (enqueue) ms per layer."""
    rows = {}
    graph = " graphed" if result["args"].get("cuda_graph") else ""
    for r in result["results"]:
        for column, ms in r["ms_per_layer"].items():
            rows[f"{r['row']} tp{r['tp']} {column}{graph} (ms/layer)"] = ms
            rows[f"{r['row']} tp{r['tp']} {column}{graph} (host ms/layer)"] = \
                r["host_ms_per_layer"][column]
    return rows


def write_report(samples: dict, args, path: str) -> list[dict]:
    """Per row: each tree's samples, medians, spreads and after / before; written to `path`
    (after every round, so that a call cut short keeps what it measured)."""
    report = []
    for row in samples["after"]:
        before, after = samples["before"].get(row, []), samples["after"][row]
        if not before:
            continue
        report.append({"row": row, "before": before, "after": after,
                       "before_median": statistics.median(before),
                       "after_median": statistics.median(after),
                       "after_over_before": statistics.median(after) / statistics.median(before),
                       "before_spread": (max(before) - min(before)) / statistics.median(before),
                       "after_spread": (max(after) - min(after)) / statistics.median(after)})
    import torch
    Path(path).write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                      "torch": torch.__version__, "args": vars(args),
                                      "rows": report}, indent=1))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the earlier tree (a directory)")
    parser.add_argument("--after", default=".", help="the later tree (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preset", default="gpt3-1.3b")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--num-layers", default=None, help="pretrain: --num-layers")
    parser.add_argument("--pp", default="1", help="pretrain: pipeline stages (GPUs)")
    parser.add_argument("--accumulation", default="1",
                        help="pretrain: micro-batches per step (bench_pretrain.py's)")
    parser.add_argument("--variants", nargs="+", default=[""],
                        help="pretrain: flags per variant, as bench_pretrain.py's --variants")
    parser.add_argument("--groups", nargs="+", default=["256", "2048", "8192"])
    parser.add_argument("--benches", nargs="+", choices=("quant", "pretrain", "domino",
                                                          "domino-graph"),
                        default=["quant", "pretrain"], help="which benchmarks to run")
    parser.add_argument("--out", default="ab_trees.json")
    args = parser.parse_args()
    trees = {"before": Path(args.before), "after": Path(args.after)}
    envs = {name: prepare(tree) for name, tree in trees.items()}
    samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    scratch = Path(tempfile.mkdtemp())
    benches = {
        "quant": (["benchmarks/bench_quant.py", "--no-deepspeed", "--groups", *args.groups],
                  quant_rows, 900),
        "pretrain": (["benchmarks/bench_pretrain.py", "--preset", args.preset, "--tp", "1",
                      "--iters", str(args.iters), "--log-interval", "5", "--micro-batch-size",
                      "4", "--pp", args.pp, "--accumulation", args.accumulation,
                      "--variants", *args.variants,
                      *(["--num-layers", args.num_layers] if args.num_layers else [])],
                     pretrain_rows, 900),
    }
    domino = ["-m", "torch.distributed.run", "--nproc_per_node", "1",
              "benchmarks/bench_domino.py", "--rows", "core", "--plans", "1x1,2x1", "--peers",
              "", "--layers", "4", "--iters", "20"]
    benches["domino"] = (domino, domino_rows, 900)
    benches["domino-graph"] = (domino + ["--cuda-graph"], domino_rows, 900)
    benches = [benches[name] for name in args.benches]
    report = []
    for round_ in range(args.rounds):
        order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
        for bench, rows_of, timeout in benches:
            for name in order:
                out = scratch / f"{name}-{round_}-{Path(bench[0]).stem}.json"
                result = run(trees[name], envs[name], bench, out, timeout)
                for row, value in (rows_of(result) if result else {}).items():
                    samples[name].setdefault(row, []).append(value)
                print(f"round {round_} {name} {Path(bench[0]).stem}: "
                      f"{'ok' if result else 'failed'}", flush=True)
        report = write_report(samples, args, args.out)
    print("| row | before (median, range) | after (median, range) | after / before |")
    print("| --- | --- | --- | --- |")
    for r in report:
        print(f"| {r['row']} | {r['before_median']:.4g} ({min(r['before']):.4g}-"
              f"{max(r['before']):.4g}) | {r['after_median']:.4g} ({min(r['after']):.4g}-"
              f"{max(r['after']):.4g}) | {r['after_over_before']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
