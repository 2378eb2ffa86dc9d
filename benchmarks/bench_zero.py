"""Step time and peak memory per GPU: plain DP vs ZeRO-3 vs ZeRO++ (and its parts), 4 GPUs as
2 nodes x 2 (gpus_per_node=2 on one host: the "inter-node" groups ride NVLink too; any even
rank count runs as 2 nodes x world/2, e.g. 2 GPUs as 2 x 1 when only two are lent).

    torchrun --standalone --nproc_per_node 4 benchmarks/bench_zero.py \
        [--preset gpt3-1.3b --seq-length 2048 --micro-batch-size 1 --steps 10 --out zero.json]
    torchrun --standalone --nproc_per_node 4 benchmarks/bench_zero.py --device cpu \
        --preset gpt-tiny --seq-length 64          # smoke test: gloo on CPU ranks

Each configuration builds the bf16 model afresh, runs `--warmup` steps, then times `--steps`
(median of per-step wall clock, synchronized); peak memory is torch.cuda.max_memory_allocated
over its steps (reset once the model is built and sharded), less what was allocated before the
configuration was built (`leftover_gib`: the configurations run before it left memory allocated,
more with each one). `--profile` adds one profiled step per configuration (busy/idle times and
the top kernels, benchmarks/timeline.py). Over NVLink the
links are not the bottleneck, so ZeRO++'s step time over ZeRO-3's is its quantization overhead
(the target: under 5%); the bytes each configuration sends are printed beside it (the engine's
CommCounter, per rank, per step).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megadomino.distributed import ParallelDims

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero_common  # noqa: E402
from zero_common import CONFIGS, add_model_args, build_engine, train_step  # noqa: E402


def measure(name: str, dims: ParallelDims, args: argparse.Namespace,
            device: torch.device) -> dict:
    cuda = device.type == "cuda"
    # What earlier configurations left allocated (it grows with each one run before) is not this
    # one's: peaks are counted above it.
    leftover = torch.cuda.memory_allocated(device) if cuda else 0
    engine = build_engine(name, dims, args)
    if cuda:  # after construction: a ZeRO engine shards a model that was built whole
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            engine.comm.reset()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = train_step(engine, dims, args, step, device)
        losses.append(loss)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    profile = None
    if args.profile and cuda:  # one more step, profiled: where the time goes
        from timeline import profile_summary
        profile = profile_summary(functools.partial(train_step, engine, dims, args,
                                                    args.warmup + args.steps, device), top=15,
                                  host=True)
    py_profile = python_profile(engine, dims, args, device) if args.py_profile else None
    row = {"config": name, "s_per_step": statistics.median(times[args.warmup:]),
           "profile": profile, "py_profile": py_profile,
           "loss": loss, "losses": losses, "leftover_gib": leftover / 2**30,
           "peak_memory_gib": (torch.cuda.max_memory_allocated(device) - leftover) / 2**30
           if cuda else None}
    totals = engine.comm.totals()
    row["weights_bytes_per_step"] = sum(
        count["intra"] + count["inter"] for tag, count in engine.comm.bytes.items()
        if tag.startswith("weights")) / args.steps
    row.update({f"{side}_bytes_per_step": totals[side] / args.steps for side in totals},
               **{f"engine_{k}": v for k, v in engine.memory_stats().items()})
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def python_profile(engine, dims: ParallelDims, args: argparse.Namespace,
                   device: torch.device) -> dict:
    """`--py-profile N`: N more steps under cProfile (every rank profiles, so that the ranks stay
    in step; rank 0's numbers are kept). Where the host's Python time goes: the top functions by
    own time and, for this repo's functions, by cumulative time, ms per step (cProfile's own
    overhead inflates both, so compare within one run)."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    first = args.warmup + args.steps + (1 if args.profile else 0)
    profiler.enable()
    for step in range(first, first + args.py_profile):
        train_step(engine, dims, args, step, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, _)
    per_step = 1e3 / args.py_profile

    def label(key):
        path, line, func = key
        return f"{os.path.relpath(path) if path.startswith('/') else path}:{line}:{func}"

    def top(entries, index):
        ranked = sorted(entries, key=lambda item: -item[1][index])[:25]
        return {label(key): [round(v[index] * per_step, 3), v[1] // args.py_profile]
                for key, v in ranked}
    ours = [(k, v) for k, v in stats.items() if "megadomino" in k[0] or "kernels" in k[0]]
    return {"self_ms_per_step": top(stats.items(), 2), "our_cum_ms_per_step": top(ours, 3),
            "total_ms_per_step": round(sum(v[2] for v in stats.values()) * per_step, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, "gpt3-1.3b", hidden=None, layers=None, seq=2048)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--configs", nargs="+",
                        default=[c for c in CONFIGS if c not in zero_common.NOT_DEFAULT],
                        choices=list(CONFIGS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="pass over the configurations this many times (each built afresh): "
                             "medians over passes, since one pass to the next drifts by 10%% at "
                             "micro-batch 1")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--baseline", default="zero3",
                        help="the configuration the 'vs' column divides by (run it too)")
    parser.add_argument("--profile", action="store_true",
                        help="add one profiled step per config: kernel timeline summary")
    parser.add_argument("--py-profile", type=int, default=0, metavar="N",
                        help="add N steps per config under cProfile: the host's Python time by "
                             "function (rank 0)")
    parser.set_defaults(micro_batch_size=1)
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    if world < 2 or world % 2:
        raise SystemExit(f"run on an even number of ranks (2 nodes x world/2), got {world}: "
                         "torchrun --nproc_per_node 4 ...")
    dims = ParallelDims(tp=1, gpus_per_node=world // 2)
    rounds = [[measure(name, dims, args, device) for name in args.configs]
              for _ in range(args.rounds)]
    rows = merge_rounds(rounds, args.baseline)
    if dims.rank == 0:
        report(rows, args)
    dist.destroy_process_group()


def merge_rounds(rounds: list[list[dict]], baseline: str = "zero3") -> list[dict]:
    """One row per configuration from `--rounds` passes over the list: the last pass's row with
    s_per_step the median over the passes (each pass's in `s_per_step_rounds`) and, beside
    `baseline`, the median of the passes' ratios to it (`vs_baseline`: the ratio of two
    configurations measured minutes apart in one pass, so the machine's drift between passes
    cancels; each pass's in `vs_baseline_rounds`)."""
    rows = []
    for index, last in enumerate(rounds[-1]):
        row = dict(last)
        times = [passed[index]["s_per_step"] for passed in rounds]
        row["s_per_step"], row["s_per_step_rounds"] = statistics.median(times), times
        base = [next((r["s_per_step"] for r in passed if r["config"] == baseline), None)
                for passed in rounds]
        if None not in base:
            row["vs_baseline_rounds"] = [t / b for t, b in zip(times, base)]
            row["vs_baseline"] = statistics.median(row["vs_baseline_rounds"])
        rows.append(row)
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    tokens = world * args.micro_batch_size * args.seq_length
    print(f"{args.preset}, seq {args.seq_length}, micro-batch {args.micro_batch_size} per GPU, "
          f"{args.dtype}, {world} GPUs as 2 nodes x {world // 2}; median of {args.steps} steps")
    header = (f"{'config':<20} {'s/step':>8} {'tokens/s':>10} {'vs base':>10} {'peak GiB':>9} "
              f"{'inter MB':>9} {'intra MB':>9} {'weights MB':>10} {'left GiB':>9} "
              f"{'last loss':>9}")
    print(header + "\n" + "-" * len(header))
    for r in rows:
        ratio = r.get("vs_baseline", float("nan"))
        peak = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        inter = r.get("inter_bytes_per_step", 0) / 1e6
        intra = r.get("intra_bytes_per_step", 0) / 1e6
        print(f"{r['config']:<20} {r['s_per_step']:>8.4f} {tokens / r['s_per_step']:>10.0f} "
              f"{ratio:>10.3f} {peak:>9} {inter:>9.1f} {intra:>9.1f} "
              f"{r['weights_bytes_per_step'] / 1e6:>10.1f} {r.get('leftover_gib', 0):>9.2f} "
              f"{r['loss']:>9.4f}")
    print(f"(vs base: s/step over --baseline {args.baseline}'s; plain DP's all-reduce is not "
          "counted: inter/intra MB are the ZeRO engine's, weights MB its parameter gathers; peak "
          "GiB is above 'left GiB', what the configurations before left allocated)")
    if args.rounds > 1:
        print(f"(s/step: median over {args.rounds} passes of the list; vs base: median of the "
              "passes' ratios; per pass:)")
        for r in rows:
            print(f"    {r['config']:<20} " + " ".join(f"{t:.4f}" for t in r["s_per_step_rounds"]))
    for r in rows:
        if r.get("profile"):
            p = r["profile"]
            print(f"\n{r['config']}: span {p['span_ms']:.1f} ms, "
                  f"compute {p['compute_busy_ms']:.1f}, nccl {p['nccl_busy_ms']:.1f} "
                  f"(under compute {p['nccl_under_compute_ms']:.1f}), "
                  f"memcpy {p['memcpy_busy_ms']:.1f}, idle {p['gpu_idle_ms']:.1f}")
            for kernel, (ms, count) in p["top_kernels"].items():
                print(f"    {ms:8.2f} ms {count:5d}x {kernel}")
            for op, (ms, count) in p.get("top_host_ops", {}).items():
                print(f"    host {ms:8.2f} ms {count:5d}x {op}")
    for r in rows:
        if r.get("py_profile"):
            p = r["py_profile"]
            print(f"\n{r['config']}: Python (cProfile), {p['total_ms_per_step']:.1f} ms a step "
                  "of own time in all; ms a step, calls a step")
            for title, key in (("own", "self_ms_per_step"), ("ours, cumulative",
                                                             "our_cum_ms_per_step")):
                for func, (ms, count) in list(p[key].items())[:15]:
                    print(f"    {title:>16} {ms:8.2f} {count:6d}x {func}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
