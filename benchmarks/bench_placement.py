"""Pipeline placement over slow and uneven links (issue 41): the rank-order plan, DT-FM's plan and
ours (OP-Fence) trained over three emulated sites, beside the no-communication limit.

    sudo bash benchmarks/bench_placement_netns.sh        # the runs (at most 45 minutes)
    python3 benchmarks/bench_placement.py report DIR     # the table of DIR's logs

The netns script starts each run with pretrain_gpt.py; this module does the rest:
- `plans DIR -- TRAINING FLAGS`: from the measurement an auto run wrote (DIR/measure/links.json,
  with --pipeline-placement-dir), the plan files of every run and their predicted step times
  (DIR/plans.json): rank-order (rank r is stage r, the layers split evenly), dt-fm, ours
  (op-fence: the plan the auto run made) and nocomm (ours, run without rate limits: the
  no-communication limit);
- `probe-recv PORT BYTES` / `probe-send HOST PORT BYTES`: one TCP transfer, its rate after the
  first quarter (past a token bucket's burst), printed in Mbit/s, to verify a link before a run;
- `report DIR`: per plan, the median step over the timed iterations of each round (rank 0's
  log DIR/ROUND-PLAN.log, iterations after --warmup), tokens/s, the prediction's error, the
  paired ratios (ours over rank-order and over dt-fm, round by round), the step over the
  no-communication limit's, the load average of each run, and the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
import time
from pathlib import Path

from megadomino.cli.arguments import parse_args
from megadomino.config.pipeline_plan import plan_file, read_plan
from megadomino.pipeline.placement.cost import Machine, Workload, predict
from megadomino.pipeline.placement.planners import dt_fm, to_plan
from megadomino.pipeline.placement.resolve import rules_of
from megadomino.pipeline.reshard.layout import part_range
from megadomino.train.inputs import run_tokenizer

PLANS = ("rank-order", "dt-fm", "ours", "nocomm")
STEP = re.compile(r"iteration +(\d+)/ +\d+ \|.*?\| ([\d.]+) ms/iter")
TARGETS = (("ours' speedup over rank-order", "rank-order", "ours", 1.3),
           ("ours' speedup over dt-fm", "dt-fm", "ours", 0.97),
           ("ours' step over the no-communication limit's", "ours", "nocomm", 4.5))
"""(what, numerator plan, denominator plan, the least paired ratio of their steps)."""


def plans(args: argparse.Namespace) -> dict:
    """Every run's plan file and predicted step (module docstring); DIR/plans.json."""
    out = Path(args.dir)
    record = json.loads((out / "measure" / "links.json").read_text())
    machine = Machine.from_json(json.dumps(record["machine"]))
    config, _ = run_tokenizer(parse_args(args.flags, "gpt")[0])  # the tokenizer's vocabulary
    work, layers = Workload.from_config(config), config.model.num_layers
    ours = read_plan(str(out / "measure" / "plan.json"), layers)
    world = machine.world
    order = to_plan(tuple((rank,) for rank in range(world)),
                    [part_range(layers, world, s) for s in range(world)], layers)
    made = {"rank-order": order, "dt-fm": dt_fm(work, machine, rules_of(config)).plan,
            "ours": ours, "nocomm": ours}
    result = {}
    for name, plan in made.items():
        path = out / f"plan-{name}.json"
        path.write_text(plan_file(plan))
        result[name] = {"file": str(path), "predicted_step": predict(plan, work, machine).step,
                        "stages": [list(stage.ranks) for stage in plan.stages]}
    result["nocomm"]["predicted_step"] = None  # planned for the links it then runs without
    (out / "plans.json").write_text(json.dumps(result, indent=1) + "\n")
    for name, row in result.items():
        print(f"{name}: stages {row['stages']}, predicted step {row['predicted_step']}")
    return result


def steps(log: str, warmup: int) -> list[float]:
    """Seconds of each logged iteration after the first `warmup`."""
    return [float(ms) / 1e3 for it, ms in STEP.findall(log) if int(it) > warmup]


