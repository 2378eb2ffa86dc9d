"""Pipeline schedules over an emulated slow link (issue 20): a small GPT at PP=2, one gloo rank
per stage, 1F1B, eager-1F1B, interleaved 1F1B, ZB-H1, eager-zb and auto (the schedule
pipeline/schedule_auto.py picks from its own start-up profile; its rows name the one it ran)
side by side in the same run.

    sudo bash benchmarks/bench_pipeline_netns.sh         # two namespaces, 1 Gbit/s, 100, 50 Mbit/s
    python benchmarks/bench_pipeline.py report DIR       # the table of DIR/results.jsonl

Modes: `worker` is one rank (the netns script starts two, one per namespace; a test starts two
on localhost), `report DIR` prints the table and the target and writes DIR/results.json.

What one worker measures, every schedule in turn in each round (so that all see the same load
from whatever else runs on the machine), `--warmup` rounds first, then `--steps`:
- step: the executor's run of the schedule's action list over `--micro` micro-batches (every
  forward, backward and transfer; not the tied-embedding all-reduce, DP reduction or optimizer,
  which do not depend on the schedule), after a barrier; a step's time is the slower rank's.
- bubble of a stage: 1 - (time in its forward and backward actions, from the executor's
  timeline) / (the step's time: both ranks leave the barrier together, the step ends with the
  slower), the idle fraction of the step's span that `schedules.bubble_fraction` gives for
  free transfers and equal stages ((p-1)/(m+p-1), interleaved (p-1)/(v m+p-1)).
- memory of a stage: the peak bytes of the distinct storages autograd holds for backward
  (saved_tensors_hooks; parameters excluded): the activations of the micro-batches in flight.
  Not counted: parameters, gradients, received buffers autograd does not save, the allocator's
  cache, the Python heap. Also the peak number of micro-batches in flight (forwards whose
  backward has not run), from the timeline.
- c: one activation (seq x micro-batch x hidden, fp32) one way over the link, alone: half the
  round trip of a send and its echo; `--repeats` runs after each round's steps, the median of
  all (so that c and F+B see the load the steps saw).
- F+B: one micro-batch's forward and backward on each stage, alone (no transfers; both stages
  compute at the same time, as they do in a step); measured like c, with the split backward's
  B and W beside (schedule_auto.time_chunks, what auto's own profile runs). c/(F+B) takes the
  slower stage's F+B.
No latency is added: the links are rate limits only (tbf; this kernel has no netem).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megadomino.build import build_stage
from megadomino.config import ModelConfig, ParallelConfig
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.distributed import ParallelDims
from megadomino.pipeline.runtime import PipelineRuntime
from megadomino.pipeline.schedule_auto import AUTO, time_chunks
from megadomino.pipeline.schedules import (
    SPLIT_BACKWARD,
    Action,
    bubble_fraction,
    compute_steps,
    schedule,
    with_transfers,
)
from megadomino.pipeline.simulate import run

SCHEDULES = ("1f1b", "eager-1f1b", "interleaved", "zb-h1", "eager-zb", AUTO)
VARIANTS = {"eager-1f1b/no-prefetch": ("eager-1f1b", False), "1f1b/prefetch": ("1f1b", True),
            "1f1b/no-prefetch": ("1f1b", False)}
"""Controls beside the schedules: (schedule, prefetch) with the receives posted as named
(schedules.with_transfers' `prefetch`). The schedules themselves prefetch (the default since
2026-11-28; rows written before carry no "prefetch" key: their 1f1b and interleaved did not)."""
DEFAULT_RUN = SCHEDULES + ("1f1b/no-prefetch", "eager-1f1b/no-prefetch")
"""What a worker runs without --schedules: the schedules, and each prefetching one without."""
SENDS = "handed"  # gloo over TCP: simulate.run
TARGET_RATIO, TARGET_SPEEDUP = 0.3, 1.1  # eager-1F1B >= 1.1x 1F1B where c >= 30% of F+B


def action_lists(name: str, stages: int, micro: int,
                 default_prefetch: bool = True) -> tuple[int, list[list[Action]]]:
    """(chunks a stage, every stage's action list) of a schedule (receives prefetched as
    `default_prefetch` says: the runtime's default) or a control (VARIANTS)."""
    base, prefetch = VARIANTS.get(name, (name, None))
    chunks = 2 if base == "interleaved" else 1
    if prefetch is None:
        return chunks, [schedule(base, stages, s, micro, chunks, default_prefetch)
                        for s in range(stages)]
    return chunks, [with_transfers(compute_steps(base, stages, s, micro), stages, s, 1,
                                   eager=base == "eager-1f1b", prefetch=prefetch)
                    for s in range(stages)]


def predicted_step(row: dict) -> float:
    """The simulator's step (pipeline/simulate.py) from the row's own profiling pass, not its
    steps: each chunk's forward and backward alone (rows kept before they were recorded: each
    stage's F+B split F : B = 1 : 2, a backward being two GEMMs to a forward's one, and evenly
    over its chunks), a message's time the longer of c and the link's rate's, sends as gloo
    over TCP makes them (simulate.run's "handed"); a split backward's B and W as measured
    (rows without them: the whole backward for B, W free). An auto row is predicted as the
    schedule it ran."""
    name = row.get("runs", row["schedule"])
    chunks, lists = action_lists(name, row["stages"], row["micro"], row.get("prefetch", False))
    # a message alone may ride the token bucket's burst; messages back to back get the rate
    link = max(row["c_s"], row["c_rate_s"] or 0.0)
    if "chunk_fb_s" in row:  # each chunk's forward and backward, measured
        forward = [stage[0::2] for stage in row["chunk_fb_s"]]
        backward = [stage[1::2] for stage in row["chunk_fb_s"]]
    else:
        forward = [[t / 3 / chunks] * chunks for t in row["fb_s"]]
        backward = [[2 * t / 3 / chunks] * chunks for t in row["fb_s"]]
    weight = None
    if VARIANTS.get(name, (name,))[0] in SPLIT_BACKWARD and "chunk_split_s" in row:
        backward = [stage[0::2] for stage in row["chunk_split_s"]]
        weight = [stage[1::2] for stage in row["chunk_split_s"]]
    return run(lists, row["stages"], forward, backward, link, sends=SENDS, weight=weight).step


def predict(paths: list[str]) -> None:
    """Prediction beside measurement for every row of kept results files (their JSON lists)."""
    errors = []
    print(f"{'file':<44} {'rate':<8} {'schedule':<22} {'step s':>7} {'min-max':>11} "
          f"{'pred s':>7} {'error':>7} {'c/(F+B)':>7} {'load':>5}")
    for path in paths:
        with open(path) as file:
            for row in json.load(file):
                predicted = predicted_step(row)
                error = (predicted - row["step_median_s"]) / row["step_median_s"]
                errors.append(abs(error))
                print(f"{os.path.basename(path):<44} {row['rate']:<8} {row['schedule']:<22} "
                      f"{row['step_median_s']:>7.3f} {min(row['step_s']):>5.2f}-"
                      f"{max(row['step_s']):<5.2f} {predicted:>7.3f} {error:>+7.1%} "
                      f"{row['c_over_fb']:>7.3f} {max(row['load_average']):>5.1f}")
    print(f"median |error| {statistics.median(errors):.1%} over {len(errors)} rows, the largest "
          f"{max(errors):.1%}")


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while installed as
    `torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack)`; a storage is
    counted from its first save until its last saved reference is freed; `skip`: storages
    (data pointers) not counted, the parameters."""

    def __init__(self, skip: set[int]):
        self.skip, self.live, self.now, self.peak = skip, {}, 0, 0

    def pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return tensor
        count, size = self.live.get(key, (0, storage.nbytes()))
        if count == 0:
            self.now += size
            self.peak = max(self.peak, self.now)
        self.live[key] = (count + 1, size)
        return _Saved(tensor, lambda: self._release(key))

    @staticmethod
    def unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        count, size = self.live[key]
        if count == 1:
            del self.live[key]
            self.now -= size
        else:
            self.live[key] = (count - 1, size)


class _Saved:
    """A saved tensor; releases its count when autograd frees it."""

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]):
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig.preset(
        "gpt-tiny", num_layers=args.layers, hidden_size=args.hidden,
        num_attention_heads=args.heads, seq_length=args.seq, max_position_embeddings=args.seq,
        vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)


def micro_batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, ...]]:
    """The same `--micro` micro-batches on every rank: tokens, labels, loss mask [b, s]."""
    gen = torch.Generator().manual_seed(1234)
    shape = (args.mbs, args.seq)
    return [(torch.randint(0, args.vocab, shape, generator=gen),
             torch.randint(0, args.vocab, shape, generator=gen), torch.ones(shape))
            for _ in range(args.micro)]


def link_times(shape: tuple[int, ...], rank: int, runs: int) -> list[float]:
    """c, `runs` times: half the round trip of one activation sent by rank 0 and echoed by
    rank 1."""
    buffer = torch.randn(shape)
    times = []
    for _ in range(runs):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        times.append((time.perf_counter() - start) / 2)
    return times


def compute_times(chunks, batch, shape: tuple[int, ...], runs: int) -> list[list[float]]:
    """`runs` times, each chunk's forward and backward of one micro-batch through this stage,
    alone, then each chunk's split backward (B, W): [run][2 * chunk + (0: forward, 1:
    backward)], then [run][2 * chunks + 2 * chunk + (0: B, 1: W)] seconds."""
    times = []
    for _ in range(runs):
        dist.barrier()
        measured = time_chunks(chunks, batch, shape, torch.float32, split=True, warmup=0,
                               runs=1)
        times.append([t for f, b, _, _ in measured for t in (f, b)]
                     + [t for _, _, b, w in measured for t in (b, w)])
    return times


def timed_step(runtime: PipelineRuntime, actions: list, batches) -> dict:
    """One step of `actions` (the runtime's schedule or a control's) on this stage: its time,
    the time in forwards and backwards, the peak saved bytes and micro-batches in flight."""
    runtime.chunks.zero_grad(set_to_none=True)
    tracker = SavedBytes({p.untyped_storage().data_ptr() for p in runtime.chunks.parameters()})
    timeline: list = []
    dist.barrier()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        runtime.executor.run(actions, batches, timeline=timeline)
    seconds = time.perf_counter() - start
    busy = sum(end - begin for action, begin, end in timeline
               if action.op in ("forward", "backward"))
    return {"seconds": seconds, "busy": busy, "peak_saved": tracker.peak,
            "in_flight": peak_in_flight(timeline)}


def peak_in_flight(timeline: list) -> int:
    """The most (micro-batch, chunk) forwards run whose backward has not."""
    now = peak = 0
    for action, _, _ in timeline:
        if action.op in ("forward", "backward"):
            now += 1 if action.op == "forward" else -1
            peak = max(peak, now)
    return peak


def build_runtimes(args: argparse.Namespace, dims: ParallelDims) -> dict[str, tuple]:
    """(runtime, action list) per schedule or control of `--schedules`; those with one chunk a
    stage share their stage's model (collective: both ranks build the same list)."""
    config = model_config(args)
    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    runtimes, stages = {}, {}
    for name in args.schedules.split(","):
        base, prefetch = VARIANTS.get(name, (name, None))
        chunks = 2 if base == "interleaved" else 1
        # a split backward's chunks belong to its executor's weight-gradient stores: their own
        key = (chunks, name if base in (*SPLIT_BACKWARD, AUTO) else "")
        if key not in stages:
            plan = uniform_plan(args.layers, 2, 1, 2, chunks)
            stages[key] = (build_stage(config, dims, plan, "gpt", "cpu", parallel=parallel,
                                       init_seed=1234), plan)
        stage, plan = stages[key]
        runtime = PipelineRuntime(stage, plan, dims, config, parallel, base, args.mbs,
                                  args.micro)
        actions = (runtime.actions(args.micro) if prefetch is None
                   else action_lists(name, 2, args.micro)[1][args.rank])
        runtimes[name] = (runtime, actions)
    return runtimes


