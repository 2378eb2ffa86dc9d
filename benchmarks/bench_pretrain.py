"""End-to-end pretrain throughput on the GPU machine: pretrain_gpt.py / pretrain_llama.py runs at
several TP degrees, parsed from their log lines, and beside them megatron-core's own training step
on the same shapes and batches (`--peer megatron`: benchmarks/megatron_pretrain.py).

    python benchmarks/bench_pretrain.py --preset gpt3-1.3b --tp 1 2 4 --iters 20 \
        --micro-batch-size 4 --out bench_pretrain.json [--sequence-parallel] [--num-layers N]
    python benchmarks/bench_pretrain.py --preset gpt3-1.3b --tp 1 --dp 2 --micro-batch-size 2 \
        --peer megatron --rounds 3 --variants '' ' --compile-layer-pieces' --out e2e_dp2.json

Each run uses TP x PP x DP GPUs (`--dp`, default 1; `--pp`, with `--vp` layers per virtual
stage for the interleaved schedule); the global batch is micro-batch x accumulation x DP. The
reported numbers are the last log interval's (after warm-up): ms/iter, tokens/s, TFLOP/s per GPU
(Megatron's formula, the same function for both columns), MFU against 989 TFLOP/s, and peak
allocated memory on rank 0. With DP > 1 both sides shard the optimizer (ours
--use-distributed-optimizer with --overlap-param-gather unless the variant has CUDA graphs, which
refuse it; megatron-core's distributed optimizer with overlapped gradient reduce and parameter
gather). With a peer or --no-dropout, dropout is 0 (the
peer's SDPA attention takes none). `--rounds N` repeats every run N times, ours and the peer's
in alternating order, and the summary gives each row's median with its range and the ratio of
medians ours / peer. `--limit` adds, on 1-GPU rows, the step's GEMMs and attention alone
(benchmarks/step_limit.py) and each column's fraction of it ("of limit"). Every row records
which linears ran FP8 (`fp8_linears`: the start-up summary's clause, 'none' without
--fp8-format; with --fp8-linears auto also `fp8_auto`, its choice and the times compared), e.g.

    python benchmarks/bench_pretrain.py --preset gpt3-1.3b --tp 1 --micro-batch-size 2 \
        --accumulation 8 --rounds 3 --variants ' --compile-layer-pieces' \
        ' --compile-layer-pieces --fp8-format hybrid' \
        ' --compile-layer-pieces --fp8-format hybrid --fp8-linears auto'
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

import torch

LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| loss (\S+) \| lr \S+ \| global batch \d+ \| "
                  r"grad norm \S+ \| "
                  r"([\d.]+) ms/iter \| ([\d.]+) tokens/s \| ([\d.]+) TFLOP/s/GPU \| "
                  r"MFU ([\d.]+)% \| peak mem ([\d.]+) GiB")
FP8_CLAUSE = re.compile(r"precision: [^,\n]*, (FP8 [^\n]*)")
"""The start-up summary's FP8 clause: which linears of which layers ran FP8."""
FP8_AUTO = re.compile(r"fp8 linears auto: ([^\n]*)")
"""--fp8-linears auto's start-up line: its choice and every time compared."""


def _shared_flags(args, tp: int) -> list[str]:
    """The flags both columns take (Megatron-LM's names)."""
    flags = ["--model-preset", args.preset, "--tensor-model-parallel-size", str(tp),
             "--pipeline-model-parallel-size", str(args.pp),
             "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size * args.accumulation * args.dp),
             "--train-iters", str(args.iters), "--lr", "1e-4",
             "--log-interval", str(args.log_interval), "--seq-length", str(args.seq_length),
             "--peak-tflops", "989"]
    if args.num_layers:
        flags += ["--num-layers", str(args.num_layers)]
    if args.vp:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(args.vp)]
    if args.dp > 1:
        flags.append("--use-distributed-optimizer")
    return flags


