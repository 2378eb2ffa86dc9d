"""FP8 linears (megadomino/tp/fp8.py) against bf16 on one GPU, in one run:

    python3 benchmarks/bench_fp8.py --out DIR

1. Layer time: forward + backward of a stack of GPT-3 6.7B layers at TP = 1 (hidden 4096, 32
   heads, ffn 16384, sequence 2048, micro-batch 4, bf16 parameters, dropout 0), bf16 GEMMs and FP8
   (hybrid; delayed and tensorwise). Median of --iters steps after --warmup, CUDA events; per
   layer = step / --layers. Only the four linears of a layer change; attention (SDPA) and the
   norms stay bf16, so the layer speed-up is below the GEMMs'.
2. Convergence: a tiny GPT (--tiny-* shape) trained --steps steps twice through the training loop,
   same seed and mock-data order, --bf16 with and without --fp8-format hybrid. It passes when
   the mean loss of the last 50 steps is within 1% and no step after step 20 is more than 3%
   apart. Exit status 1 when it does not.

Prints a short table and writes DIR/bench_fp8.json. Needs CUDA (torch >= 2.11: torch._scaled_mm
on sm_89+). Runs as one process (it forms a 1-rank process group itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megadomino.config import (  # noqa: E402
    Config,
    DataConfig,
    FP8Recipe,
    LoggingConfig,
    ModelConfig,
    PrecisionConfig,
    RuntimeConfig,
    ScheduleConfig,
    TrainConfig,
)
from megadomino.distributed import ParallelDims  # noqa: E402
from megadomino.models.transformer import TransformerBlock  # noqa: E402
from megadomino.train.loop import train  # noqa: E402

VARIANTS = {"bf16": None, "fp8 delayed": FP8Recipe("hybrid", "delayed"),
            "fp8 tensorwise": FP8Recipe("hybrid", "tensorwise")}


def layer_config(layers: int) -> ModelConfig:
    """GPT-3 6.7B's layer shape (ffn 4 x 4096 = 16384), bf16 parameters, dropout 0."""
    return ModelConfig.preset("gpt3-6.7b", num_layers=layers, hidden_dropout=0.0,
                              attention_dropout=0.0, params_dtype="bfloat16")


