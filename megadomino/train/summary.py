"""What a run is, said once at start-up (rank 0): the model and its parameter count, the process
grid (with pipeline stages, the plan's table: a --pipeline-plan's stages differ in TP and DP),
overlap, backend and device (on CPU, the intra-op threads), precision, data, batch and length,
the samples each split is sized to, the LR schedule and seed, the checkpoint and TensorBoard
directories, and the data-parallel engine. `startup_lines` is pure (tested on its own);
`count_parameters` is collective over TP."""

from __future__ import annotations

import torch
from torch import nn

from megadomino.config import CheckpointConfig, Config, FP8Recipe, ScheduleConfig, ZeroConfig
from megadomino.config.batches import sample_counts
from megadomino.config.pipeline_plan import PipelinePlan
from megadomino.config.train import FP8_AUTO, FP8_ROLES
from megadomino.distributed import comm
from megadomino.train.lr_schedule import LRSchedule
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


def _diloco(diloco, dp: int, sites: int) -> str:
    """What DiLoCo adds to the data-parallel line ('' when off)."""
    if not diloco.enabled:
        return ""
    return (f" inside each of {sites} DiLoCo sites of "
            f"{_plural(dp // sites, 'data-parallel rank')}, an outer Nesterov step (lr "
            f"{diloco.outer_lr:g}, momentum {diloco.outer_momentum:g}) across them every "
            f"{_plural(diloco.inner_steps, 'inner step')}, pseudo-gradients sent as "
            f"{diloco.pseudo_grad_dtype}")


def startup_lines(family: str, config: Config, parameters: int, *, world: int, tp: int, pp: int,
                  dp: int, backend: str, device: str, global_batch: int, micro_batches: int,
                  iterations: int, data: str, plan: PipelinePlan | None = None,
                  threads: int | None = None, sites: int = 1) -> list[str]:
    """The start-up summary, one line per subject. tp, dp: rank 0's (a --pipeline-plan's stages
    have their own, which `plan` gives); plan: the pipeline plan when pp > 1, its table printed
    after the parallelism line; threads: a CPU rank's intra-op threads (None on a GPU); sites:
    DiLoCo's sites (1: none)."""
    model, parallel, train = config.model, config.parallel, config.train
    bits = train.precision
    precision = "bf16" if bits.bf16 else "fp16 (dynamic loss scaling)" if bits.fp16 else "fp32"
    if bits.fp8 is not None:
        precision += ", " + fp8_linears(bits.fp8, model.num_layers, precision.split()[0])
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
    split = plan is not None and plan.batch_split  # the micro-batch is the whole pipeline's
    threads_line = f" ({_plural(threads, 'intra-op thread')} a rank)" if threads else ""
    lines = [
        f" model: {family}, {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads ({model.num_query_groups} key/value groups), "
        f"ffn {model.ffn_hidden_size}, seq {model.seq_length}, vocab {model.vocab_size} "
        f"(padded to {model.padded_vocab_size(tp)}): {parameters:,} parameters "
        f"({_count(parameters)})",
        f" parallelism: {_grid(world, tp, pp, dp, plan)}, {backend} on {device}{threads_line}; "
        f"TP overlap: {overlap}",
        *([f" pipeline {line}" for line in plan.table().splitlines()] if plan else []),
        f" data parallelism: {_zero(parallel.zero)}{_diloco(parallel.diloco, dp, sites)}; "
        f"precision: {precision}",
        f" data: {data}{_order(train.data)}; global batch {global_batch} = micro-batch "
        f"{train.schedule.micro_batch_size} x "
        f"{_plural(micro_batches, 'micro-batch', 'micro-batches')}"
        + (" (each stage splits them over its DP ranks)" if split else f" x DP {dp}")
        + f" ({global_batch * model.seq_length:,} tokens){_batch_growth(train.schedule)}; "
        f"{_plural(iterations, 'iteration')}",
        _samples(config, parallel.data_parallel_size(dp)),
        f" schedule: {_lr(train.schedule, iterations, global_batch)}; seed {train.runtime.seed}",
    ]
    paths = _paths(train.checkpoint, train.logging.tensorboard_dir)
    return lines + ([paths] if paths else [])


