"""The scale model's command (issue 44): predicted step time and MFU of TP x PP x DP runs of 8 to
4,096 H200s, its errors against every measurement we hold, a table and a plot.

    python3 benchmarks/scale_model.py                         # tables, docs/scale_model.png
    python3 benchmarks/scale_model.py --inter-node-gbit 200   # another assumed network

The model is megadomino/pipeline/placement/scale.py (the placement cost model's counts, the one
pipeline simulator). Its rates come from benchmarks/scale_calibration.json, each entry naming the
raw file it was copied from: 1-GPU layer timings of each measured preset at each TP shard's
shapes and micro-batch ("layer", from bench_scale_inputs.py layers), NCCL bus bandwidth of
all-reduce, reduce-scatter and all-gather over message sizes at 2 and 4 GPUs ("busbw", from
bench_scale_inputs.py busbw), and the rest of a 1-GPU step (optimizer, host) from the 1-GPU run
of each held-out row's model and variant ("one_gpu"). The inter-node bandwidth is an assumption
(--inter-node-gbit, default 400 Gbit/s a GPU: InfiniBand NDR, one NIC a GPU). Held-out rows (2
and 4 GPUs) are predicted, never fitted.

The netns CPU rows use the same model with the testbed's rates: the pipeline rows through the
simulator from each run's own profiling pass and its link rate (bench_pipeline.predicted_step),
the placement rows as the cost model predicted them at start-up (plans.json; the measured machine
is printed in the report, not kept as JSON), the ZeRO rows from the unlimited link's step and the
limited link's bytes (scale.exposed: the ZeRO 3 overlap rule, each direction half the bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from megadomino.config import ConfigError  # noqa: E402
from megadomino.config.model import PRESETS, ModelConfig  # noqa: E402
from megadomino.pipeline.placement.scale import (  # noqa: E402
    BUS_FACTOR,
    Curve,
    LayerTimes,
    Layout,
    Rates,
    exposed,
    predict,
    rest_per_param,
)

REPO = Path(__file__).resolve().parent.parent
CALIBRATION = REPO / "benchmarks" / "scale_calibration.json"
FORMAT = "megadomino scale calibration 1"
KEYS = ("peak_tflops", "gpus_per_node", "layer", "busbw", "one_gpu", "held_out", "netns")
ENTRIES = {
    "layer": (("preset",), ("tp_shape", "micro_batch", "seq", "ms"),
              ("tp_shape", "micro_batch", "seq")),
    "busbw": (("collective",), ("gpus", "bytes", "bus_gbps"), ("gpus", "bytes")),
    "one_gpu": (("name", "preset"), ("micro_batch", "global_batch", "step_s"), ()),
    "held_out": (("name", "preset", "calibration"), ("tp", "dp", "micro_batch", "global_batch",
                                                     "step_s"), ()),
}
"""Each entry list's (text keys, positive-number keys, keys that with the text ones name an
entry once)."""
CHOICES = {"preset": PRESETS, "collective": BUS_FACTOR}
SWEEP_PRESETS = ("gpt3-1.3b", "gpt3-6.7b", "llama2-7b", "gpt3-13b", "llama2-70b")
GPU_COUNTS = tuple(2 ** k for k in range(3, 13))  # 8 .. 4096


def load_calibration(path: str | Path) -> dict:
    """The calibration file, checked: one ConfigError line naming the file and what is wrong."""
    name = f"--calibration {path}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{name}: cannot read it as JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{name}: not a scale calibration (want \"format\": \"{FORMAT}\")")
    missing = [key for key in KEYS if key not in data]
    if missing:
        raise ConfigError(f"{name}: missing {', '.join(missing)}")
    for part in ENTRIES:
        check_entries(name, part, data[part])
    absent = [k for k in BUS_FACTOR if not any(e["collective"] == k for e in data["busbw"])]
    if absent or not data["layer"]:
        raise ConfigError(f"{name}: needs \"layer\" entries and \"busbw\" entries of "
                          f"{', '.join(BUS_FACTOR)} (none of {', '.join(absent) or 'layer'})")
    names = {row["name"] for row in data["one_gpu"]}
    orphans = [row["name"] for row in data["held_out"] if row["calibration"] not in names]
    if orphans:
        raise ConfigError(f"{name}: held_out {orphans} name no one_gpu row as \"calibration\"")
    return data


def check_entries(name: str, part: str, entries: list) -> None:
    """`entries` of `part` (ENTRIES) well formed, each once, each naming a repository file."""
    texts, numbers, identity = ENTRIES[part]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{name}: \"{part}\" must be a list of objects")
    seen = set()
    for entry in entries:
        what = f"{name}: {part} entry {[entry.get(k) for k in texts + identity]}"
        values = [entry.get(k) for k in numbers]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                   for v in values):
            raise ConfigError(f"{what} needs positive {', '.join(numbers)}, not {values}")
        bad = [k for k in texts if not isinstance(entry.get(k), str)
               or (k in CHOICES and entry[k] not in CHOICES[k])]
        if bad:
            raise ConfigError(f"{what}: {', '.join(bad)} missing or unknown")
        key = tuple(entry[k] for k in texts + identity)
        if key in seen:
            raise ConfigError(f"{what} appears twice")
        seen.add(key)
        if not (REPO / entry.get("source", "")).is_file():
            raise ConfigError(f"{what}: source {entry.get('source')!r} is not a file of the "
                              f"repository")


def model_of(entry: dict) -> ModelConfig:
    layers = {"num_layers": entry["num_layers"]} if entry.get("num_layers") else {}
    return ModelConfig.preset(entry["preset"], **layers)


def layer_times(data: dict) -> LayerTimes:
    """The "layer" entries (bench_scale_inputs.py layers: ms a layer's forward + backward on
    one GPU at a TP shard's shapes, at the entry's sequence length)."""
    return LayerTimes.from_rows(
        (ModelConfig.preset(e["preset"], seq_length=e["seq"], max_position_embeddings=e["seq"]),
         e["tp_shape"], e["micro_batch"], e["ms"] / 1e3) for e in data["layer"])


def busbw_curves(data: dict) -> dict[tuple[str, int], Curve]:
    """Bus bandwidth (bytes/s) against message bytes by (collective, GPUs): the "busbw"
    entries (bench_scale_inputs.py busbw, nccl-tests' bus bandwidth)."""
    found: dict[tuple[str, int], list] = {}
    for entry in data["busbw"]:
        found.setdefault((entry["collective"], entry["gpus"]), []).append(
            (entry["bytes"], entry["bus_gbps"] * 1e9))
    return {key: Curve(tuple(points)) for key, points in found.items()}


def rates_for(data: dict, inter_gbit: float, one_gpu: str | None) -> Rates:
    """The rates, their rest calibrated on the named 1-GPU row (the first when None)."""
    rates = Rates(layer_times(data), busbw_curves(data), inter_gbit * 1e9 / 8, 0.0,
                  data["peak_tflops"] * 1e12, data["gpus_per_node"])
    rows = {row["name"]: row for row in data["one_gpu"]}
    row = rows[one_gpu] if one_gpu else data["one_gpu"][0]
    layout = Layout(1, 1, 1, row["micro_batch"], row["global_batch"])
    return replace(rates, rest_per_param=rest_per_param(model_of(row), layout, rates,
                                                        row["step_s"]))


def layout_of(row: dict) -> Layout:
    return Layout(row["tp"], row.get("pp", 1), row["dp"], row["micro_batch"], row["global_batch"],
                  zero_stage=row.get("zero_stage", 1),
                  sequence_parallel=row.get("sequence_parallel", False),
                  overlap_tp=row.get("overlap_tp", False), schedule=row.get("schedule", "1f1b"))


def held_out(data: dict, inter_gbit: float) -> list[tuple[str, float, float, str]]:
    """(row, measured s, predicted s, calibration row) for every held-out row."""
    out = []
    for row in data["held_out"]:
        rates = rates_for(data, inter_gbit, row["calibration"])
        predicted = predict(model_of(row), layout_of(row), rates).step
        out.append((row["name"], row["step_s"], predicted, row["calibration"]))
    return out


def netns_rows(data: dict) -> list[tuple[str, float, float]]:
    """(row, measured s, predicted s) of the netns CPU runs (module docstring)."""
    from bench_pipeline import predicted_step  # the one pipeline prediction of those rows
    paths = data["netns"]
    out = []
    for path in paths["pipeline"]:
        for row in json.loads((REPO / path).read_text()):
            out.append((f"pipeline {row['rate']} {row['schedule']}", row["step_median_s"],
                        predicted_step(row)))
    plans = json.loads((REPO / paths["placement_plans"]).read_text())
    report = (REPO / paths["placement_report"]).read_text().split("## report", 1)[1]
    for name, measured in re.findall(r"^(rank-order|dt-fm|ours)\s+([\d.]+)", report, re.M):
        out.append((f"placement {name}", float(measured), plans[name]["predicted_step"]))
    zero = json.loads((REPO / paths["zero"]).read_text())
    unlimited = {row["config"]: row["s_per_step"] for row in zero if row["rate"] == "none"}
    for row in zero:
        rate = {"1gbit": 1e9, "100mbit": 1e8}.get(row["rate"])
        if rate:
            compute = unlimited[row["config"]]
            comm = row["wire_bytes_per_step"] / 2 / (rate / 8)
            out.append((f"zero {row['rate']} {row['config']}", row["s_per_step"],
                        compute + exposed(comm, compute, True)))
    return out


def error_table(title: str, rows: list, extra: bool = False) -> list[str]:
    lines = [f"## {title}", f"{'row':<34} {'measured s':>10} {'predicted s':>11} {'error':>7}"
             + ("  calibrated on" if extra else "")]
    errors = []
    for row in rows:
        name, measured, predicted = row[:3]
        error = (predicted - measured) / measured
        errors.append(abs(error))
        lines.append(f"{name:<34} {measured:>10.4f} {predicted:>11.4f} {error:>+7.1%}"
                     + (f"  {row[3]}" if extra else ""))
    lines.append(f"median |error| {statistics.median(errors):.1%} over {len(errors)} rows "
                 f"(target <= 15%), largest {max(errors):.1%}")
    return lines


def sweep_tp(preset: str, tp: int) -> int:
    """The sweep's TP: --tp, but 1 for gpt3-1.3b, whose training state fits one GPU."""
    return 1 if preset == "gpt3-1.3b" else tp


def sweep_layout(preset: str, gpus: int, args: argparse.Namespace,
                 domino: bool) -> Layout | None:
    """The sweep's layout at `gpus`: --tp, --pp, DP the rest, --micro-batches a DP replica
    (weak scaling: a fixed batch per GPU); None where the GPUs are too few."""
    tp = sweep_tp(preset, args.tp)
    if gpus % (tp * args.pp):
        return None
    dp = gpus // (tp * args.pp)
    return Layout(tp, args.pp, dp, args.micro_batch, dp * args.micro_batch * args.micro_batches,
                  zero_stage=args.zero_stage, overlap_tp=domino, schedule=args.schedule)


def sweep(data: dict, args: argparse.Namespace) -> dict:
    """{(preset, domino): [(gpus, step s, MFU, layout)]} over GPU_COUNTS."""
    rates = rates_for(data, args.inter_node_gbit, None)
    table = {}
    for preset in args.presets:
        model = ModelConfig.preset(preset)
        for domino in (False, True) if sweep_tp(preset, args.tp) > 1 else (False,):
            points = []
            for gpus in GPU_COUNTS:
                layout = sweep_layout(preset, gpus, args, domino)
                if layout is not None:
                    estimate = predict(model, layout, rates)
                    points.append((gpus, estimate.step, estimate.mfu, layout))
            table[(preset, domino)] = points
    return table


def sweep_lines(table: dict) -> list[str]:
    """The sweep at 8, 64, 512 and 4,096 GPUs (the plot has every count)."""
    lines = ["## predicted steps (unvalidated beyond 4 GPUs)",
             f"{'preset':<11} {'Domino':<6} {'GPUs':>5} {'TP':>3} {'PP':>3} {'DP':>5} "
             f"{'step s':>8} {'MFU':>6}"]
    for (preset, domino), points in table.items():
        for gpus, step, mfu, layout in points:
            if gpus not in (8, 64, 512, 4096):
                continue
            lines.append(f"{preset:<11} {'on' if domino else 'off':<6} {gpus:>5} {layout.tp:>3} "
                         f"{layout.pp:>3} {layout.dp:>5} {step:>8.3f} {mfu:>6.1%}")
    return lines


def plot(table: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (preset, domino), points in table.items():
        gpus = [p[0] for p in points]
        style = dict(linestyle="-" if domino else "--", marker=".",
                     label=f"{preset} ({'Domino' if domino else 'plain TP'})")
        left.plot(gpus, [p[1] for p in points], **style)
        right.plot(gpus, [100 * p[2] for p in points], **style)
    left.set_yscale("log")
    for axis, label in ((left, "predicted step (s)"), (right, "predicted MFU (%)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("H200 GPUs")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    right.legend(fontsize=7)
    figure.suptitle(f"Scale model: unvalidated beyond 4 GPUs; inter-node {args.inter_node_gbit:g}"
                    f" Gbit/s a GPU assumed; TP {args.tp} (1.3B: 1) x PP {args.pp}, ZeRO "
                    f"{args.zero_stage}, {args.schedule}, micro-batch {args.micro_batch} x "
                    f"{args.micro_batches} a replica", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=str(CALIBRATION))
    parser.add_argument("--inter-node-gbit", type=float, default=400.0,
                        help="assumed bandwidth a GPU sends across nodes, Gbit/s (default 400: "
                             "InfiniBand NDR, one NIC a GPU)")
    parser.add_argument("--presets", nargs="+", default=list(SWEEP_PRESETS))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=16,
                        help="micro-batches a DP replica runs a step")
    parser.add_argument("--out-dir", default=str(REPO / "docs"),
                        help="where scale_model.png goes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        data = load_calibration(args.calibration)
        unknown = [p for p in args.presets if p not in SWEEP_PRESETS + ("llama2-13b", "gpt3-175b")]
        if unknown or args.tp < 1 or args.pp < 1 or not math.isfinite(args.inter_node_gbit):
            raise ConfigError(f"--presets / --tp / --pp: {unknown or (args.tp, args.pp)} "
                              f"cannot be swept")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    lines = error_table("held-out 2- and 4-GPU rows (H200)", held_out(data, args.inter_node_gbit),
                        extra=True)
    lines += [""] + error_table("netns CPU rows (the testbed's rates)", netns_rows(data))
    table = sweep(data, args)
    lines += [""] + sweep_lines(table)
    print("\n".join(lines))
    path = Path(args.out_dir) / "scale_model.png"
    plot(table, args, path)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