def ours_command(args, tp: int, sequence_parallel: bool, variant: str) -> list[str]:
    script = "pretrain_llama.py" if args.preset.startswith("llama") else "pretrain_gpt.py"
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={tp * args.pp * args.dp}", script,
           *_shared_flags(args, tp), "--bf16", "--mock-data", "--lr-warmup-iters", "2",
           "--eval-interval", "100000", "--eval-iters", "1"]
    if args.peer or args.no_dropout:
        cmd += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if sequence_parallel:
        cmd.append("--sequence-parallel")
    if args.dp > 1 and "--enable-cuda-graph" not in variant:  # graphs wait for all gathers
        cmd.append("--overlap-param-gather")
    return cmd + variant.split()


def peer_command(args, tp: int) -> list[str]:
    """megatron-core's step: overlapped gradient reduce as Megatron-LM's users run it; p2p
    overlapped with compute under the interleaved schedule (Megatron-LM's default there)."""
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={tp * args.pp * args.dp}",
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_pretrain.py"),
           *_shared_flags(args, tp), "--overlap-grad-reduce"]
    if args.dp > 1:
        cmd.append("--overlap-param-gather")
    if args.vp:
        cmd.append("--overlap-p2p-communication")
    return cmd


def run(cmd: list[str], row: dict, env: dict | None = None) -> dict:
    """One launch; `row` names it; the last log line's figures, or the exit status."""
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or dict(os.environ))
    matches = LINE.findall(proc.stdout)
    if proc.returncode != 0 or not matches:
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
        return {**row, "error": proc.returncode}
    it, total, loss, ms, tokens, tflops, mfu, mem = matches[-1]
    return {**row, **fp8_fields(proc.stdout), "iteration": int(it),
            "first_logged_loss": float(matches[0][2]), "loss": float(loss),
            "ms_per_iter": float(ms), "tokens_per_s": float(tokens),
            "tflops_per_gpu": float(tflops), "mfu_percent": float(mfu),
            "peak_mem_gib": float(mem)}


def fp8_fields(stdout: str) -> dict:
    """A run's FP8 linears, from its start-up lines: `fp8_linears`, the summary's clause (which
    linears of which layers ran FP8; 'none' without --fp8-format), and with --fp8-linears auto
    `fp8_auto`, its line's choice and times."""
    clause = FP8_CLAUSE.search(stdout)
    fields = {"fp8_linears": clause.group(1) if clause else "none"}
    auto = FP8_AUTO.search(stdout)
    return {**fields, "fp8_auto": auto.group(1)} if auto else fields


def launches(args, gpus: int) -> list[tuple[dict, list[str], dict | None]]:
    """One round's launches: (row, command, environment)."""
    out = []
    for tp in args.tp:
        if tp * args.pp * args.dp > gpus:
            print(f"skip tp={tp} x pp={args.pp} x dp={args.dp}: only {gpus} GPUs", flush=True)
            continue
        for variant in args.variants:
            for sp in (False, True) if args.sequence_parallel and tp > 1 else (False,):
                row = {"system": "ours", "tp": tp, "sequence_parallel": sp, "variant": variant}
                out.append((row, ours_command(args, tp, sp, variant), None))
        if args.peer == "megatron":
            # Megatron-LM's launch scripts set it: its TP backward overlaps all-reduces with
            # weight-gradient GEMMs only on one CUDA connection.
            env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
            row = {"system": "megatron-core", "tp": tp, "sequence_parallel": False,
                   "variant": "local spec, SDPA, torch AdamW"}
            out.append((row, peer_command(args, tp), env))
        if args.limit and tp * args.pp * args.dp == 1:
            row = {"system": "limit", "tp": tp, "sequence_parallel": False,
                   "variant": "GEMMs and attention alone, graphed"}
            out.append((row, limit_command(args, tp), None))
    return out


def limit_command(args, tp: int) -> list[str]:
    """benchmarks/step_limit.py: the step's GEMMs and attention alone (one GPU)."""
    return ["torchrun", "--standalone", "--nproc_per_node=1",
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_limit.py"),
            *_shared_flags(args, tp)]