def fp8_linears(fp8: FP8Recipe, num_layers: int, dtype: str = "bf16") -> str:
    """Which linears of which layers run FP8 (layers numbered from 1) and what stays in `dtype`:
    'FP8 hybrid (delayed scaling) in linears fc1, fc2 of layers 2-23; qkv, proj and layers 1, 24
    in bf16' (benchmarks/bench_pretrain.py records this clause in every row)."""
    head = f"FP8 {fp8.format} ({fp8.recipe} scaling)"
    if fp8.linears == FP8_AUTO:
        return f"{head} in the linears --fp8-linears auto picks at start-up"
    roles = [role for role in FP8_ROLES if role in fp8.linears]
    kept = [role for role in FP8_ROLES if role not in fp8.linears]
    ends = [layer for layer in range(num_layers) if fp8.bf16_layer(layer, num_layers)]
    layers = [layer for layer in range(num_layers) if layer not in ends]
    if not roles or not layers:
        return f"{head} in no linear (every linear in {dtype})"
    high = " and ".join(filter(None, (", ".join(kept), _layers(ends) if ends else "")))
    return (f"{head} in linears {', '.join(roles)} of {_layers(layers)}"
            + (f"; {high} in {dtype}" if high else ""))


def _layers(layers: list[int]) -> str:
    """0-based layer indices as 1-based spans: 'layer 3', 'layers 1-24', 'layers 1, 23-24'."""
    spans: list[list[int]] = []
    for layer in layers:
        if spans and spans[-1][1] == layer - 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    text = ", ".join(f"{a + 1}" if a == b else f"{a + 1}-{b + 1}" for a, b in spans)
    return ("layer " if len(layers) == 1 else "layers ") + text


def _ranks(ranks: tuple[int, ...]) -> str:
    """'rank 2', 'ranks 0-3', or 'ranks 0, 2' when they are not consecutive."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _grid(world: int, tp: int, pp: int, dp: int, plan: PipelinePlan | None) -> str:
    """Megatron's TP x PP x DP grid, or a --pipeline-plan's stages, each its own TP x DP."""
    if plan is None or not plan.batch_split:
        return f"{_plural(world, 'rank')} = TP {tp} x PP {pp} x DP {dp}"
    stages = ", ".join(f"stage {stage.index} TP {stage.tp} x DP {stage.dp} on "
                       f"{_ranks(stage.ranks)}" for stage in plan.stages)
    return (f"{_plural(world, 'rank')} in a pipeline plan of {plan.size} stages "
            f"(--pipeline-plan): {stages}")


def _samples(config: Config, data_dp: int) -> str:
    """The samples the train and validation splits are sized to (Megatron-LM's sizing)."""
    train_samples, valid_samples, _ = sample_counts(config.train.schedule, data_dp)
    line = (f" samples: train {train_samples:,}, validation {valid_samples:,}"
            + (" (no evaluation)" if not valid_samples else "") + ", test not read")
    return line + ("; mock data, generated as read" if config.train.data.mock_data else "")


def _lr(schedule: ScheduleConfig, iterations: int, global_batch: int) -> str:
    """The LR schedule in the run's units: samples with --train-samples, else iterations."""
    lr = LRSchedule.from_config(schedule, iterations, global_batch)
    per = 1 if schedule.train_samples is not None else global_batch
    unit = "sample" if per == 1 else "iteration"

    def at(samples: float) -> str:
        return f"{unit} {samples / per:,.6g}"

    warmup = lr.warmup_steps / per
    text = (f"lr warmup over {warmup:,.6g} {unit}{'' if warmup == 1 else 's'} to "
            if warmup else "lr ") + f"{lr.max_lr:.3E}"
    if lr.decay_style == "constant":
        text += ", then constant"
    elif lr.decay_style == "WSD":
        text += (f", held until {at(lr.decay_steps - lr.wsd_decay_steps)}, "
                 f"{lr.wsd_decay_style} decay to {lr.min_lr:.3E} at {at(lr.decay_steps)}")
    else:
        text += f", {lr.decay_style} decay to {lr.min_lr:.3E} at {at(lr.decay_steps)}"
    if lr.decoupled is not None:
        text += (f" (embedding and output layer: {lr.decoupled[0]:.3E} to "
                 f"{lr.decoupled[1]:.3E})")
    return text


def _paths(checkpoint: CheckpointConfig, tensorboard_dir: str | None) -> str | None:
    """The directories the run reads and writes, those given only."""
    given = []
    if checkpoint.save:
        every = checkpoint.save_interval
        given.append(f"--save {checkpoint.save} ("
                     + (f"every {_plural(every, 'iteration')} and " if every else "")
                     + "at the end)")
    if checkpoint.load:
        given.append(f"--load {checkpoint.load}")
    if tensorboard_dir:
        given.append(f"--tensorboard-dir {tensorboard_dir}")
    return " paths: " + ", ".join(given) if given else None


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
