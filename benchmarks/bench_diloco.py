"""The report of benchmarks/bench_diloco_netns.sh (DiLoCo across a slow link, issue 43): reads
rank 0's log of each run and prints the table and the targets.

    python3 benchmarks/bench_diloco.py report OUT_DIR [--json FILE]

Runs (OUT_DIR/NAME.log, pretrain_gpt.py's log lines): `plain` (plain DP over the limited link,
a few iterations: its step time), `plain-unshaped-I` (plain DP over the unlimited link, I
iterations: the reference loss of every DiLoCo run of I iterations), `nocomm` (DiLoCo whose
first outer step would come after the run: the same ranks and data, nothing crossing the link,
the no-communication limit) and
`diloco-hH-DTYPE` (DiLoCo, H inner steps, pseudo-gradients sent as DTYPE). Throughput is the
`run ended` line's tokens/s (training time only); the loss is the final validation loss, every
run evaluated on the same batches after the same tokens: a DiLoCo run of I iterations against
plain DP's run of I iterations, whose learning-rate schedule (warm-up and decay over the run) is
the same. A DiLoCo run that ended (`run ended`) had every outer step's replica checksums equal: a
difference stops the run with an error.

The spread: each run's tokens/s over consecutive blocks of BLOCK iterations (the log windows
within a block averaged by time; the largest H, so that a DiLoCo block holds one outer step),
median and range over the blocks after the first (start-up), beside the run's whole mean.

Targets (issue 43): plain DP at most 25% of the limit with its all-reduce at least 3x an inner
step (the link is slow for this model); DiLoCo at the largest H at least 90% of the limit, over
at least 20 outer steps; its final loss within 2% of plain DP's over the unshaped link.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ENDED = re.compile(r"run ended: iterations? (?:\d+-)?(\d+) of (\d+) in [\d.]+ s, ([\d.]+) "
                   r"tokens/s(?:.*validation loss ([\d.E+-]+))?")
WINDOW = re.compile(r"iteration +(\d+)/ *\d+ \|.*?\| ([\d.]+) tokens/s")
INTER = re.compile(r"per iteration: ([\d.]+) MB intra-node, ([\d.]+) MB inter-node")
RUN = re.compile(r"diloco-h(\d+)-(\w+)")
BLOCK = 50  # iterations a throughput block


def blocks(windows: list[tuple[int, float]], block: int = BLOCK) -> list[float]:
    """tokens/s of each whole block of `block` iterations after the first, from the log
    windows' (last iteration, tokens/s): the harmonic mean of the windows ending in it (equal
    windows: the block's tokens over its time)."""
    end = max((iteration for iteration, _ in windows), default=0)
    grouped: dict[int, list[float]] = {}
    for iteration, rate in windows:
        grouped.setdefault((iteration - 1) // block, []).append(rate)
    return [len(rates) / sum(1 / rate for rate in rates)
            for index, rates in sorted(grouped.items()) if 0 < index and (index + 1) * block <= end]


def read_run(path: Path) -> dict:
    """What rank 0's log says of one run: iterations, tokens/s, final validation loss (None
    without evaluation), MB per iteration across nodes (mean of its log lines)."""
    text = path.read_text(errors="replace")
    ended = ENDED.search(text)
    if ended is None:
        raise SystemExit(f"{path}: no 'run ended' line (the run failed or was cut short)")
    inter = [float(match.group(2)) for match in INTER.finditer(text)]
    spread = sorted(blocks([(int(m.group(1)), float(m.group(2))) for m in WINDOW.finditer(text)]))
    return {"iterations": int(ended.group(1)), "tokens_per_s": float(ended.group(3)),
            "valid_loss": float(ended.group(4)) if ended.group(4) else None,
            "inter_mb_per_iter": sum(inter) / len(inter) if inter else 0.0,
            "block_tokens_per_s": {"median": spread[len(spread) // 2], "min": spread[0],
                                   "max": spread[-1], "blocks": len(spread)} if spread else None}


def report(out_dir: Path) -> dict:
    """Every run of OUT_DIR, and the targets."""
    runs = {path.stem: read_run(path) for path in sorted(out_dir.glob("*.log"))
            if "-rank" not in path.stem}
    for needed in ("plain", "nocomm"):
        if needed not in runs:
            raise SystemExit(f"{out_dir}: no {needed}.log")
    limit = runs["nocomm"]["tokens_per_s"]
    for name, run in runs.items():
        run["of_limit"] = run["tokens_per_s"] / limit
        match = RUN.fullmatch(name)
        if match:
            run["inner_steps"], run["dtype"] = int(match.group(1)), match.group(2)
            run["outer_steps"] = run["iterations"] // run["inner_steps"]
            reference = runs.get(f"plain-unshaped-{run['iterations']}", {}).get("valid_loss")
            if reference is None:
                raise SystemExit(f"{out_dir}: no evaluated plain-unshaped-{run['iterations']}"
                                 f".log, the reference of {name}")
            run["loss_vs_plain"] = run["valid_loss"] / reference - 1
    diloco = {name: run for name, run in runs.items() if "inner_steps" in run}
    if not diloco:
        raise SystemExit(f"{out_dir}: no diloco-hH-DTYPE.log")
    largest = max(run["inner_steps"] for run in diloco.values())
    at_largest = [run for run in diloco.values() if run["inner_steps"] == largest]
    plain = runs["plain"]
    # one plain step = one inner step's compute + the all-reduce; the limit's step is compute
    all_reduce_vs_step = limit / plain["tokens_per_s"] - 1
    targets = {
        "plain DP <= 25% of the limit": plain["of_limit"] <= 0.25,
        "plain DP's all-reduce >= 3x an inner step": all_reduce_vs_step >= 3,
        f"DiLoCo H={largest} >= 90% of the limit": all(r["of_limit"] >= 0.9 for r in at_largest),
        f"DiLoCo H={largest}: >= 20 outer steps": all(r["outer_steps"] >= 20 for r in at_largest),
        "DiLoCo's final loss within 2% of plain DP's (unshaped)":
            all(abs(r["loss_vs_plain"]) <= 0.02 for r in diloco.values()),
    }
    return {"runs": runs, "all_reduce_vs_inner_step": all_reduce_vs_step, "targets": targets}


def table(result: dict) -> str:
    lines = [f"| run | iterations | tokens/s | of the limit | {BLOCK}-iteration blocks: median "
             "(range) | MB/iter across | outer steps | final loss | vs plain DP |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in result["runs"].items():
        loss = "-" if run["valid_loss"] is None else f"{run['valid_loss']:.4f}"
        versus = f"{100 * run['loss_vs_plain']:+.2f}%" if "loss_vs_plain" in run else "-"
        spread = run["block_tokens_per_s"]
        spread = "-" if spread is None else (f"{spread['median']:.0f} ({spread['min']:.0f}-"
                                             f"{spread['max']:.0f}, {spread['blocks']})")
        lines.append(f"| {name} | {run['iterations']} | {run['tokens_per_s']:.0f} | "
                     f"{100 * run['of_limit']:.1f}% | {spread} | {run['inter_mb_per_iter']:.3f} | "
                     f"{run.get('outer_steps', '-')} | {loss} | {versus} |")
    lines.append(f"\nplain DP's all-reduce: {result['all_reduce_vs_inner_step']:.1f}x an inner "
                 "step; every DiLoCo run ended, so every outer step's checksums were equal")
    lines += [f"{'met' if met else 'MISSED'}: {target}"
              for target, met in result["targets"].items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    read = modes.add_parser("report")
    read.add_argument("out_dir", type=Path)
    read.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = report(args.out_dir)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(result["targets"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