def collect(out: Path, warmup: int) -> dict[str, list[float]]:
    """Per plan, the median step of each round (DIR/ROUND-PLAN.log, rounds in order)."""
    medians: dict[str, list[float]] = {}
    for log in sorted(out.glob("round*-*.log")):
        name = log.stem.split("-", 1)[1]
        timed = steps(log.read_text(errors="replace"), warmup)
        if timed:
            medians.setdefault(name, []).append(statistics.median(timed))
    return medians


def paired(medians: dict[str, list[float]], numerator: str, denominator: str) -> float | None:
    """The median over rounds of one plan's step / another's in the same round (the plans run
    one after the other in a round: a slow drift of the machine's load cancels)."""
    if numerator not in medians or denominator not in medians:
        return None
    return statistics.median(a / b for a, b in zip(medians[numerator], medians[denominator],
                                                   strict=False))


def report(args: argparse.Namespace) -> list[str]:
    out = Path(args.dir)
    medians = collect(out, args.warmup)
    predicted = json.loads((out / "plans.json").read_text())
    loads = json.loads((out / "load.json").read_text()) if (out / "load.json").exists() else {}
    lines = [f"{'plan':<11} {'step s':>8} {'tokens/s':>9} {'predicted':>9} {'error':>7} "
             f"{'rounds':>6}  load average (1 min) per round"]
    for name in PLANS:
        if name not in medians:
            continue
        step = statistics.median(medians[name])
        guess = predicted.get(name, {}).get("predicted_step")
        error = f"{100 * (guess - step) / step:+.0f}%" if guess else "-"
        load = " ".join(f"{value:.1f}" for value in loads.get(name, []))
        lines.append(f"{name:<11} {step:>8.3f} {args.tokens / step:>9.0f} "
                     f"{guess or float('nan'):>9.3f} {error:>7} {len(medians[name]):>6}  {load}")
    for label, numerator, denominator, target in TARGETS:
        ratio = paired(medians, numerator, denominator)
        if ratio is not None:
            verdict = "met" if ratio >= target else "MISSED"
            lines.append(f"{label}: paired {ratio:.2f}x (target >= {target}x: {verdict})")
    errors = [abs(predicted[n]["predicted_step"] - statistics.median(medians[n]))
              / statistics.median(medians[n]) for n in PLANS
              if n in medians and predicted.get(n, {}).get("predicted_step")]
    if errors:
        lines.append(f"prediction error: median {100 * statistics.median(errors):.0f}% "
                     f"(target <= 15%), largest {100 * max(errors):.0f}% (target <= 30%)")
    print("\n".join(lines))
    return lines


def probe_recv(args: argparse.Namespace) -> float:
    """Receive `bytes` on `port` once; print the rate after the first quarter, Mbit/s."""
    with socket.create_server(("0.0.0.0", args.port)) as server:
        server.settimeout(args.timeout)
        connection, _ = server.accept()
        with connection:
            received, mark, start, counted = 0, args.bytes // 4, None, 0
            while received < args.bytes:
                chunk = connection.recv(1 << 16)
                if not chunk:
                    break
                received += len(chunk)
                if start is None and received >= mark:
                    start, counted = time.perf_counter(), received
            if start is None:
                raise SystemExit(f"probe: {received} of {args.bytes} bytes arrived")
            rate = (received - counted) * 8 / 1e6 / (time.perf_counter() - start)
    print(f"{rate:.1f}")
    return rate


def probe_send(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            with socket.create_connection((args.host, args.port), timeout=args.timeout) as sock:
                sock.sendall(bytes(args.bytes))
            return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    made = modes.add_parser("plans")
    made.add_argument("dir")
    made.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the training flags")
    rep = modes.add_parser("report")
    rep.add_argument("dir")
    rep.add_argument("--warmup", type=int, default=5, help="untimed iterations of each run")
    rep.add_argument("--tokens", type=float, default=1.0, help="tokens per iteration")
    recv = modes.add_parser("probe-recv")
    send = modes.add_parser("probe-send")
    send.add_argument("host")
    for sub in (recv, send):
        sub.add_argument("port", type=int)
        sub.add_argument("bytes", type=int)
        sub.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.mode == "plans":
        args.flags = [flag for flag in args.flags if flag != "--"]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    {"plans": plans, "report": report, "probe-recv": probe_recv,
     "probe-send": probe_send}[args.mode](args)


if __name__ == "__main__":
    main(sys.argv[1:])
