"""The keys of a DeepSpeed JSON config and what each does here: the table --deepspeed_config is
read by (megadomino.cli.deepspeed_config applies it; docs/deepspeed_config.md lists it).

A row stands for flags (its value, turned into each flag's command-line text, goes through that
flag's parsing, range and refusal), or is a notice (the key only tunes DeepSpeed's own runtime),
or an error unless its value asks for nothing (`accepts`). `wins` says which side a disagreement
with the command line goes to, and why (the rules are in megadomino.cli.deepspeed_config).

Sources (repository@commit path): microsoft/DeepSpeed@38327e07f6 deepspeed/runtime/constants.py
and config.py (top-level keys, fp16 / bf16 keys and defaults), runtime/zero/config.py (the
zero_optimization keys, ZeRO++'s among them), ops/adam/fused_adam.py (Adam's defaults: weight
decay 0, AdamW unless adam_w_mode is false, no AMSGrad), runtime/engine.py (_configure_basic_
optimizer: max_grad_norm refused, torch_adam picks torch's AdamW, other names torch.optim's),
runtime/fp16/loss_scaler.py (consecutive_hysteresis).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ON, OFF, SKIP = "on", "off", "skip"
"""A flag's text for a switch set, a switch unset, and a value that asks for nothing."""
ENGINE = "DeepSpeed's engine reads it only from the JSON"
BATCH = "Megatron-DeepSpeed resets DeepSpeed's batch to --global-batch-size at every step"
OPTIMIZER = "Megatron-DeepSpeed hands DeepSpeed its own optimizer, made from the flags"
AGREE = ""


@dataclass(frozen=True)
class Key:
    """One key of a DeepSpeed JSON config (`path`, dotted) and what it does here."""

    path: str
    kinds: tuple[type, ...] = (object,)
    """The JSON types it takes (true and false are never numbers here)."""
    flags: tuple[str, ...] = ()
    """The flags it stands for; none: a notice, an error, or read by a rule of its own."""
    texts: Callable[[Any], tuple] = lambda value: ()
    """The JSON value as each flag's command-line text, or ON / OFF / SKIP."""
    wins: str = ENGINE
    """Why the JSON (ENGINE) or the flag (BATCH, OPTIMIZER) wins a disagreement; AGREE: an
    error."""
    notice: str = ""
    error: str = ""
    accepts: Callable[[Any], bool] = lambda value: False
    """Error rows: the values that ask for nothing."""


def _text(value: Any) -> tuple:
    return (repr(float(value)) if isinstance(value, float) else str(value),)


def _switch(value: bool) -> tuple:
    return (ON if value else OFF,)


def _optimizer_type(name: str) -> str:
    """DeepSpeed's optimizer names, any case (its Adam is AdamW unless adam_w_mode is false)."""
    kind = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}.get(name.lower())
    if kind is None:
        raise ValueError(f"the {name} optimizer is not implemented: use Adam, AdamW or SGD")
    return kind


def _betas(betas: list) -> tuple:
    if len(betas) != 2 or not all(type(beta) in NUMBER for beta in betas):
        raise ValueError("it must be two numbers, [beta1, beta2]")
    return tuple(repr(float(beta)) for beta in betas)


def _off(value: Any) -> bool:
    """False, 0, or a section whose "enabled" is false or absent."""
    return not value.get("enabled", False) if isinstance(value, dict) else not value


def _map(path, flag, kinds=(int,), texts=_text, wins=ENGINE) -> Key:
    return Key(path, kinds, (flag,), texts, wins)


def _notices(paths: str, text: str) -> list[Key]:
    return [Key(path, notice=text) for path in paths.split()]


def _errors(paths: str, text: str, accepts=_off) -> list[Key]:
    return [Key(path, error=text, accepts=accepts) for path in paths.split()]


def _zero(names: str) -> str:
    return " ".join(f"zero_optimization.{name}" for name in names.split())


NUMBER, SWITCH, NEVER = (int, float), (bool,), (lambda value: False)
LOGGING = ("DeepSpeed's own logging: each --log-interval line has the loss, LR, grad norm, "
           "times, throughput and memory")
COMM = ("data-parallel communication tuning: gradients are reduced in fp32 (all-reduce, or "
        "ZeRO's reduce-scatter) while the backward runs")
ZERO = ("ZeRO tuning: ZeRO here is --zero-stage, gathering and reducing units of layers "
        "(--zero-unit-params, --zero-layers-per-unit)")
OFFLOAD = ("not offloaded: optimizer states and parameters stay on the GPU (offload only saves "
           "GPU memory)")
