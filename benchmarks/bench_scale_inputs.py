"""The scale model's missing inputs (benchmarks/scale_model.py), measured: each preset's layer at
each TP shard's shapes on one GPU, and NCCL bus bandwidth over a range of message sizes.

    torchrun --nproc_per_node 1 benchmarks/bench_scale_inputs.py layers --out layers.json
    torchrun --nproc_per_node 2 benchmarks/bench_scale_inputs.py busbw --out busbw_2.json
    torchrun --nproc_per_node 4 benchmarks/bench_scale_inputs.py busbw --out busbw_4.json
    # CPU, tiny: python3 -m torch.distributed.run --nproc_per_node 2 \
    #   benchmarks/bench_scale_inputs.py busbw --max-mib 1 ; ... layers --seq 64 --layers 1 \
    #   --presets gpt-tiny --tp-shapes 1,2

`layers`: our plain layer (bench_domino.ours, eager; dropout 0), forward + backward, at a TP
shard's shapes: one GPU computes what one rank of TP t does when heads, key/value groups and
the FFN width are divided by t (hidden and head size kept), its collectives absent. Entries in
the calibration's "layer" format (preset, tp_shape, micro_batch, ms).
`busbw`: domino_links.measure_collectives over every rank, messages from 1 MiB to --max-mib,
entries in the calibration's "busbw" format (gpus, bytes, collective, bus_gbps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import domino_links as links  # noqa: E402
from bench_domino import make_step, ours, time_step  # noqa: E402

from megadomino.config import ModelConfig, ParallelConfig  # noqa: E402
from megadomino.distributed import ParallelDims  # noqa: E402
from megadomino.models.blocks import rotary_tables  # noqa: E402


def shard_config(preset: str, tp: int, args: argparse.Namespace) -> ModelConfig:
    """One TP rank's layer shapes as a TP-1 model (module docstring)."""
    base = ModelConfig.preset(preset)
    return ModelConfig.preset(
        preset, num_layers=args.layers, seq_length=args.seq, max_position_embeddings=args.seq,
        hidden_dropout=0.0, attention_dropout=0.0, kv_channels=base.kv_channels,
        num_attention_heads=base.num_attention_heads // tp,
        num_query_groups=max(1, base.num_query_groups // tp),
        ffn_hidden_size=base.ffn_hidden_size // tp, params_dtype=args.dtype)


def time_layer(config: ModelConfig, micro_batch: int, args, device) -> float:
    """Milliseconds of one layer's forward + backward (median over --iters)."""
    dtype = getattr(torch, args.dtype)
    x = torch.randn(config.seq_length, micro_batch, config.hidden_size, device=device,
                    dtype=dtype).requires_grad_()
    rotary = None
    if config.position_embedding_type == "rope":
        cos, sin = rotary_tables(config.seq_length, config.kv_channels, config.rotary_base,
                                 device)
        rotary = (cos[:, None, None, :], sin[:, None, None, :])
    block, forward = ours(config, ParallelDims(tp=1), rotary, ParallelConfig(), device)
    params = [p for p in block.parameters() if p.requires_grad]
    step = make_step(block, forward, x, torch.randn_like(x), params)
    ms, _ = time_step(step, args.warmup, args.iters, device)
    return ms / config.num_layers


def layers(args: argparse.Namespace, device: torch.device) -> list[dict]:
    rows = []
    for preset in args.presets.split(","):
        for tp in map(int, args.tp_shapes.split(",")):
            for micro_batch in map(int, args.micro_batches.split(",")):
                ms = time_layer(shard_config(preset, tp, args), micro_batch, args, device)
                rows.append({"preset": preset, "tp_shape": tp, "micro_batch": micro_batch,
                             "seq": args.seq, "ms": ms, "column": "eager"})
                print(f"{preset} tp shape {tp} micro-batch {micro_batch}: {ms:.3f} ms/layer",
                      flush=True)
    return rows


def busbw(args: argparse.Namespace, device: torch.device) -> list[dict]:
    sizes, size = [], 1 << 20
    while size <= args.max_mib << 20:
        sizes.append(size // 2)  # bf16 elements
        size *= 4
    measured = links.measure_collectives(sizes, torch.bfloat16, device)
    world = dist.get_world_size()
    return [{"gpus": world, "bytes": row["bytes"], "collective": name,
             "bus_gbps": result["bus_gbps"]}
            for row in measured.values() for name, result in row.items()
            if isinstance(result, dict) and "bus_gbps" in result]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("layers", "busbw"))
    parser.add_argument("--presets", default="gpt3-1.3b,gpt3-6.7b,llama2-7b")
    parser.add_argument("--tp-shapes", default="1,2,4,8")
    parser.add_argument("--micro-batches", default="1,2,4")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--max-mib", type=int, default=1024)
    parser.add_argument("--out", default="scale_inputs.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    args.dtype = "bfloat16" if cuda else "float32"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    rows = layers(args, device) if args.what == "layers" else busbw(args, device)
    if dist.get_rank() == 0:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu",
                       "torch": torch.__version__, "args": vars(args), args.what: rows},
                      file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
