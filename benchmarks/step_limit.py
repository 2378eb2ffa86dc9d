"""The limit column of benchmarks/bench_pretrain.py (`--limit`) on one GPU: a training step's GEMMs
and attention alone, at their real shapes, forward and backward, replayed from a CUDA graph (no
host time), for every micro-batch of the step. No element-wise work, no optimizer, no data:
what no fusion or overlap can go below.

Per micro-batch: each layer's QKV, projection, fc1 and fc2 GEMMs and its causal SDPA
(bench_layer_tp1.GemmsAndAttention) and the output layer's logits GEMM (hidden x padded
vocabulary), each with its two backward GEMMs; the step is that times the micro-batches of one
rank's share of the global batch. Takes the flags both columns take (megatron_pretrain.parse)
and prints one log line in their format (train/report.py), so bench_pretrain.py parses it as a
third column:

    torchrun --nproc_per_node 1 benchmarks/step_limit.py --model-preset gpt3-1.3b \\
        --micro-batch-size 2 --global-batch-size 16
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_domino import make_step, time_step  # noqa: E402
from bench_layer_tp1 import GemmsAndAttention  # noqa: E402
from megatron_pretrain import model_config, parse  # noqa: E402
from timeline import graphed  # noqa: E402

from megadomino.train.metrics import (  # noqa: E402
    num_floating_point_operations,
    peak_memory_gib,
    peak_tflops,
    throughput,
)


class StepGemms(torch.nn.Module):
    """A micro-batch's GEMMs and attention: the layers' (GemmsAndAttention) and the logits."""

    def __init__(self, config, padded_vocab: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(GemmsAndAttention(config)
                                          for _ in range(config.num_layers))
        self.output = torch.nn.Parameter(torch.randn(padded_vocab, config.hidden_size,
                                                     device="cuda", dtype=torch.bfloat16) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.linear(x, self.output)


def main() -> None:
    args = parse()
    if args.tensor_model_parallel_size * args.pipeline_model_parallel_size != 1:
        raise SystemExit("step_limit.py times one GPU's step: TP and PP must be 1")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    if dist.get_world_size() != 1:
        raise SystemExit("step_limit.py runs on one GPU (the DP rows' limit is not this)")
    config = model_config(args)
    padded = config.padded_vocab_size(1)
    gemms = StepGemms(config, padded)
    x = torch.randn(args.seq_length, args.micro_batch_size, config.hidden_size, device="cuda",
                    dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(args.seq_length, args.micro_batch_size, padded, device="cuda",
                       dtype=torch.bfloat16)
    step = graphed(make_step(gemms, gemms, x, grad, list(gemms.parameters()), keep_grads=True))
    micro_ms, _ = time_step(step, warmup=3, iters=10)
    micro_batches = args.global_batch_size // args.micro_batch_size
    seconds = micro_ms * micro_batches / 1e3
    flops = num_floating_point_operations(config, args.global_batch_size, padded)
    metrics = throughput(flops, args.global_batch_size * args.seq_length, seconds, 1,
                         peak_tflops(torch.cuda.get_device_name(), args.peak_tflops))
    mfu = f"MFU {100 * metrics['mfu']:.2f}% | " if "mfu" in metrics else ""
    print(f" iteration {args.train_iters:8d}/{args.train_iters:8d} | loss {0.0:.6E} | "
          f"lr {0.0:.3E} | global batch {args.global_batch_size} | grad norm {0.0:.3f} | "
          f"{1e3 * seconds:.1f} ms/iter | {metrics['tokens_per_s']:.0f} tokens/s | "
          f"{metrics['tflops_per_gpu']:.2f} TFLOP/s/GPU | {mfu}"
          f"peak mem {peak_memory_gib(torch.device('cuda')):.2f} GiB", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