def run_rounds(args: argparse.Namespace, runtimes: dict[str, tuple]) -> tuple:
    """`--warmup` untimed rounds, then `--steps` timed ones; a round is one step of every
    runtime in turn, then `--repeats` runs of c and of F+B (through the first runtime's
    chunks). Returns (steps per runtime, c times, F+B times)."""
    shape = (args.seq, args.mbs, args.hidden)
    batches = micro_batches(args)
    alone = {}  # chunks a stage -> that stage model's chunks (the first runtime of each)
    for runtime, _ in runtimes.values():
        alone.setdefault(runtime.plan.chunks, runtime.chunks)
    steps: dict[str, list] = {name: [] for name in runtimes}
    c, fb = [], {v: [] for v in alone}
    for round_ in range(-args.warmup, args.steps):
        for name, (runtime, actions) in runtimes.items():
            step = timed_step(runtime, actions, batches)
            if round_ >= 0:
                steps[name].append(step)
        link = link_times(shape, args.rank, args.repeats)
        compute = {v: compute_times(chunks, batches[0], shape, args.repeats)
                   for v, chunks in alone.items()}
        if round_ >= 0:
            c = c + link
            for v, times in compute.items():
                fb[v] += times
    return steps, c, fb


def worker(args: argparse.Namespace) -> None:
    """One rank (stage) of the PP=2 world: the rounds, then rank 0 writes one JSON line per
    schedule to OUT/results.jsonl."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}",
                            rank=args.rank, world_size=2)
    runtimes = build_runtimes(args, ParallelDims(tp=1, pp=2))
    load = [os.getloadavg()[0]]
    steps, c, fb = run_rounds(args, runtimes)
    load.append(os.getloadavg()[0])
    every = [None, None]
    # per chunk count: each chunk's forward and backward (then B and W), medians over the runs
    medians = {v: [statistics.median(run[k] for run in runs) for k in range(len(runs[0]))]
               for v, runs in fb.items()}
    fewest = min(medians)
    dist.all_gather_object(every, {"fb": sum(medians[fewest][:2 * fewest]),
                                   "chunk_fb": medians, "steps": steps})
    if args.rank == 0:
        write_rows(args, statistics.median(c), every,
                   {name: r.plan.chunks for name, (r, _) in runtimes.items()}, load,
                   {name: r.schedule_name for name, (r, _) in runtimes.items()})
    dist.destroy_process_group()


def write_rows(args: argparse.Namespace, c: float, every: list[dict],
               chunks: dict[str, int], load: list[float], ran: dict[str, str]) -> None:
    """One JSON line per schedule (module docstring for what each number is); `load`: the
    machine's 1-minute load average at the start and the end of the run; `ran`: the schedule
    each row's runtime ran (auto's choice)."""
    activation = 4 * args.seq * args.mbs * args.hidden
    fb = [rank["fb"] for rank in every]
    with open(os.path.join(args.out, "results.jsonl"), "a") as out:
        for name, v in chunks.items():
            per_rank = [rank["steps"][name] for rank in every]
            step_s = [max(a["seconds"], b["seconds"]) for a, b in zip(*per_rank, strict=True)]
            bubbles = [[1.0 - s["busy"] / span for s, span in zip(steps, step_s, strict=True)]
                       for steps in per_rank]
            out.write(json.dumps({
                "rate": args.rate, "rate_mbit": args.rate_mbit, "schedule": name,
                "runs": ran[name],
                "prefetch": VARIANTS.get(name, (name, True))[1] or name == "eager-1f1b",
                "load_average": load, "cpus": os.cpu_count(),
                "stages": 2, "micro": args.micro, "chunks": v,
                "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                          "seq": args.seq, "micro_batch": args.mbs, "vocab": args.vocab},
                "activation_bytes": activation, "c_s": c,
                "c_rate_s": activation * 8 / (args.rate_mbit * 1e6) if args.rate_mbit else None,
                "fb_s": fb, "c_over_fb": c / max(fb),
                "chunk_fb_s": [rank["chunk_fb"][v][:2 * v] for rank in every],
                "chunk_split_s": [rank["chunk_fb"][v][2 * v:] for rank in every],
                "step_s": step_s, "step_median_s": statistics.median(step_s),
                "bubble_formula": bubble_fraction(2, args.micro, v),
                "per_stage": [{
                    "bubble": bubble, "bubble_median": statistics.median(bubble),
                    "peak_saved_bytes": max(s["peak_saved"] for s in steps),
                    "peak_in_flight": max(s["in_flight"] for s in steps),
                } for steps, bubble in zip(per_rank, bubbles, strict=True)],
            }) + "\n")


def report(args: argparse.Namespace) -> None:
    """The table, the target's check, and DIR/results.json (every row)."""
    with open(os.path.join(args.dir, "results.jsonl")) as file:
        rows = [json.loads(line) for line in file]
    print("step s: median (min-max) of the timed steps; vs 1f1b: 1f1b's median / this one's "
          "(paired: the median over rounds of 1f1b's step / this one's, same round)")
    header = (f"{'rate':<8} {'schedule':<22} {'step s':>7} {'min-max':>11} {'vs 1f1b':>7} "
              f"{'paired':>6} {'bubble s0/s1':>13} {'formula':>7} {'saved MiB s0/s1':>15} "
              f"{'in flight':>9} {'c ms':>6} {'F+B ms s0/s1':>13} {'c/(F+B)':>7} "
              f"{'pred s':>7}")
    print(header + "\n" + "-" * len(header))
    for row in rows:
        base = next(r for r in rows if r["rate"] == row["rate"] and r["schedule"] == "1f1b")
        stages = row["per_stage"]
        bubbles = "/".join(f"{s['bubble_median']:.2f}" for s in stages)
        saved = "/".join(f"{s['peak_saved_bytes'] / 2**20:.1f}" for s in stages)
        flight = "/".join(str(s["peak_in_flight"]) for s in stages)
        fb = "/".join(f"{t * 1e3:.0f}" for t in row["fb_s"])
        print(f"{row['rate']:<8} {row['schedule']:<22} {row['step_median_s']:>7.3f} "
              f"{min(row['step_s']):>5.3f}-{max(row['step_s']):<5.3f} "
              f"{base['step_median_s'] / row['step_median_s']:>6.2f}x "
              f"{paired_speedup(base, row):>5.2f}x {bubbles:>13} "
              f"{row['bubble_formula']:>7.3f} {saved:>15} {flight:>9} {row['c_s'] * 1e3:>6.1f} "
              f"{fb:>13} {row['c_over_fb']:>7.2f} {predicted_step(row):>7.3f}")
    for line in check_target(rows):
        print(line)
    for row in {row["rate"]: row for row in rows}.values():
        start, end = row["load_average"]
        print(f"{row['rate']}: 1-minute load average {start:.1f} at the start, {end:.1f} at "
              f"the end, {row['cpus']} CPUs")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


