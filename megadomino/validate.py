"""The one validator: every rule a configuration must meet, each checked once, in pure
arithmetic on the configs (and a look at --save's directory), so that every rank refuses alike
with one line naming the flag before any collective starts. The command line runs it after
parsing (`training.arguments.parse_args`) and again with the world size at launch; the library's
`training.loop.train` runs it with the process grid's world before it builds anything.

    validate(model_config, train_config)                      # the configs alone
    validate(model_config, train_config, world_size, gpus_per_node)   # and the process grid

Also here: the arithmetic the loop derives from a valid config (`batch_plan`,
`train_iterations`) and the data-parallel engine's config (`zero_config`).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from megadomino.config import ConfigError, ModelConfig, TrainConfig
from megadomino.domino.plan import validate_plan
from megadomino.parallel.dims import check_degrees, check_gpus_per_node
from megadomino.zero.config import ZeroConfig


def validate(model_config: ModelConfig, train_config: TrainConfig, world_size: int | None = None,
             gpus_per_node: int | None = None, *, finetune: bool = False,
             data_given: bool = False) -> None:
    """Raise ConfigError (naming the flag, the value and what works) if the configs cannot run;
    with `world_size`, also on that many ranks, `gpus_per_node` of them a node (None: all of
    them, unless --gpus-per-node says otherwise). `finetune`: finetune_llama.py's rules;
    `data_given`: datasets are handed to train(), so no data flag is needed."""
    _train_rules(train_config, finetune, data_given)
    _model_rules(model_config, train_config)
    if world_size is not None:
        _world_rules(model_config, train_config, world_size, gpus_per_node)


def _model_rules(model_config: ModelConfig, train_config: TrainConfig) -> None:
    """The architecture at the run's TP degree, and what the overlap and ZeRO choices allow."""
    if train_config.pipeline_model_parallel_size != 1:
        raise ConfigError("--pipeline-model-parallel-size > 1 is not supported: use 1")
    model_config.validate(tp=train_config.tensor_model_parallel_size)
    if train_config.domino_auto and model_config.fp8 is not None:
        raise ConfigError("--domino-batch-slices auto may pick a Domino plan, whose schedule "
                          "runs high-precision GEMMs: it is off with --fp8-format")
    if train_config.domino_auto and model_config.enable_cuda_graph:
        raise ConfigError("--domino-batch-slices auto may pick a Domino plan, which "
                          "--enable-cuda-graph cannot capture: give one of them")
    zero_config(model_config, train_config)


