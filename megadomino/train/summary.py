"""What a run is, said once at start-up (rank 0): the model and its parameter count, the process
grid, overlap, backend and device, precision, data, batch and length, and the data-parallel
engine. `startup_lines` is pure (tested on its own); `count_parameters` is collective over TP."""

from __future__ import annotations

import torch
from torch import nn

from megadomino.config import Config, ZeroConfig
from megadomino.distributed import comm
from megadomino.train.pad_rows import first_pad_row


def count_parameters(model: nn.Module, dims) -> int:
    """The model's parameters over all TP ranks, as the dense model has them: tensor-parallel
    shards summed over the TP group, replicated parameters once, vocabulary padding rows left
    out. Collective over the TP group (every rank calls it, with whole parameters); with
    pipeline stages, summed over the pipeline group too (the last stage's copy of a tied
    embedding counted once)."""
    sharded = replicated = 0
    for param in model.parameters():
        if getattr(param, "pipeline_duplicate", False):
            continue
        if not getattr(param, "tensor_model_parallel", False):
            replicated += param.numel()
            continue
        first = first_pad_row(param, param.shape[0], dims.tp_rank)
        sharded += param.numel() if first is None else first * param[0].numel()
    total = torch.tensor([sharded], dtype=torch.float64)
    if dims.tp > 1:
        comm.all_reduce(total, group=dims.tp_group)
    total += replicated
    if dims.pp > 1:  # each stage's count once (ParallelDims.pp_replicas)
        total /= dims.pp_replicas
        comm.all_reduce(total, group=dims.pp_group)
    return round(total.item())


def _count(n: float) -> str:
    """Three significant digits and a unit: 136960 -> '137K', 1.3e9 -> '1.3B'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def _plural(n: int, noun: str, nouns: str | None = None) -> str:
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def _zero(zero: ZeroConfig) -> str:
    """The engine's stage and the options in effect."""
    if zero.stage == 0:
        return (f"ZeRO stage 0 (plain data parallelism: all-reduce in buckets of "
                f"{_count(zero.bucket_numel)} elements, overlapped with backward)")
    sharded = ("optimizer states and fp32 masters" if zero.stage == 1
               else "parameters, gradients, optimizer states and fp32 masters")
    options = [f"{sharded} sharded over DP"]
    if zero.quantized_weights:
        options.append(f"qwZ int{zero.weight_bits} weights")
    if zero.hpz:
        options.append(f"hpZ secondary copy over {zero.hpz_partition_size} ranks")
    if zero.quantized_gradients:
        options.append(f"qgZ int{zero.gradient_bits} gradients")
    if zero.quantized_weights or zero.quantized_gradients:
        options.append(f"blocks of {zero.block_size}" + (
            ", full range" if zero.quantize_full_range else ""))
    if zero.reduce_dtype != "float32":
        options.append(f"gradients reduced in {zero.reduce_dtype}")
    options.append(f"{_plural(zero.layers_per_unit, 'layer')} a unit" if zero.layers_per_unit
                   else f"units of {_count(zero.unit_params)} parameters")
    return f"ZeRO stage {zero.stage} ({', '.join(options)})"


def startup_lines(family: str, config: Config, parameters: int, *, world: int, tp: int, pp: int,
                  dp: int, backend: str, device: str, global_batch: int, micro_batches: int,
                  iterations: int, data: str) -> list[str]:
    """The start-up summary, one line per subject."""
    model, parallel, train = config.model, config.parallel, config.train
    bits = train.precision
    precision = "bf16" if bits.bf16 else "fp16 (dynamic loss scaling)" if bits.fp16 else "fp32"
    if bits.fp8 is not None:
        precision += (f", FP8 {bits.fp8.format} ({bits.fp8.recipe} scaling) in the layers' "
                      "linears")
    overlap = parallel.overlap
    if parallel.domino_auto:
        overlap += " (--domino: the fastest plan is timed at start-up)"
    recompute = parallel.recompute_granularity
    if recompute == "full":
        recompute += (f" ({parallel.recompute_method}, "
                      f"{_plural(parallel.recompute_num_layers, 'layer')})")
    layout = [x for x in ("sequence parallel" if parallel.sequence_parallel else None,
                          "CUDA graphs" if parallel.enable_cuda_graph else None,
                          "compiled layer pieces" if parallel.compile_layer_pieces else None,
                          f"recompute {recompute}" if recompute else None) if x]
    if layout:
        overlap += f"; {', '.join(layout)}"
    if pp > 1:
        chunks = parallel.virtual_chunks(model.num_layers)
        overlap += f"; pipeline schedule {parallel.pipeline_schedule}" + (
            f", {chunks} model chunks a stage" if chunks > 1 else "")
    return [
        f" model: {family}, {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads ({model.num_query_groups} key/value groups), "
        f"ffn {model.ffn_hidden_size}, seq {model.seq_length}, vocab {model.vocab_size} "
        f"(padded to {model.padded_vocab_size(tp)}): {parameters:,} parameters "
        f"({_count(parameters)})",
        f" parallelism: {_plural(world, 'rank')} = TP {tp} x PP {pp} x DP {dp}, {backend} on "
        f"{device}; TP overlap: {overlap}",
        f" data parallelism: {_zero(parallel.zero)}; precision: {precision}",
        f" data: {data}{_order(train.data)}; global batch {global_batch} = micro-batch "
        f"{train.schedule.micro_batch_size} x "
        f"{_plural(micro_batches, 'micro-batch', 'micro-batches')} x DP {dp} "
        f"({global_batch * model.seq_length:,} tokens){_batch_growth(train.schedule)}; "
        f"{_plural(iterations, 'iteration')}",
    ]


def _order(data) -> str:
    """How the samples are read, when not consecutively."""
    if data.dataloader_type == "single":
        return ""
    return (f", read in {data.dataloader_type} order "
            f"({'data sharding' if data.data_sharding else 'no data sharding'})")


def _batch_growth(schedule) -> str:
    """How the global batch grows before it reaches the line's, if it does."""
    if schedule.rampup_batch_size is not None:
        start, increment, samples = schedule.rampup_batch_size
        return f", ramped up from {start} by {increment} over {samples:,} samples"
    if schedule.step_batch_size_schedule is not None:
        return ", stepped: " + ", ".join(f"{batch} from sample {threshold:,}" for threshold, batch
                                         in schedule.step_batch_size_schedule)
    return ""
