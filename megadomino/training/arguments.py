"""Megatron-LM's command line, mapped onto ModelConfig and TrainConfig by one explicit flag policy.

Every flag megadomino knows is a row of `FLAGS` (and, for finetune_llama.py, `FINETUNE_FLAGS`) in
`megadomino.training.flags`, under one of five policies: implemented, alias, ours, notice, refused.
Anything else is an error naming the flag. `docs/flags.md` holds the same tables, rendered by
`render_flag_table()`; a test keeps them equal. Every check here is pure arithmetic on the flags
(and, for --hf-checkpoint, a read of its config.json), so every rank refuses alike before any
process group exists.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NoReturn

from megadomino.config import ConfigError, ModelConfig, TrainConfig
from megadomino.domino.plan import validate_plan
from megadomino.parallel.dims import check_degrees, check_gpus_per_node
from megadomino.training.flags import ALIAS, FINETUNE_FLAGS, FLAGS, NOTICE, RANGES, REFUSED, Flag
from megadomino.zero.config import ZeroConfig

FAMILY_DEFAULTS: dict[str, dict] = {
    "gpt": dict(normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
                add_bias_linear=True, untie_embeddings_and_output_weights=False,
                hidden_dropout=0.1, attention_dropout=0.1, vocab_size=50257),
    "llama": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                  add_bias_linear=False, untie_embeddings_and_output_weights=True,
                  hidden_dropout=0.0, attention_dropout=0.0, vocab_size=32000),
}
"""What each entry script builds when no --model-preset says otherwise."""

_REQUIRED_WITHOUT_PRESET = ("--num-layers", "--hidden-size", "--num-attention-heads",
                            "--seq-length")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so callers choose how to fail."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser(family: str, finetune: bool = False) -> argparse.ArgumentParser:
    """The argparse parser for FLAGS, and FINETUNE_FLAGS if `finetune` (no abbreviations: a
    prefix is an unknown flag)."""
    if finetune:
        parser = _Parser(prog="finetune_llama.py", allow_abbrev=False,
                         description="Supervised fine-tuning of a Llama model with Megatron-LM's "
                                     "flags; the flag policy is in docs/flags.md.")
    else:
        parser = _Parser(prog=f"pretrain_{family}.py", allow_abbrev=False,
                         description=f"Pretrain a {family} model with Megatron-LM's flags; the "
                                     "flag policy is in docs/flags.md.")
    flags = _flags(finetune)
    spellings = {flag.name: [flag.name] for flag in flags}
    for flag in flags:
        if flag.policy == ALIAS:
            spellings[flag.alias_of].append(flag.name)
    for flag in flags:
        if flag.policy == ALIAS:
            continue
        kwargs: dict[str, Any] = dict(dest=flag.dest, default=None,
                                      help=f"[{flag.policy}] {flag.text}".replace("%", "%%"))
        if flag.type is not None:
            kwargs.update(type=_case_insensitive(flag), choices=flag.choices,
                          metavar=flag.metavar, nargs=flag.nargs)
        elif flag.policy == REFUSED:
            kwargs.update(nargs="*", metavar="VALUE")
        else:
            kwargs.update(action="store_const", const=flag.const)
        parser.add_argument(*spellings[flag.name], **kwargs)
    return parser


def _case_insensitive(flag: Flag) -> Callable[[str], Any]:
    """`flag.type`, mapping any case of a string choice onto its spelling in `flag.choices`
    (`--normalization rmsnorm` is RMSNorm)."""
    if not flag.choices or not all(isinstance(choice, str) for choice in flag.choices):
        return flag.type
    spelled = {choice.lower(): choice for choice in flag.choices}

    def parse(text: str) -> Any:
        return flag.type(spelled.get(text.lower(), text))

    parse.__name__ = flag.type.__name__  # argparse names the type in its errors
    return parse


def parse_args(argv: list[str] | None, family: str,
               finetune: bool = False) -> tuple[ModelConfig, TrainConfig, list[str]]:
    """Parse Megatron-LM flags (argv None: sys.argv[1:]) for a 'gpt' or 'llama' model; with
    `finetune`, finetune_llama.py's flags too, and the architecture may come from --hf-checkpoint.

    Returns the configs and the notices to print once (rank 0). Raises ConfigError naming the flag
    for an unknown flag, a refused one, or a combination that cannot run at its TP size.
    """
    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"family must be one of {sorted(FAMILY_DEFAULTS)}, not {family!r}")
    flags = _flags(finetune)
    args, extras = build_parser(family, finetune).parse_known_args(argv)
    _refuse_unknown(extras, flags)
    given = {flag: getattr(args, flag.dest) for flag in flags
             if flag.policy != ALIAS and getattr(args, flag.dest) is not None}
    for flag, value in given.items():
        allowed = RANGES.get(flag.name)
        if allowed is not None and value not in allowed:
            kind = "an integer " if flag.type is not float else ""
            raise ConfigError(f"{flag.name}={value} is invalid: it must be {kind}{allowed}")
        reason = flag.refusal(value)
        if reason is not None:
            shown = flag.name if flag.type is None else f"{flag.name}={value}"
            raise ConfigError(f"{shown} is refused: {reason}")
    notices = _grouped_notices([flag for flag in given if flag.policy == NOTICE])
    if args.llama_model and family != "llama":
        raise ConfigError("--llama-model asks for a Llama model: use pretrain_llama.py, whose "
                          "defaults are Llama's (RMSNorm, SwiGLU, RoPE)")
    fields: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for flag, value in given.items():  # in FLAGS order: later rows win
        if flag.field is not None:
            target, name = flag.field.split(".")
            fields[target][name] = value
    train_fields = dict(fields["train"])
    if fields["model"].get("domino_batch_slices") == "auto":
        fields["model"]["domino_batch_slices"] = 1
        train_fields["domino_auto"] = True
    if args.use_distributed_optimizer:  # Megatron-LM's distributed optimizer is ZeRO stage 1
        if train_fields.get("zero_stage", 1) != 1:
            raise ConfigError(f"--use-distributed-optimizer is ZeRO stage 1 and contradicts "
                              f"--zero-stage {train_fields['zero_stage']}: give one of them")
        train_fields["zero_stage"] = 1
    if train_fields.get("zero_stage", 0) != 0 and "ddp_bucket_size" in train_fields:
        raise ConfigError("--ddp-bucket-size sizes plain data parallelism's all-reduce buckets; "
                          "--zero-stage reduces layer by layer: drop one of them")
    _check_fp8_flags(fields["model"])
    train_config = TrainConfig(**train_fields)
    _check_train(train_config, finetune)
    tp = train_config.tensor_model_parallel_size
    # Megatron-DeepSpeed's --num-key-value-heads means grouped-query attention on its own.
    group_query_attention = args.group_query_attention or args.num_key_value_heads is not None
    notices += _apply_model_rules(group_query_attention, fields["model"], tp)
    if args.model_preset is not None:
        model_config = ModelConfig.preset(args.model_preset, **fields["model"])
    elif train_config.hf_checkpoint is not None:
        model_config = _model_config_from_hf(train_config.hf_checkpoint, fields["model"])
    else:
        missing = [f.name for f in FLAGS if f.name in _REQUIRED_WITHOUT_PRESET and f not in given]
        if missing:
            raise ConfigError(f"{', '.join(missing)} required (or give --model-preset NAME)")
        model_config = ModelConfig(**{**FAMILY_DEFAULTS[family], **fields["model"]})
    model_config.validate(tp=tp)
    if train_config.domino_auto and model_config.fp8 is not None:
        raise ConfigError("--domino-batch-slices auto may pick a Domino plan, whose schedule "
                          "runs high-precision GEMMs: it is off with --fp8-format")
    if train_config.domino_auto and model_config.enable_cuda_graph:
        raise ConfigError("--domino-batch-slices auto may pick a Domino plan, which "
                          "--enable-cuda-graph cannot capture: give one of them")
    zero_config(model_config, train_config)
    return model_config, train_config, notices


def zero_config(model_config: ModelConfig, train_config: TrainConfig) -> ZeroConfig:
    """The ZeroConfig that --zero-stage (0, plain data parallelism, by default) and the --zeropp-*
    flags ask for. ConfigError naming the flag for a ZeRO++ flag without
    the stage it needs, one with nothing to act on, or ZeRO-3 with Domino (whose schedule bypasses
    the hooks that gather each layer). hpZ's partition size against the node: validate_world."""
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


