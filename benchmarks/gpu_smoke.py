"""The CLI smoke matrix (issue 33, item 4): every parallel mode README.md lists, launched as a user
launches it, 10 iterations of a small GPT, each compared with the DP=N run of the same global
batch and seed.

    python3 benchmarks/gpu_smoke.py --nproc 4 --dtype fp32,bf16 --jobs 8 --out smoke.json
    python3 benchmarks/gpu_smoke.py --nproc 2 --dtype fp32 --modes dp,tp,pp-1f1b \\
        --budget 120 --out /tmp/smoke.json                         # no GPU: gloo on CPU

Each run is `python -m torch.distributed.run --standalone --nproc_per_node N pretrain_gpt.py`
with the common flags (`common_flags`: 8 layers (2N from 5 ranks up), hidden 128, 8 heads, ffn
512, seq 64, a prime vocabulary of 331 padded only to TP, mock data, seed 1234, dropout 0,
AdamW at 1e-3 decaying linearly, log every iteration, no validation) and its mode's flags. The
reference is the same command at DP=N (no TP, no PP); a mode whose flags change the model
(`Mode.model_flags`) gets its own reference with them. Every logged loss is compared:

    fp32   relative 1e-4: the modes reorder fp32 sums only. TF32 is off because nothing turns
           it on: PyTorch leaves matmul TF32 off by default and megadomino has no flag for it
           (the JSON records the default the ranks start from, `matmul_tf32`).
    bf16   relative 2e-2: bf16 rounds each activation to 8 bits of mantissa, whose reordering
           moves the loss by a few tenths of a percent over 10 steps.
    quantized modes (qwZ, qgZ, FP8): 5e-2, their dtype's bound if looser. Their error is the
           feature: qwZ sends int8 weights (a block's absmax / 127 a step), qgZ int4 gradients
           (absmax / 7 a step), FP8 casts GEMM operands to 3 or 2 mantissa bits. Measured on CPU
           at 2 ranks, fp32: qwZ 1.2%, qgZ 0.5%, all three 1.0% by the 10th step (FP8 needs a
           GPU); 5% leaves room above those and is still far below a broken run's departure.

A run that has not printed its last iteration line when its wall budget (--budget) ends is
killed, torchrun and every rank, and fails with one line naming the mode, the budget and the
ranks' output tail. Modes that need more ranks than --nproc, or CUDA (graphs, FP8), are listed
as skipped with the reason. --jobs runs that many launches at once (ranks of different launches
share the GPUs; the wall times then include the contention). The JSON (--out) holds every
run's row: command, losses, grad norms, status, tolerance, wall time; and the device, torch
version and date. Results from the GPU machine are kept as
benchmarks/results/smoke_<device>_<date>.json, cited from BENCHMARKS.md (tests/test_doc_links.py
asks that of every raw result). The exit status is 1 if any run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 10
HEADS = 8
FFN = 512
LOG_LINE = re.compile(r"iteration +(\d+)/ +\d+ \| loss (\S+) .*\| grad norm (\S+)")
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
QUANTIZED_TOLERANCE = 5e-2
TAIL_LINES = 30
SUMMARY = re.compile(r"^ (?:parallelism|data parallelism): .*$", re.MULTILINE)


@dataclass(frozen=True)
class Mode:
    """One launch: `flags` beside the common ones at `micro_batch` sequences a micro-batch.
    `skip`: why it cannot run here (None: it runs); `quantized`: bound QUANTIZED_TOLERANCE;
    `bf16_only`: skipped at fp32; `model_flags`: flags that change the model, which its DP
    reference takes too; `plan`: --pipeline-plan's stages, written to a file at launch."""

    name: str
    flags: tuple[str, ...] = ()
    micro_batch: int = 1
    skip: str | None = None
    quantized: bool = False
    bf16_only: bool = False
    model_flags: tuple[str, ...] = ()
    plan: tuple[dict, ...] | None = None


