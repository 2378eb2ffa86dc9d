"""What a run is, said once at start-up (rank 0): the model and its parameter count, the process
grid, overlap, backend and device, precision, data, batch and length, and the data-parallel
engine. `startup_lines` is pure (tested on its own); `count_parameters` is collective over TP."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megadomino.config import ModelConfig, TrainConfig
from megadomino.training.pad_rows import first_pad_row
from megadomino.zero.config import ZeroConfig


def count_parameters(model: nn.Module, dims) -> int:
    """The model's parameters over all TP ranks, as the dense model has them: tensor-parallel
    shards summed over the TP group, replicated parameters once, vocabulary padding rows left
    out. Collective over the TP group (every rank calls it, with whole parameters)."""
    sharded = replicated = 0
    for param in model.parameters():
        if not getattr(param, "tensor_model_parallel", False):
            replicated += param.numel()
            continue
        first = first_pad_row(param, param.shape[0], dims.tp_rank)
        sharded += param.numel() if first is None else first * param[0].numel()
    total = torch.tensor([sharded], dtype=torch.float64)
    if dims.tp > 1:
        dist.all_reduce(total, group=dims.tp_group)
    return int(total.item()) + replicated


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _zero(zero: ZeroConfig) -> str:
    if zero.stage == 0:
        return "ZeRO stage 0 (plain data parallelism: bucketed all-reduce during backward)"
    options = [name for name, on in (("qwZ", zero.quantized_weights), ("hpZ", zero.hpz),
                                     ("qgZ", zero.quantized_gradients)) if on]
    return f"ZeRO stage {zero.stage}" + (f" with {', '.join(options)}" if options else "")


def startup_lines(family: str, model: ModelConfig, train: TrainConfig, parameters: int, *,
                  world: int, tp: int, pp: int, dp: int, backend: str, device: str,
                  zero: ZeroConfig, global_batch: int, micro_batches: int, iterations: int,
                  data: str) -> list[str]:
    """The start-up summary, one line per subject."""
    precision = "bf16" if train.bf16 else "fp16 (dynamic loss scaling)" if train.fp16 else "fp32"
    if model.fp8 is not None:
        precision += f", FP8 {model.fp8} ({model.fp8_recipe} scaling) in the layers' linears"
    layout = ["sequence parallel" if model.sequence_parallel else None,
              "CUDA graphs" if model.enable_cuda_graph else None,
              f"recompute {model.recompute_granularity}" if model.recompute_granularity else None]
    overlap = model.overlap + ("".join(f", {x}" for x in layout if x))
    if train.domino_auto:
        overlap += " (--domino: the fastest plan is timed at start-up)"
    return [
        f" model: {family}, {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads ({model.num_query_groups} key/value groups), "
        f"ffn {model.ffn_hidden_size}, seq {model.seq_length}, vocab {model.vocab_size} "
        f"(padded to {model.padded_vocab_size(tp)}): {_count(parameters)} parameters",
        f" parallelism: {world} ranks = TP {tp} x PP {pp} x DP {dp}, {backend} on {device}; "
        f"TP overlap: {overlap}",
        f" data parallelism: {_zero(zero)}; precision: {precision}",
        f" data: {data}; global batch {global_batch} = micro-batch {train.micro_batch_size} x "
        f"{micro_batches} micro-batches x DP {dp} ({global_batch * model.seq_length} tokens); "
        f"{iterations} iterations",
    ]