def time_layers(config: ModelConfig, fp8: FP8Recipe | None, dims: ParallelDims,
                micro_batch: int, warmup: int, iters: int) -> list[float]:
    """forward + backward times (ms) of config's layers on x [s, b, h], after warmup."""
    block = TransformerBlock(config, dims, fp8=fp8, device="cuda")
    x = torch.randn(config.seq_length, micro_batch, config.hidden_size, device="cuda",
                    dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn_like(x)

    def step() -> None:
        for param in block.parameters():
            param.grad = None
        x.grad = None
        out = x
        for layer in block.layers:  # the final norm is not a layer's: leave it out
            out = layer(out)
        out.backward(grad_out)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def convergence(args, dims: ParallelDims) -> dict:
    """Loss curves of --steps steps, bf16 and bf16 + FP8 hybrid (delayed), same seed and data."""
    model = ModelConfig.preset("gpt-tiny", num_layers=args.tiny_layers,
                               hidden_size=args.tiny_hidden, num_attention_heads=4,
                               seq_length=args.tiny_seq, max_position_embeddings=args.tiny_seq,
                               hidden_dropout=0.0, attention_dropout=0.0)
    schedule = ScheduleConfig(micro_batch_size=8, global_batch_size=8, train_iters=args.steps,
                              lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, lr_decay_style="cosine",
                              eval_interval=args.steps, eval_iters=1)
    curves = {}
    for name, fp8 in (("bf16", None), ("fp8 hybrid", FP8Recipe("hybrid"))):
        config = Config(model, train=TrainConfig(
            schedule=schedule, precision=PrecisionConfig(bf16=True, fp8=fp8),
            data=DataConfig(mock_data=True), logging=LoggingConfig(log_interval=args.steps),
            runtime=RuntimeConfig(seed=1234)))
        history = train(config, dims, "gpt", log=lambda line: None)
        curves[name] = history["losses"]
    bf16, fp8 = curves["bf16"], curves["fp8 hybrid"]
    tail_bf16, tail_fp8 = statistics.mean(bf16[-50:]), statistics.mean(fp8[-50:])
    tail_gap = abs(tail_fp8 - tail_bf16) / tail_bf16
    step_gaps = [abs(f - b) / b for b, f in zip(bf16[20:], fp8[20:])]
    worst = max(range(len(step_gaps)), key=step_gaps.__getitem__)
    return {"model": {"layers": args.tiny_layers, "hidden": args.tiny_hidden,
                      "seq": args.tiny_seq, "micro_batch": 8},
            "steps": args.steps, "losses": curves,
            "last50_mean": {"bf16": tail_bf16, "fp8 hybrid": tail_fp8},
            "last50_rel_gap": tail_gap, "max_step_rel_gap_after_20": step_gaps[worst],
            "max_gap_step": worst + 21,
            "passed": tail_gap <= 0.01 and step_gaps[worst] <= 0.03}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for bench_fp8.json")
    parser.add_argument("--layers", type=int, default=4, help="6.7B layers timed together")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="timed steps (median; >= 10)")
    parser.add_argument("--steps", type=int, default=300, help="convergence steps (>= 200)")
    parser.add_argument("--tiny-layers", type=int, default=4)
    parser.add_argument("--tiny-hidden", type=int, default=256)
    parser.add_argument("--tiny-seq", type=int, default=256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8.py needs CUDA")
    if args.iters < 10 or args.steps < 200:
        sys.exit("--iters must be >= 10 and --steps >= 200")
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                        ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    dims = ParallelDims(tp=1)
    device = torch.cuda.get_device_name()
    print(f"bench_fp8: {device}, torch {torch.__version__}, CUDA {torch.version.cuda}")

    rows = {}
    for name, fp8 in VARIANTS.items():
        times = time_layers(layer_config(args.layers), fp8, dims, args.micro_batch,
                            args.warmup, args.iters)
        torch.cuda.empty_cache()  # the variant's layers are freed: give the next one the memory
        rows[name] = {"step_ms": times, "median_ms": statistics.median(times),
                      "per_layer_ms": statistics.median(times) / args.layers}
    base = rows["bf16"]["per_layer_ms"]
    print(f"\nGPT-3 6.7B layer, TP 1, seq 2048, micro-batch {args.micro_batch}, "
          f"{args.layers} layers, median of {args.iters}:")
    print(f"{'GEMMs':<16}{'ms / layer':>12}{'vs bf16':>10}")
    for name, row in rows.items():
        print(f"{name:<16}{row['per_layer_ms']:>12.2f}{base / row['per_layer_ms']:>9.2f}x")

    conv = convergence(args, dims)
    print(f"\nconvergence, {args.steps} steps: last-50 mean bf16 "
          f"{conv['last50_mean']['bf16']:.4f}, fp8 {conv['last50_mean']['fp8 hybrid']:.4f} "
          f"(gap {100 * conv['last50_rel_gap']:.2f}%, limit 1%); worst step after 20: "
          f"{100 * conv['max_step_rel_gap_after_20']:.2f}% at step {conv['max_gap_step']} "
          f"(limit 3%): {'PASS' if conv['passed'] else 'FAIL'}")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_fp8.json")
    with open(path, "w") as file:
        json.dump({"device": device, "torch": torch.__version__, "args": vars(args),
                   "layer_time": rows, "convergence": conv}, file, indent=1)
    print(f"wrote {path}")
    dist.destroy_process_group()
    sys.exit(0 if conv["passed"] else 1)


if __name__ == "__main__":
    main()