def _world_rules(model_config: ModelConfig, train_config: TrainConfig, world_size: int,
                 local_world_size: int | None) -> None:
    """On `world_size` ranks, `local_world_size` of them a node (None: all of them) unless
    --gpus-per-node says otherwise: the world must tile into TP x PP x DP, a TP group must fit in
    a node, the Domino plan in the micro-batch, the global batch must be a multiple of micro batch
    x DP and give at least one iteration, and hpZ's partition must be a node's DP ranks."""
    tp = train_config.tensor_model_parallel_size
    pp = train_config.pipeline_model_parallel_size
    dp = world_size // (tp * pp) if tp >= 1 and pp >= 1 and world_size % (tp * pp) == 0 else -1
    check_degrees(world_size, tp, pp, dp)
    if train_config.gpus_per_node is not None:
        check_gpus_per_node(world_size, tp, train_config.gpus_per_node)
    global_batch, _ = batch_plan(train_config, dp)
    train_iterations(train_config, global_batch)
    validate_plan(model_config, tp, train_config.micro_batch_size)
    if train_config.profile:
        outside = [r for r in train_config.profile_ranks if not 0 <= r < world_size]
        if outside:
            raise ConfigError(f"--profile-ranks {outside[0]} is invalid: ranks are 0 to "
                              f"{world_size - 1}")
    gpus = train_config.gpus_per_node or local_world_size or world_size
    # The DP ranks of one node, as ParallelDims cuts the grid.
    zero_config(model_config, train_config).check_dims(
        SimpleNamespace(tp=tp, gpus_per_node=gpus, dp_per_node=max(1, min(dp, gpus // tp))))


def zero_config(model_config: ModelConfig, train_config: TrainConfig) -> ZeroConfig:
    """The ZeroConfig that --zero-stage (0, plain data parallelism, by default) and the --zeropp-*
    flags ask for. ConfigError naming the flag for a ZeRO++ flag without the stage it needs, one
    with nothing to act on, or ZeRO-3 with Domino (whose schedule bypasses the hooks that gather
    each layer). hpZ's partition size against the node: validate() with the world."""
    config = train_config
    given = {"--zeropp-quantized-weights": config.zeropp_quantized_weights,
             "--zeropp-hpz-partition-size": config.zeropp_hpz_partition_size is not None,
             "--zeropp-quantized-gradients": config.zeropp_quantized_gradients,
             "--zeropp-gradient-bits": config.zeropp_gradient_bits is not None,
             "--zeropp-block-size": config.zeropp_block_size is not None,
             "--zeropp-quantize-full-range": config.zeropp_quantize_full_range,
             "--zero-layers-per-unit": config.zero_layers_per_unit is not None,
             "--zero-unit-params": config.zero_unit_params is not None}
    if config.zero_stage == 0:
        flag = next((flag for flag, on in given.items() if on), None)
        if flag is not None:
            raise ConfigError(f"{flag} is a ZeRO option: add --zero-stage 3 (or --zero-stage 1 "
                              "for --zeropp-quantized-gradients, --zero-layers-per-unit and "
                              "--zero-unit-params)")
        return ZeroConfig(stage=0, bucket_numel=config.ddp_bucket_size)
    if given["--zeropp-gradient-bits"] and not config.zeropp_quantized_gradients:
        raise ConfigError("--zeropp-gradient-bits sets qgZ's precision: add "
                          "--zeropp-quantized-gradients")
    if given["--zeropp-block-size"] and not (config.zeropp_quantized_weights
                                             or config.zeropp_quantized_gradients):
        raise ConfigError("--zeropp-block-size sets the blocks of qwZ and qgZ: add "
                          "--zeropp-quantized-weights or --zeropp-quantized-gradients")
    if given["--zeropp-quantize-full-range"] and not (config.zeropp_quantized_weights
                                                      or config.zeropp_quantized_gradients):
        raise ConfigError("--zeropp-quantize-full-range sets how qwZ and qgZ quantize: add "
                          "--zeropp-quantized-weights or --zeropp-quantized-gradients")
    if given["--zero-layers-per-unit"] and given["--zero-unit-params"]:
        raise ConfigError(f"--zero-layers-per-unit {config.zero_layers_per_unit} fixes the layers "
                          f"a unit, --zero-unit-params {config.zero_unit_params} sizes units by "
                          "parameters: give one of them")
    if config.zero_stage == 3 and model_config.enable_cuda_graph:
        raise ConfigError("--enable-cuda-graph captures the layers, but --zero-stage 3 gathers "
                          "each layer's parameters from host-side hooks: use --zero-stage 1 "
                          "(or --use-distributed-optimizer) with CUDA graphs")
    if config.zero_stage == 3 and (model_config.domino_enabled or config.domino_auto):
        domino = ("--domino-batch-slices auto (it may pick a Domino plan)" if config.domino_auto
                  else "Domino (--domino, --domino-batch-slices, --domino-hidden-slices, "
                  "--domino-explicit-backward)")
        raise ConfigError("--zero-stage 3 gathers each layer in the layer's forward hook, which "
                          f"the Domino schedule bypasses: {domino} runs with --zero-stage 1 only")
    optional = {"hpz_partition_size": config.zeropp_hpz_partition_size,
                "gradient_bits": config.zeropp_gradient_bits,
                "block_size": config.zeropp_block_size,
                "layers_per_unit": config.zero_layers_per_unit,
                "unit_params": config.zero_unit_params}
    return ZeroConfig(stage=config.zero_stage, quantized_weights=config.zeropp_quantized_weights,
                      quantized_gradients=config.zeropp_quantized_gradients,
                      quantize_full_range=config.zeropp_quantize_full_range,
                      **{name: value for name, value in optional.items() if value is not None})


def batch_plan(config: TrainConfig, dp: int) -> tuple[int, int]:
    """(global batch size, micro-batches per rank per iteration); ConfigError if they don't tile
    (the rule validate() checks with the world)."""
    mbs = config.micro_batch_size
    if mbs < 1:
        raise ConfigError(f"--micro-batch-size={mbs} is invalid: it must be >= 1")
    gbs = config.global_batch_size if config.global_batch_size is not None else mbs * dp
    if gbs < 1 or gbs % (mbs * dp) != 0:
        raise ConfigError(
            f"--global-batch-size={gbs} is invalid: it must be a positive multiple of "
            f"--micro-batch-size ({mbs}) x data-parallel size ({dp}) = {mbs * dp}")
    return gbs, gbs // (mbs * dp)


def train_iterations(config: TrainConfig, global_batch_size: int) -> int:
    """--train-iters, or --train-samples // global batch size."""
    if config.train_iters is not None:
        iters = config.train_iters
    elif config.train_samples is not None:
        iters = config.train_samples // global_batch_size
    else:
        raise ConfigError("the run length is missing: pass --train-iters or --train-samples")
    if iters < 1:
        raise ConfigError(f"the run has {iters} iterations: --train-iters (or --train-samples / "
                          f"--global-batch-size) must give at least one")
    return iters


def _train_rules(config: TrainConfig, finetune: bool, data_given: bool) -> None:
    """Megatron-LM's cross-flag rules for the run length, schedule, precision, data and
    checkpoints."""
    if config.bf16 and config.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive: choose one")
    if (config.train_iters is None) == (config.train_samples is None):
        raise ConfigError("give exactly one of --train-iters and --train-samples")
    for name in ("train_iters", "train_samples"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} is invalid: it must be >= 1")
    if config.train_samples is not None and (config.lr_decay_iters is not None
                                             or config.lr_warmup_iters != 0):
        raise ConfigError("--lr-decay-iters and --lr-warmup-iters count steps: with "
                          "--train-samples use --lr-warmup-fraction, or use --train-iters")
    if config.lr_warmup_fraction is not None and config.lr_warmup_iters != 0:
        raise ConfigError("give one of --lr-warmup-fraction and --lr-warmup-iters, not both")
    if not 0.0 <= config.min_lr <= config.lr:
        raise ConfigError(f"--min-lr={config.min_lr} is invalid: it must be in [0, --lr "
                          f"({config.lr})]")
    if not data_given:
        _check_data(config, finetune)
    if config.profile and config.profile_step_end <= config.profile_step_start:
        raise ConfigError(f"--profile-step-end={config.profile_step_end} is invalid: it must be "
                          f"> --profile-step-start ({config.profile_step_start})")
    if config.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval={config.manual_gc_interval} is invalid: it "
                          "must be >= 0")
    if not config.manual_gc and (config.manual_gc_interval or not config.manual_gc_eval):
        raise ConfigError("--manual-gc-interval and --no-manual-gc-eval apply to --manual-gc: "
                          "add --manual-gc")
    for name in ("save_interval", "exit_interval"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} is invalid: it must be >= 1")
    if not config.distributed_timeout_minutes > 0:
        raise ConfigError(f"--distributed-timeout-minutes={config.distributed_timeout_minutes} "
                          "is invalid: it must be > 0 (fractions of a minute are fine)")
    if config.exit_duration_in_mins is not None and config.exit_duration_in_mins < 0:
        raise ConfigError(f"--exit-duration-in-mins={config.exit_duration_in_mins} is invalid: "
                          "it must be >= 0")
    if config.save is not None:
        _check_writable(config.save)
    if config.load is None:
        for name in ("finetune", "no_load_optim", "no_load_rng", "exit_on_missing_checkpoint"):
            if getattr(config, name):
                raise ConfigError(f"--{name.replace('_', '-')} applies to --load: give --load DIR")


def _check_writable(save: str) -> None:
    """--save must be a directory this process can write, or creatable in one: found at start-up
    rather than at the first save, hours in."""
    path = os.path.abspath(save)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise ConfigError(f"--save={save} is invalid: {path} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--save={save} is invalid: {path} is not writable by this user")


def _check_data(config: TrainConfig, finetune: bool) -> None:
    if config.mock_data and config.data_path:
        raise ConfigError("--mock-data and --data-path exclude each other: choose one")
    if not config.mock_data and not config.data_path:
        raise ConfigError("no data source: pass --data-path (with --tokenizer-type) or "
                          "--mock-data")
    if config.data_path and config.tokenizer_type is None:
        raise ConfigError("--data-path needs --tokenizer-type (and its files): the tokenizer "
                          "gives the end-of-document id and the vocabulary size")
    if finetune and config.eod_mask_loss:
        raise ConfigError("--eod-mask-loss is refused by finetune_llama.py: a response's "
                          "end-of-document token is what teaches the model to stop")
    if finetune and "{prompt}" not in config.prompt_template:
        raise ConfigError(f"--prompt-template={config.prompt_template!r} is invalid: it must "
                          "contain {prompt}")