CHECKPOINTS = ("checkpoint layout: each tensor-parallel rank writes its weights, each "
               "data-parallel rank its optimizer shard")
KERNEL = "the optimizer's kernel and DeepSpeed's checks of it: AdamW and SGD run their own passes"
PERSISTENCE = " ".join(f"{stage3}{name}" for stage3 in ("", "stage3_") for name in (
    "prefetch_bucket_size param_persistence_threshold model_persistence_threshold "
    "max_live_parameters max_reuse_distance module_granularity_threshold "
    "use_all_reduce_for_fetch_params").split())

KEYS: dict[str, Key] = {key.path: key for key in (
    _map("train_micro_batch_size_per_gpu", "--micro-batch-size", wins=AGREE),
    _map("train_batch_size", "--global-batch-size", wins=BATCH),
    Key("gradient_accumulation_steps", (int,)),  # _batch
    _map("gradient_clipping", "--clip-grad", NUMBER),
    Key("bf16.enabled", SWITCH), Key("bfloat16.enabled", SWITCH), Key("fp16.enabled", SWITCH),
    _map("fp16.loss_scale", "--loss-scale", NUMBER, lambda v: (SKIP,) if v == 0 else _text(v)),
    _map("fp16.initial_scale_power", "--initial-loss-scale", (int,), lambda v: _text(2.0 ** v)),
    _map("fp16.loss_scale_window", "--loss-scale-window"),
    _map("fp16.hysteresis", "--hysteresis"),
    _map("fp16.min_loss_scale", "--min-loss-scale", NUMBER),
    *_errors("fp16.consecutive_hysteresis", "refilling the hysteresis after every clean step is "
             "not implemented: only the scale's growth refills it (Megatron's rule)"),
    *_errors("fp16.auto_cast", "autocasting to fp16 is not implemented: the model is fp16"),
    *_errors("fp16.fp16_master_weights_and_grads", "master weights are always fp32"),
    *_notices("bf16.immediate_grad_update bfloat16.immediate_grad_update",
              "gradients accumulate in fp32 buffers as the backward produces them"),
    _map("zero_optimization.stage", "--zero-stage"),
    _map("zero_optimization.zero_quantized_weights", "--zeropp-quantized-weights", SWITCH,
         _switch),
    _map("zero_optimization.zero_hpz_partition_size", "--zeropp-hpz-partition-size"),
    _map("zero_optimization.zero_quantized_gradients", "--zeropp-quantized-gradients", SWITCH,
         _switch),
    *_notices(_zero("zero_quantized_nontrainable_weights"),
              "every weight is trained here: none is non-trainable"),
    *_notices(_zero(f"contiguous_gradients reduce_scatter reduce_bucket_size allgather_bucket_size "
                    f"use_multi_rank_bucket_allreduce allgather_partitions overlap_comm "
                    f"sub_group_size legacy_stage1 round_robin_gradients ignore_unused_parameters "
                    f"memory_efficient_linear override_module_apply log_trace_cache_warnings "
                    f"mics_hierarchical_params_gather allgather_size {PERSISTENCE}"), ZERO),
    *_notices(_zero("offload_optimizer offload_param cpu_offload cpu_offload_param "
                    "cpu_offload_use_pin_memory") + " aio", OFFLOAD),
    *_notices(_zero("gather_16bit_weights_on_model_save stage3_gather_16bit_weights_on_model_save "
                    "stage3_gather_fp16_weights_on_model_save load_from_fp32_weights "
                    "elastic_checkpoint pipeline_loading_checkpoint") + " checkpoint.tag_validation"
              " checkpoint.use_node_local_storage checkpoint.parallel_write nebula", CHECKPOINTS),
    *_errors(_zero("mics_shard_size"), "MiCS sharding is not implemented: --zero-stage 3 shards "
             "over every data-parallel rank (hpZ: zero_hpz_partition_size)", lambda v: v <= 0),
    *_errors(_zero("zeropp_loco_param"), "LoCo-ZeRO++ is not implemented", NEVER),
    *_errors("checkpoint.load_universal", "DeepSpeed universal checkpoints are not read: --load "
             "reads megadomino's and Megatron-LM's"),
    *_errors("data_types.grad_accum_dtype", "gradients always accumulate in fp32",
             lambda v: v in ("fp32", "float32")),
    _map("optimizer.type", "--optimizer", (str,), lambda v: (_optimizer_type(v),), OPTIMIZER),
    _map("optimizer.params.lr", "--lr", NUMBER, wins=OPTIMIZER),
    Key("optimizer.params.betas", (list,), ("--adam-beta1", "--adam-beta2"), _betas, OPTIMIZER),
    _map("optimizer.params.eps", "--adam-eps", NUMBER, wins=OPTIMIZER),
    _map("optimizer.params.weight_decay", "--weight-decay", NUMBER, wins=OPTIMIZER),
    _map("optimizer.params.momentum", "--sgd-momentum", NUMBER, wins=OPTIMIZER),
    *_notices("optimizer.legacy_fusion optimizer.params.torch_adam optimizer.params.set_grad_none "
              "zero_allow_untested_optimizer zero_force_ds_cpu_optimizer", KERNEL),
    *_errors("optimizer.params.adam_w_mode", "Adam with L2 regularization is not implemented: "
             "Megatron's adam is AdamW", bool),
    *_errors("optimizer.params.bias_correction", "Adam without bias correction is not "
             "implemented", bool),
    *_errors("optimizer.params.amsgrad", "AMSGrad is not implemented"),
    *_errors("optimizer.params.max_grad_norm", "DeepSpeed refuses it too: use gradient_clipping",
             NEVER),
    *_errors("optimizer.params.dampening", "SGD dampening is not implemented"),
    *_errors("optimizer.params.nesterov", "Nesterov momentum is not implemented"),
    Key("scheduler", (dict,)),  # _optimizer
    *_notices("steps_per_print wall_clock_breakdown memory_breakdown dump_state flops_profiler "
              "timers comms_logger", LOGGING),
    *_notices("tensorboard wandb csv_monitor comet", "DeepSpeed's monitors are not written: "
              "--tensorboard-dir writes Megatron's TensorBoard scalars"),
    *_notices("prescale_gradients gradient_predivide_factor communication_data_type "
              "seq_parallel_comm_data_type disable_allgather sparse_gradients", COMM),
    *_notices("activation_checkpointing", "DeepSpeed activation checkpointing: recompute is "
              "--recompute-granularity / --recompute-method; activations are not partitioned"),
    *_notices("pipeline", "DeepSpeed pipeline-engine tuning: stages here send whole activations"),
    *_notices("dataloader_drop_last", "read by DeepSpeed's data loader, which Megatron-DeepSpeed "
              "does not use"),
    *_notices("vocabulary_size", "DeepSpeed only warns with it: the vocabulary comes from the "
              "tokenizer or --vocab-size"),
    *_notices("autotuning", "DeepSpeed's autotuner runs only under its own launcher"),
    *_errors("amp", "Apex AMP is not implemented: enable bf16 or fp16"),
    *_errors("sparse_attention", "block-sparse attention is not implemented", NEVER),
    *_errors("compression_training", "compression training is not implemented", NEVER),
    *_errors("curriculum_learning", "curriculum learning is not implemented"),
    *_errors("data_efficiency", "DeepSpeed's data efficiency (curriculum sampling, random-LTD) is "
             "not implemented"),
    *_errors("progressive_layer_drop", "progressive layer dropping is not implemented"),
    *_errors("eigenvalue", "eigenvalue-based quantization (MoQ) is not implemented"),
    *_errors("elasticity", "elastic training is not implemented: the batch is train_batch_size "
             "or --global-batch-size"),
    *_errors("hybrid_engine", "DeepSpeed's hybrid engine (RLHF generation) is not implemented"),
)}
"""Every key the file may hold."""
SECTIONS = ("fp16", "bf16", "bfloat16", "zero_optimization", "optimizer", "optimizer.params",
            "checkpoint", "data_types")
"""Objects whose keys are rows of their own."""
ADAM_ONLY = ("betas", "eps", "adam_w_mode", "bias_correction", "amsgrad", "torch_adam",
             "set_grad_none")
SGD_ONLY = ("momentum", "dampening", "nesterov")
DEFAULTS = {"adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
            "sgd": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0}}
"""DeepSpeed's optimizers' parameters when the JSON leaves them out (FusedAdam's; torch's SGD;
with torch_adam, torch's AdamW, whose weight decay is 0.01)."""
OPTIMIZER_FLAGS = ("--optimizer", "--lr", "--weight-decay", "--adam-beta1", "--adam-beta2",
                   "--adam-eps", "--sgd-momentum", "--min-lr", "--lr-decay-style",
                   "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-iters",
                   "--lr-warmup-samples", "--lr-warmup-fraction", "--lr-wsd-decay-style",
                   "--lr-wsd-decay-iters", "--lr-wsd-decay-samples")
"""The flags Megatron-DeepSpeed builds its optimizer and LR scheduler from."""