def validate_world(model_config: ModelConfig, train_config: TrainConfig, world_size: int,
                   local_world_size: int | None = None) -> None:
    """Raise ConfigError naming the flag if the configs cannot run on `world_size` ranks, of which
    `local_world_size` share a node (None: all of them) unless --gpus-per-node says otherwise.

    Pure arithmetic, for every rank before the process group is initialised: the world must tile
    into TP x PP x DP, a TP group must fit in --gpus-per-node, the model must shard at this TP,
    the global batch must be a multiple of micro batch x DP, and hpZ's partition must be a node's
    DP ranks.
    """
    tp = train_config.tensor_model_parallel_size
    pp = train_config.pipeline_model_parallel_size
    dp = world_size // (tp * pp) if tp >= 1 and pp >= 1 and world_size % (tp * pp) == 0 else -1
    check_degrees(world_size, tp, pp, dp)
    if train_config.gpus_per_node is not None:
        check_gpus_per_node(world_size, tp, train_config.gpus_per_node)
    model_config.validate(tp=tp)
    micro = train_config.micro_batch_size
    if micro < 1:
        raise ConfigError(f"--micro-batch-size={micro} is invalid: it must be >= 1")
    validate_plan(model_config, tp, micro)
    global_batch = train_config.global_batch_size
    if global_batch is not None and (global_batch < 1 or global_batch % (micro * dp) != 0):
        raise ConfigError(
            f"--global-batch-size={global_batch} is invalid: it must be a positive multiple of "
            f"--micro-batch-size ({micro}) x data-parallel size ({dp}) = {micro * dp}")
    gpus = train_config.gpus_per_node or local_world_size or world_size
    # The DP ranks of one node, as ParallelDims cuts the grid.
    zero_config(model_config, train_config).check_dims(
        SimpleNamespace(tp=tp, gpus_per_node=gpus, dp_per_node=max(1, min(dp, gpus // tp))))


def render_flag_table(flags: tuple[Flag, ...] = FLAGS) -> str:
    """`flags` as the markdown table docs/flags.md carries."""
    rows = ["| Flag | Policy | Sets | Notes |", "| --- | --- | --- | --- |"]
    for flag in flags:
        usage = f"`{flag.name} {flag.metavar}`" if flag.metavar else f"`{flag.name}`"
        if flag.policy == ALIAS:
            rows.append(f"| `{flag.name}` | alias | `{flag.alias_of}` | {flag.text} |")
            continue
        sets = ""
        if flag.field is not None:
            config, name = flag.field.split(".")
            sets = f"`{'ModelConfig' if config == 'model' else 'TrainConfig'}.{name}`"
            if flag.type is None:
                sets += f" = `{flag.const!r}`"
        notes = flag.text
        if flag.name in RANGES:
            notes += f" Range: {RANGES[flag.name]}."
        if flag.supported is not None:
            values = ", ".join(str(v) for v in flag.supported)
            notes += (f" (accepted at {values})" if flag.policy == REFUSED
                      else f" Values other than {values} are refused: {flag.unsupported}.")
        rows.append(f"| {usage} | {flag.policy} | {sets} | {notes} |")
    return "\n".join(rows) + "\n"


def _flags(finetune: bool) -> tuple[Flag, ...]:
    return FLAGS + FINETUNE_FLAGS if finetune else FLAGS


def _model_config_from_hf(hf_dir: str, overrides: dict[str, Any]) -> ModelConfig:
    """The architecture of --hf-checkpoint's config.json, with the explicit flags' fields."""
    from megadomino.interop.hf_config import model_config_from_hf

    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path) as file:
            hf_config = json.load(file)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--hf-checkpoint={hf_dir}: cannot read {path}: {err}") from None
    return model_config_from_hf(hf_config, **overrides)


def _refuse_unknown(extras: list[str], flags: tuple[Flag, ...]) -> None:
    if not extras:
        return
    unknown = [arg for arg in extras if arg.startswith("-")]
    if not unknown:
        raise ConfigError(f"unexpected argument {extras[0]!r}: values follow the flag they set")
    name = unknown[0].split("=", 1)[0]
    close = closest_flag(name, [flag.name for flag in flags])
    hint = f"; did you mean {close}?" if close else ""
    raise ConfigError(f"unknown flag {name}: megadomino neither implements, accepts nor refuses "
                      f"it (see docs/flags.md){hint}")


def closest_flag(name: str, known: list[str]) -> str | None:
    """The flag of `known` that an unknown `name` most likely misspells, or None.

    Only two slips are hinted: another spelling of the same words (case, `_` for `-`) and a word
    cut short (`--num-layer` for `--num-layers`; abbreviations are not expanded). Looser
    similarity is not: Megatron-LM has many flags one letter apart (`--adam-beta1`,
    `--adam-beta2`), and a hint naming another real flag is worse than none.
    """
    spelled = {flag.lower().replace("_", "-"): flag for flag in known}
    key = name.lower().replace("_", "-")
    if key in spelled:
        return spelled[key]
    longer = [flag for spelling, flag in spelled.items()
              if spelling.startswith(key) and "-" not in spelling[len(key):]]
    return longer[0] if len(longer) == 1 else None


def _grouped_notices(flags: list[Flag]) -> list[str]:
    """One line per notice text, naming every given flag that shares it."""
    by_text: dict[str, list[str]] = {}
    for flag in flags:
        by_text.setdefault(flag.text, []).append(flag.name)
    return [f"{', '.join(names)}: {text}" for text, names in by_text.items()]


def _apply_model_rules(group_query_attention: bool, model_fields: dict[str, Any],
                       tp: int) -> list[str]:
    """Megatron-LM's cross-flag rules for the architecture; edits `model_fields`, returns
    notices."""
    if group_query_attention:
        model_fields.setdefault("num_query_groups", 1)  # Megatron-LM's --num-query-groups default
    elif "num_query_groups" in model_fields:
        raise ConfigError("--num-query-groups is read only with --group-query-attention "
                          "(Megatron-LM would ignore it): add --group-query-attention")
    if model_fields.get("recompute_granularity") == "selective" and model_fields.get(
            "recompute_method"):
        raise ConfigError("--recompute-method applies to --recompute-granularity full only")
    if tp == 1 and model_fields.get("sequence_parallel"):
        model_fields["sequence_parallel"] = False
        return ["--sequence-parallel: dropped, it has no effect with "
                "--tensor-model-parallel-size 1"]
    return []


def _check_fp8_flags(model_fields: dict[str, Any]) -> None:
    """The --fp8-* options need --fp8-format; the delayed-scaling ones need that recipe."""
    options = [name for name in ("fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo",
                                 "fp8_margin", "fp8_interval") if name in model_fields]
    if options and model_fields.get("fp8") is None:
        raise ConfigError(f"--{options[0].replace('_', '-')} configures FP8 training: add "
                          "--fp8-format hybrid (or e4m3)")
    if model_fields.get("fp8_recipe") == "tensorwise":
        delayed = [name for name in options if name != "fp8_recipe"]
        if delayed:
            raise ConfigError(f"--{delayed[0].replace('_', '-')} applies to --fp8-recipe "
                              "delayed; tensorwise scales each tensor by its own amax")


def _check_train(config: TrainConfig, finetune: bool) -> None:
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
    _check_data(config, finetune)
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