def num_layers(nproc: int) -> int:
    """8 layers up to 4 ranks (PP=4 with 2 virtual stages each), 2N beyond."""
    return 2 * max(4, nproc)


def global_batch(nproc: int) -> int:
    """4N sequences: a multiple of every mode's DP x micro-batch, and of the PP size (the
    interleaved schedule takes micro-batches in groups of it)."""
    return 4 * nproc


def common_flags(nproc: int, dtype: str) -> list[str]:
    """The flags every run of the matrix shares (the reference's are these and its model
    flags)."""
    return ["--model-preset", "gpt-tiny", "--num-layers", str(num_layers(nproc)),
            "--hidden-size", "128", "--num-attention-heads", str(HEADS), "--ffn-hidden-size",
            str(FFN), "--seq-length", "64", "--max-position-embeddings", "64",
            "--vocab-size", "331", "--make-vocab-size-divisible-by", "1", "--mock-data",
            "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--train-iters", str(ITERATIONS), "--log-interval", "1", "--eval-iters", "0",
            "--lr", "1e-3", "--global-batch-size", str(global_batch(nproc)),
            *(["--bf16"] if dtype == "bf16" else [])]


def _first(*reasons: str | None) -> str | None:
    return next((reason for reason in reasons if reason is not None), None)


def _ranks(nproc: int, least: int, even: bool = False) -> str | None:
    if nproc >= least and (not even or nproc % 2 == 0):
        return None
    return f"needs {'an even number of ' if even else ''}{least}+ ranks, not {nproc}"


def _tp_skip(degree: int) -> str | None:
    return None if HEADS % degree == 0 else f"TP={degree} does not divide the {HEADS} heads"