def paired_speedup(base: dict, row: dict) -> float:
    """The median over rounds of base's step / row's step in the same round (the schedules run
    one after the other in a round: a slow drift of the machine's load cancels)."""
    return statistics.median(b / r for b, r in zip(base["step_s"], row["step_s"], strict=True))


def check_target(rows: list[dict]) -> list[str]:
    """One line per rate: eager-1F1B's speedup over 1F1B, and whether the target applies
    (c >= 30% of F+B) and is met."""
    lines = []
    for rate in dict.fromkeys(row["rate"] for row in rows):
        by = {row["schedule"]: row for row in rows if row["rate"] == rate}
        if "1f1b" not in by or "eager-1f1b" not in by:
            continue
        ratio = by["1f1b"]["c_over_fb"]
        speedup = by["1f1b"]["step_median_s"] / by["eager-1f1b"]["step_median_s"]
        applies = ratio >= TARGET_RATIO
        verdict = ("met" if speedup >= TARGET_SPEEDUP else "MISSED") if applies else "n/a"
        paired = paired_speedup(by["1f1b"], by["eager-1f1b"])
        lines.append(f"{rate}: c/(F+B) {ratio:.2f}; eager-1f1b {speedup:.2f}x 1f1b (paired "
                     f"{paired:.2f}x; target >= {TARGET_SPEEDUP}x where c/(F+B) >= "
                     f"{TARGET_RATIO}: {verdict})")
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    work = modes.add_parser("worker", help="one rank (stage) of the PP=2 world")
    work.add_argument("--rank", type=int, required=True)
    work.add_argument("--master", default="127.0.0.1")
    work.add_argument("--port", type=int, required=True)
    work.add_argument("--out", required=True, help="directory for results.jsonl")
    work.add_argument("--rate", default="none", help="the link's rate, as a label")
    work.add_argument("--rate-mbit", type=float, default=0.0, help="the link's rate (0: none)")
    work.add_argument("--schedules", default=",".join(DEFAULT_RUN),
                      help="comma-separated: schedules and controls (VARIANTS)")
    work.add_argument("--layers", type=int, default=4)
    work.add_argument("--hidden", type=int, default=128)
    work.add_argument("--heads", type=int, default=4)
    work.add_argument("--seq", type=int, default=128)
    work.add_argument("--mbs", type=int, default=16, help="micro-batch size")
    work.add_argument("--vocab", type=int, default=1000)
    work.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    work.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    work.add_argument("--steps", type=int, default=9, help="timed rounds")
    work.add_argument("--repeats", type=int, default=3,
                      help="runs of c and of F+B in each round")
    rep = modes.add_parser("report", help="the table of DIR/results.jsonl")
    rep.add_argument("dir")
    rep.add_argument("--json", help="also write every row here")
    pred = modes.add_parser("predict", help="the simulator's step beside each kept row's")
    pred.add_argument("files", nargs="+", help="results JSON files (report --json's)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    if args.mode == "worker":
        worker(args)
    elif args.mode == "predict":
        predict(args.files)
    else:
        report(args)


if __name__ == "__main__":
    main()