def summary(rows: list[dict]) -> list[dict]:
    """Each (system, tp, sp, variant)'s rounds: median and range of tokens/s and ms/iter, peak
    memory, and against the peer at the same TP the ratio of median tokens/s."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["tp"], r["sequence_parallel"], r["variant"]),
                          []).append(r)
    table = []
    for (system, tp, sp, variant), runs in groups.items():
        good = [r for r in runs if "error" not in r]
        entry = {"system": system, "tp": tp, "sequence_parallel": sp, "variant": variant,
                 "rounds": len(runs), "failed": len(runs) - len(good)}
        if good:
            tokens = [r["tokens_per_s"] for r in good]
            entry.update(tokens_per_s=statistics.median(tokens), tokens_min=min(tokens),
                         tokens_max=max(tokens),
                         ms_per_iter=statistics.median(r["ms_per_iter"] for r in good),
                         mfu_percent=statistics.median(r["mfu_percent"] for r in good),
                         peak_mem_gib=max(r["peak_mem_gib"] for r in good),
                         # auto may choose otherwise in another round: every choice is named
                         fp8_linears=" / ".join(sorted({r.get("fp8_linears", "none")
                                                        for r in good})))
        table.append(entry)
    for entry in table:
        peer = next((e for e in table if e["system"] == "megatron-core" and e["tp"] == entry["tp"]
                     and "tokens_per_s" in e), None)
        if peer and "tokens_per_s" in entry and entry["system"] == "ours":
            entry["vs_peer"] = entry["tokens_per_s"] / peer["tokens_per_s"]
        limit = next((e for e in table if e["system"] == "limit" and e["tp"] == entry["tp"]
                      and "tokens_per_s" in e), None)
        if limit and "tokens_per_s" in entry and entry["system"] != "limit":
            entry["of_limit"] = entry["tokens_per_s"] / limit["tokens_per_s"]
    return table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt3-1.3b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of every run")
    parser.add_argument("--vp", type=int, default=None,
                        help="layers per virtual pipeline stage (interleaved schedule)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size of every run")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="also run each TP > 1 with --sequence-parallel")
    parser.add_argument("--variants", nargs="+", default=[""],
                        help="extra flags per variant, e.g. '' '--domino-batch-slices 2'")
    parser.add_argument("--peer", choices=("megatron",), default=None,
                        help="also run megatron-core's own step on the same shapes")
    parser.add_argument("--limit", action="store_true",
                        help="1-GPU rows: also time the step's GEMMs and attention alone")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-dropout", action="store_true",
                        help="dropout 0 (implied by --peer)")
    parser.add_argument("--out", default="bench_pretrain.json")
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    rows = []
    for index in range(args.rounds):
        todo = launches(args, gpus)
        for row, cmd, env in todo if index % 2 == 0 else todo[::-1]:
            rows.append(run(cmd, {**row, "round": index}, env))
            print("row:", json.dumps(rows[-1]), flush=True)
            table = summary(rows)  # written after every run: a run cut short keeps the rest
            with open(args.out, "w") as f:
                json.dump({"device": device, "gpus": gpus, "torch": torch.__version__,
                           "args": vars(args), "rows": rows, "summary": table}, f, indent=2)
    print(f"\n{args.preset}, seq {args.seq_length}, micro-batch {args.micro_batch_size}, "
          f"PP {args.pp}{f' (vp {args.vp})' if args.vp else ''}, DP {args.dp}, bf16, {device}, "
          f"{args.rounds} round(s): medians [range]")
    print("| system | TP | SP | variant | ms/iter | tokens/s | MFU | peak GiB | vs peer | "
          "of limit | FP8 linears |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for e in table:
        head = f"| {e['system']} | {e['tp']} | {e['sequence_parallel']} | {e['variant'] or '-'} |"
        if "tokens_per_s" not in e:
            print(f"{head} failed ({e['failed']} of {e['rounds']}) |")
            continue
        ratio = f"{e['vs_peer']:.3f}" if "vs_peer" in e else "-"
        of_limit = f"{e['of_limit']:.3f}" if "of_limit" in e else "-"
        print(f"{head} {e['ms_per_iter']:.1f} | {e['tokens_per_s']:.0f} "
              f"[{e['tokens_min']:.0f}-{e['tokens_max']:.0f}] | {e['mfu_percent']:.1f}% | "
              f"{e['peak_mem_gib']:.1f} | {ratio} | {of_limit} | {e['fp8_linears']} |"
              + (f" ({e['failed']} failed)" if e["failed"] else ""))


if __name__ == "__main__":
    sys.exit(main())
