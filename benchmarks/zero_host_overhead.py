"""Host time of the ZeRO gradient path: what the engine's per-parameter hooks cost per backward.

    python benchmarks/zero_host_overhead.py [--layers 24 --hidden-size 32 --dtype bfloat16]
                                            [--backwards 200 --out host.json]
    torchrun --standalone --nproc_per_node 2 benchmarks/zero_host_overhead.py

CPU, gloo; one process (DP=1) when not started by torchrun. A GPT with many tiny layers (hidden
32, micro-batch 1, 16 tokens: 12 parameters a layer, 292 at 24 layers, as GPT-3 1.3B) makes
backward cheap, so that the engine's host work stands out, as it does on a GPU at micro-batch 1
(on the CPU the tensor ops' own compute is counted too: keep the model tiny). DP=2 adds gloo's
collectives (and their waits, inside the hooks) on 2 ranks sharing the cores: noisier.
For stage 3 and stage 1 it times, per backward (`engine.backward`, `--micro-batches` per step,
all but the last under `no_sync()`):
  hooks   time inside `GradReducer._on_grad` (every post-accumulate-grad hook, with the
          reductions they launch),
  finish  time inside `GradReducer.finish` (the reductions left to launch, and the waits),
  grads   hooks + finish: the host cost of the gradient path,
  backward  wall time of `engine.backward` (autograd, re-gathers, hooks, finish);
and `plain`, the same model's `loss.backward()` without an engine (autograd's own floor).
Medians (and minima) over `--backwards` backwards after a warm-up, rank 0's numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megadomino.build import build_model
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.zero import ZeroConfig, ZeroPlusPlus
from megadomino.zero.grads import GradReducer

VOCAB, SEQ = 512, 16


class Timer:
    """Seconds accumulated inside the wrapped functions since the last `take()`."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def init_distributed() -> None:
    if "RANK" not in os.environ:  # one process: DP=1
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo")


def build(args: argparse.Namespace, dims: ParallelDims) -> torch.nn.Module:
    config = ModelConfig.preset("gpt-tiny", num_layers=args.layers, hidden_size=args.hidden_size,
                                num_attention_heads=4, seq_length=SEQ,
                                max_position_embeddings=SEQ, hidden_dropout=0.0,
                                attention_dropout=0.0, params_dtype=args.dtype)
    model_parallel_seed(1234, dims)
    return build_model(config, dims, "gpt", device="cpu")


def batch(dims: ParallelDims, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * dims.dp + dims.dp_rank)
    samples = torch.randint(0, VOCAB, (1, SEQ + 1), generator=gen)
    return samples[:, :-1], samples[:, 1:]


def measure_engine(args: argparse.Namespace, dims: ParallelDims, stage: int) -> dict:
    hooks, finish = Timer(), Timer()
    original = GradReducer._on_grad, GradReducer.finish
    # Patched before the engine registers its hooks, so that they call the timed version.
    GradReducer._on_grad, GradReducer.finish = hooks.wrap(original[0]), finish.wrap(original[1])
    try:
        engine = ZeroPlusPlus(build(args, dims), dims,
                              functools.partial(torch.optim.AdamW, lr=1e-4),
                              ZeroConfig(stage=stage, layers_per_unit=1))
        rows = []
        for step in range(args.warmup + args.backwards // args.micro_batches + 1):
            for micro in range(args.micro_batches):
                deferred = micro < args.micro_batches - 1
                tokens, labels = batch(dims, step)
                with engine.no_sync() if deferred else contextlib.nullcontext():
                    loss = engine(tokens, labels=labels).mean()
                    hooks.take()  # forward's share (none) discarded
                    finish.take()
                    start = time.perf_counter()
                    engine.backward(loss / args.micro_batches)
                    wall = time.perf_counter() - start
                if step >= args.warmup:
                    rows.append((hooks.take(), finish.take(), wall))
            engine.step()
    finally:
        GradReducer._on_grad, GradReducer.finish = original
    rows = rows[:args.backwards]
    hook_s, finish_s, wall_s = zip(*rows)
    grads_s = [h + f for h, f in zip(hook_s, finish_s)]
    return {"hooks": summary(hook_s), "finish": summary(finish_s), "grads": summary(grads_s),
            "backward": summary(wall_s),
            "params": sum(len(u.params) for u in engine.units), "units": len(engine.units)}


def measure_plain(args: argparse.Namespace, dims: ParallelDims) -> dict:
    model = build(args, dims)
    walls = []
    for step in range(args.warmup + args.backwards):
        tokens, labels = batch(dims, step)
        loss = model(tokens, labels=labels).mean()
        start = time.perf_counter()
        loss.backward()
        walls.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"backward": summary(walls[args.warmup:])}


def summary(seconds) -> dict:
    ms = [1e3 * s for s in seconds]
    return {"median_ms": round(statistics.median(ms), 4), "min_ms": round(min(ms), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--backwards", type=int, default=200, help="timed backwards per stage")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--out", help="write the numbers as JSON here (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_distributed()
    dims = ParallelDims(tp=1)
    result = {"dp": dims.dp, "args": vars(args), "plain": measure_plain(args, dims)}
    for stage in (3, 1):
        result[f"stage{stage}"] = measure_engine(args, dims, stage)
    if dims.rank == 0:
        print(f"DP={dims.dp}, {result['stage3']['params']} parameters in "
              f"{result['stage3']['units']} units, {args.dtype}, ms per backward "
              "(median / min):")
        print(f"  plain loss.backward(): {fmt(result['plain']['backward'])}")
        for stage in (3, 1):
            row = result[f"stage{stage}"]
            print(f"  stage {stage}: " + ", ".join(f"{key} {fmt(row[key])}" for key in
                                                     ("hooks", "finish", "grads", "backward")))
        if args.out:
            with open(args.out, "w") as file:
                json.dump(result, file, indent=1)
    dist.destroy_process_group()


def fmt(row: dict) -> str:
    return f"{row['median_ms']:.3f} / {row['min_ms']:.3f}"


if __name__ == "__main__":
    main()