def plan_mode(nproc: int) -> Mode:
    """`pp-plan`, a heterogeneous --pipeline-plan for `nproc` ranks. Even N >= 4: TP=1 | TP=2 x
    DP (N-2)/2 | TP=1 (first and last stage alike, so the embedding stays tied); odd N >= 3:
    TP=2 | TP=1 x DP (N-2), untied (tests/fixtures' 3-rank plan). Its micro-batch holds a
    sequence for each DP rank of its widest stage."""
    if nproc < 3:
        return Mode("pp-plan", skip=f"a plan of stages of different shapes needs 3+ ranks, "
                                    f"not {nproc}")
    if nproc % 2 == 0:
        groups = [([0], 1), (list(range(1, nproc - 1)), 2), ([nproc - 1], 1)]
        untie: tuple[str, ...] = ()
    else:
        groups = [([0, 1], 2), (list(range(2, nproc)), 1)]
        untie = ("--untie-embeddings-and-output-weights",)
    layers, count = num_layers(nproc), len(groups)
    bounds = [sum(layers // count + (i < layers % count) for i in range(index))
              for index in range(count + 1)]
    stages = tuple({"ranks": ranks, "tp": tp, "layers": [bounds[index], bounds[index + 1]]}
                   for index, (ranks, tp) in enumerate(groups))
    widest, batch = max(len(ranks) // tp for ranks, tp in groups), global_batch(nproc)
    micro = next(size for size in range(widest, batch + 1) if batch % size == 0)
    return Mode("pp-plan", ("--pipeline-model-parallel-size", str(count)), micro,
                model_flags=untie, plan=stages)


def mode_matrix(nproc: int, cuda: bool, fp8: bool) -> list[Mode]:
    """Every mode of README's "What works today" and "Recommended configurations" at `nproc`
    ranks, each with its skip reason where it cannot run (`cuda`: CUDA present; `fp8`: a GPU
    with FP8 GEMMs, compute capability 8.9+). The first is the reference, DP=N."""
    n, layers = nproc, num_layers(nproc)
    tp_n = ("--tensor-model-parallel-size", str(n))
    tp_half = ("--tensor-model-parallel-size", str(max(1, n // 2)))
    domino = ("--domino-batch-slices", "2", "--domino-hidden-slices", "2")
    graph = ("--enable-cuda-graph",)
    no_cuda = None if cuda else "CUDA graphs need CUDA"
    no_fp8 = None if fp8 else "FP8 GEMMs need a CUDA GPU of compute capability 8.9+"
    two = _ranks(n, 2)
    tp_skip = _first(two, _tp_skip(n))
    half_skip = _first(_ranks(n, 4, even=True), _tp_skip(max(1, n // 2)))
    pp_n = ("--pipeline-model-parallel-size", str(n))
    pp_2 = ("--pipeline-model-parallel-size", "2")
    pp_skip = _first(two, None if layers % n == 0 else f"{layers} layers do not split over "
                                                       f"{n} stages")
    interleaved_skip = _first(pp_skip, None if layers % (2 * n) == 0 else
                              f"{layers} layers do not split into 2 chunks on {n} stages")
    node = ("--gpus-per-node", str(n // 2)) if n >= 4 and n % 2 == 0 else ()
    hpz = ("--zeropp-hpz-partition-size", str(n // 2 if node else n))
    zero3 = ("--zero-stage", "3")
    qwz, qgz = ("--zeropp-quantized-weights",), ("--zeropp-quantized-gradients",)
    return [
        Mode("dp"),
        Mode("tp", tp_n, 2, tp_skip),
        Mode("tp-sp", (*tp_n, "--sequence-parallel"), 2, tp_skip),
        Mode("tp-sp-overlap", (*tp_n, "--sequence-parallel", "--tp-comm-overlap"), 2, tp_skip),
        Mode("tp-sp-high-priority", (*tp_n, "--sequence-parallel",
                                     "--high-priority-stream-groups", "tp", "dp"), 2, tp_skip),
        Mode("domino", (*tp_n, *domino), 2, tp_skip),
        Mode("domino-explicit", (*tp_n, *domino, "--domino-explicit-backward"), 2, tp_skip),
        Mode("domino-auto", (*tp_n, "--domino"), 2, tp_skip),
        Mode("cuda-graph", (*tp_n, *graph), 2, _first(no_cuda, tp_skip)),
        Mode("cuda-graph-sp-overlap", (*tp_n, "--sequence-parallel", "--tp-comm-overlap", *graph),
             2, _first(no_cuda, tp_skip)),
        Mode("cuda-graph-domino", (*tp_n, *domino, *graph), 2, _first(no_cuda, tp_skip)),
        Mode("cuda-graph-tp-dp", (*tp_half, *graph), 2, _first(no_cuda, half_skip)),
        Mode("pp-1f1b", pp_n, 1, pp_skip),
        Mode("pp-interleaved", (*pp_n, "--pipeline-schedule", "interleaved",
                                "--virtual-pipeline-model-parallel-size", "2"), 1,
             interleaved_skip),
        Mode("pp-eager-1f1b", (*pp_n, "--pipeline-schedule", "eager-1f1b"), 1, pp_skip),
        Mode("pp-zb-h1", (*pp_n, "--pipeline-schedule", "zb-h1"), 1, pp_skip),
        Mode("pp-eager-zb", (*pp_n, "--pipeline-schedule", "eager-zb"), 1, pp_skip),
        Mode("pp-zbv", (*pp_n, "--pipeline-schedule", "zbv",
                        "--virtual-pipeline-model-parallel-size", "2"), 1, interleaved_skip),
        Mode("pp-auto", (*pp_n, "--pipeline-schedule", "auto"), 1, pp_skip),
        Mode("pp-prefetch", (*pp_n, "--overlap-p2p-communication"), 1, pp_skip),
        Mode("pp-nccl-settings", (*pp_n, "--overlap-p2p-communication",
                                  "--nccl-communicator-config-path",
                                  "benchmarks/nccl_pp_max_ctas2.yaml"), 1, pp_skip),
        Mode("pp-uneven", (*pp_n, "--decoder-first-pipeline-num-layers",
                           str(layers - (n - 1))), 1, two),
        Mode("pp-tp-sp", (*pp_2, *tp_half, "--sequence-parallel"), 1, half_skip),
        Mode("pp-tp-domino", (*pp_2, *tp_half, *domino), 2, half_skip),
        Mode("pp-dp", pp_2, 1, _ranks(n, 4, even=True)),
        Mode("pp-dp-zero1", (*pp_2, "--zero-stage", "1"), 1, _ranks(n, 4, even=True)),
        plan_mode(n),
        Mode("zero1", ("--zero-stage", "1"), 1, two),
        Mode("zero1-overlap-gather", ("--use-distributed-optimizer", "--overlap-param-gather"),
             1, two),
        Mode("zero3", zero3, 1, two),
        Mode("zero3-qwz", (*zero3, *qwz), 1, two, quantized=True),
        Mode("zero3-hpz", (*zero3, *node, *hpz), 1, two),
        Mode("zero3-qgz", (*zero3, *node, *qgz), 1, two, quantized=True),
        Mode("zero++", (*zero3, *node, *qwz, *hpz, *qgz), 1, two, quantized=True),
        Mode("fp8", (*tp_n, "--fp8-format", "hybrid"), 2, _first(no_fp8, _tp_skip(n)),
             quantized=True, bf16_only=True),
        Mode("fp8-compiled", ("--fp8-format", "hybrid", "--compile-layer-pieces"), 1, no_fp8,
             quantized=True, bf16_only=True),
        Mode("zero1-fp8-gather", ("--use-distributed-optimizer", "--overlap-param-gather",
                                  "--fp8-format", "hybrid", "--fp8-param-gather"), 1,
             _first(no_fp8, two), quantized=True, bf16_only=True),
        Mode("zero3-fp8-gather", (*zero3, "--fp8-format", "hybrid", "--fp8-param-gather"), 1,
             _first(no_fp8, two), quantized=True, bf16_only=True),
    ]


def parse_log(output: str) -> dict[int, tuple[float, float]]:
    """{iteration: (loss, grad norm)} from pretrain_gpt.py's log lines; an iteration printed by
    several ranks keeps its first line."""
    steps: dict[int, tuple[float, float]] = {}
    for step, loss, norm in LOG_LINE.findall(output):
        steps.setdefault(int(step), (float(loss), float(norm)))
    return steps


def tolerance(mode: Mode, dtype: str) -> float:
    """The relative bound on every logged loss (see the module docstring)."""
    return max(TOLERANCE[dtype], QUANTIZED_TOLERANCE) if mode.quantized else TOLERANCE[dtype]


def compare(mine: dict[int, tuple[float, float]], reference: dict[int, tuple[float, float]],
            bound: float) -> tuple[bool, float, str]:
    """(passed, max relative loss difference, why not) over iterations 1..ITERATIONS; a missing
    or non-finite loss fails."""
    worst, why = 0.0, ""
    for step in range(1, ITERATIONS + 1):
        if step not in mine or step not in reference:
            return False, math.inf, f"iteration {step} missing"
        loss, ref = mine[step][0], reference[step][0]
        if not (math.isfinite(loss) and math.isfinite(ref)):
            return False, math.inf, f"iteration {step}: loss {loss} vs DP {ref}"
        diff = abs(loss - ref) / abs(ref)
        if diff > bound and not why:
            why = f"iteration {step}: loss {loss:.6e} vs DP {ref:.6e}"
        worst = max(worst, diff)
    return not why, worst, why


@dataclass
class Launch:
    """What one torchrun printed, its exit status, wall seconds, and whether its budget ran
    out."""

    output: str
    returncode: int
    wall_s: float
    timed_out: bool


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts each rank in a session of its own, so a
    process-group kill of torchrun misses them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun, every rank and their process groups."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def launch(argv: list[str], budget: float, live: set) -> Launch:
    """Run `argv` from the repository root with a wall budget; `live` holds it while it runs,
    for the SIGTERM handler."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    live.add(proc)
    try:
        output, _ = proc.communicate(timeout=budget)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, _ = proc.communicate()
        timed_out = True
    finally:
        live.discard(proc)
    return Launch(output, proc.returncode, time.monotonic() - start, timed_out)


def tail(output: str) -> str:
    return "\n".join(output.splitlines()[-TAIL_LINES:])


def judge(mode: Mode, dtype: str, run: Launch, reference: Launch | None,
          budget: float) -> dict:
    """A finished run's row: status pass / fail, the max relative loss difference, why not."""
    bound = tolerance(mode, dtype)
    row = {"status": "fail", "tolerance": bound, "max_rel_diff": None,
           "wall_s": round(run.wall_s, 1)}
    steps = parse_log(run.output)
    row["losses"] = [steps[step][0] for step in sorted(steps)]
    row["grad_norms"] = [steps[step][1] for step in sorted(steps)]
    row["summary"] = [line.strip() for line in SUMMARY.findall(run.output)[:2]]
    last = f"'iteration {ITERATIONS}/{ITERATIONS}'"
    if ITERATIONS not in steps or run.returncode != 0:
        if run.timed_out:
            ended = (f"printed {last} but did not exit within its {budget:.0f} s budget"
                     if ITERATIONS in steps else f"no {last} line within its {budget:.0f} s budget")
        else:
            ended = f"exited {run.returncode} {'after' if ITERATIONS in steps else 'before'} {last}"
        return row | {"detail": f"{mode.name} ({dtype}): {ended}; rank output tail:\n"
                                f"{tail(run.output)}"}
    if reference is None or ITERATIONS not in parse_log(reference.output):
        return row | {"detail": f"{mode.name} ({dtype}): its DP reference failed"}
    passed, worst, why = compare(steps, parse_log(reference.output), bound)
    return row | {"status": "pass" if passed else "fail", "max_rel_diff": worst,
                  "detail": "" if passed else f"{mode.name} ({dtype}): {why}, beyond {bound:g}"}


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':<22} {'dtype':<5} {'status':<6} {'max rel diff':>12} {'wall s':>7}"]
    for row in rows:
        diff = "" if row.get("max_rel_diff") is None else f"{row['max_rel_diff']:.2e}"
        wall = "" if row.get("wall_s") is None else f"{row['wall_s']:.1f}"
        lines.append(f"{row['mode']:<22} {row['dtype']:<5} {row['status']:<6} {diff:>12} "
                     f"{wall:>7}" + (f"  {row['detail']}" if row["status"] == "skip" else ""))
    counts = {status: sum(row["status"] == status for row in rows)
              for status in ("pass", "fail", "skip")}
    return "\n".join([*lines, ", ".join(f"{count} {status}" for status, count in counts.items())])


def _command(args, mode: Mode, dtype: str, plan_dir: Path) -> list[str]:
    flags = list(mode.flags)
    if mode.plan is not None:
        path = plan_dir / f"{mode.name}.json"
        path.write_text(json.dumps({"stages": list(mode.plan)}))
        flags += ["--pipeline-plan", str(path)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(args.nproc), "pretrain_gpt.py", *common_flags(args.nproc, dtype),
            *mode.model_flags, "--micro-batch-size", str(mode.micro_batch), *flags]


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="ranks (GPUs) per run")
    parser.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--modes", default=None, help="comma-separated mode names (default all)")
    parser.add_argument("--budget", type=float, default=120.0, help="wall seconds per run")
    parser.add_argument("--jobs", type=int, default=1, help="launches at once")
    parser.add_argument("--out", required=True, help="JSON file of every run")
    args = parser.parse_args()
    args.dtypes = args.dtype.split(",")
    if not set(args.dtypes) <= set(TOLERANCE):
        parser.error(f"--dtype {args.dtype}: each one of {', '.join(TOLERANCE)}")
    return args


def _result(args, cuda: bool, rows: list[dict]) -> dict:
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "nproc": args.nproc, "iterations": ITERATIONS, "budget_s": args.budget,
            "jobs": args.jobs, "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "common_flags": {dtype: common_flags(args.nproc, dtype) for dtype in args.dtypes},
            "runs": rows}


def _runs(args, matrix: list[Mode]) -> tuple[list[dict], list[tuple | None], dict]:
    """The rows in table order (a skipped one with its reason), each row's run key (mode, model
    flags, dtype) or None, and the Mode of every key to launch: the selected modes and a DP
    reference per dtype and model flags (the DP mode is its own reference)."""
    wanted = [mode.name for mode in matrix] if args.modes is None else args.modes.split(",")
    rows, keys, runs = [], [], {}
    for dtype in args.dtypes:
        for mode in (mode for mode in matrix if mode.name in wanted):
            skip = mode.skip or ("FP8 runs with --bf16 only" if mode.bf16_only
                                 and dtype == "fp32" else None)
            key = None if skip else (mode.name, mode.model_flags, dtype)
            rows.append({"mode": mode.name, "dtype": dtype, "status": "skip", "detail": skip})
            keys.append(key)
            if key:
                runs[key] = mode
                runs.setdefault(("dp", mode.model_flags, dtype),
                                Mode("dp", model_flags=mode.model_flags))
    return rows, keys, runs


def _launch_all(args, commands: dict, launched: dict) -> None:
    """Launch every command, `args.jobs` at a time, the references first, filling `launched`
    as they end. On SIGTERM (the suite's step limit) every live run is killed and SystemExit
    raised, so that the caller still writes the rows of those that ended."""
    live: set[subprocess.Popen] = set()

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        futures = {pool.submit(launch, commands[key], args.budget, live): key
                   for key in sorted(commands, key=lambda key: key[0] != "dp")}
        for future in as_completed(futures):
            key, run = futures[future], future.result()
            launched[key] = run
            print(f"finished {' '.join((key[0], *key[1], key[2]))}: {run.wall_s:.1f} s, exit "
                  f"{run.returncode}", flush=True)
    finally:
        for proc in list(live):
            kill_tree(proc)
        pool.shutdown(wait=False, cancel_futures=True)


def main() -> int:
    args = _arguments()
    cuda = torch.cuda.is_available()
    if cuda and args.nproc > torch.cuda.device_count():
        sys.exit(f"error: --nproc {args.nproc} > the {torch.cuda.device_count()} GPUs here")
    matrix = mode_matrix(args.nproc, cuda, cuda and torch.cuda.get_device_capability(0) >= (8, 9))
    names = [mode.name for mode in matrix]
    unknown = sorted(set(args.modes.split(",") if args.modes else ()) - set(names))
    if unknown:
        sys.exit(f"error: unknown mode {unknown[0]}; the modes: {', '.join(names)}")
    rows, keys, runs = _runs(args, matrix)
    launched: dict[tuple, Launch] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as plan_dir:
        commands = {key: _command(args, mode, key[2], Path(plan_dir))
                    for key, mode in runs.items()}
        try:
            _launch_all(args, commands, launched)
        finally:
            for row, key in zip(rows, keys, strict=True):
                if key is None:
                    continue
                mode, reference = runs[key], ("dp", key[1], key[2])
                row["command"] = shlex.join(commands[key])
                if mode.plan is not None:
                    row |= {"plan": {"stages": list(mode.plan)},
                            "reference_command": shlex.join(commands[reference])}
                row |= (judge(mode, key[2], launched[key], launched.get(reference), args.budget)
                        if key in launched else {"status": "fail", "detail": f"{mode.name} "
                        f"({key[2]}): stopped before it ended (SIGTERM)"})
            Path(args.out).write_text(json.dumps(_result(args, cuda, rows), indent=1) + "\n")
            for row in rows:
                if row["status"] == "fail":
                    print(row["detail"], file=sys.stderr)
            print(table(rows))
    return 1 if any(row["status"] == "fail" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
