"""Megatron-LM's command line, mapped onto the configuration tree (megadomino.config.Config) by
one explicit flag policy.

Every flag megadomino knows is a row of `FLAGS` (and, for finetune_llama.py, `FINETUNE_FLAGS`) in
`megadomino.cli.flags`, under one of five policies: implemented, alias, ours, notice, refused.
Anything else is an error naming the flag. `docs/flags.md` holds the same tables, rendered by
`render_flag_table()`; a test keeps them equal. Here are the checks on the flags themselves
(ranges, policies, spellings); what the resulting config must meet is the validator's
(`megadomino.config.validate`), which parse_args runs. A --deepspeed_config JSON sets its keys'
flags before these checks, each value parsed and checked as its flag's
(`megadomino.cli.deepspeed_config`). All of it is pure arithmetic on the flags (and reads of
--hf-checkpoint's config.json and --deepspeed_config's file), so every rank refuses alike before
any process group exists.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from megadomino.cli.flag_help import (
    HelpAll,
    default_note,
    group_titles,
    help_group,
    shown_by_default,
)
from megadomino.cli.flags import ALIAS, FINETUNE_FLAGS, FLAGS, NOTICE, RANGES, REFUSED, Flag
from megadomino.cli.misspelling import closest_flag
from megadomino.config import (
    FAMILY_DEFAULTS,
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    build,
)
from megadomino.config.batches import parse_step_schedule
from megadomino.config.pipeline_plan import AUTO, PipelinePlan, read_plan
from megadomino.config.validate import validate

_REQUIRED_WITHOUT_PRESET = ("--num-layers", "--hidden-size", "--num-attention-heads",
                            "--seq-length")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so callers choose how to fail."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser(family: str, finetune: bool = False,
                 show_all: bool = False) -> argparse.ArgumentParser:
    """The argparse parser for FLAGS, and FINETUNE_FLAGS if `finetune` (no abbreviations: a
    prefix is an unknown flag). Its help groups the flags by subject (cli/flag_help.py); it lists
    the notice and refused rows only with `show_all` (--help-all), but parses them either way."""
    what = ("Supervised fine-tuning of a Llama model" if finetune
            else f"Pretrain a {family} model")
    parser = _Parser(prog="finetune_llama.py" if finetune else f"pretrain_{family}.py",
                     allow_abbrev=False, usage="%(prog)s [FLAG [VALUE ...]] ...",
                     description=f"{what} with Megatron-LM's flags; the flag policy is in "
                                 "docs/flags.md. --help lists the implemented flags and "
                                 "megadomino's own; --help-all adds the Megatron-LM flags "
                                 "accepted with a notice and those refused.")
    parser.add_argument("--help-all", action=HelpAll, help="List every flag, the notices and "
                        "refusals included, and exit.",
                        make_parser=functools.partial(build_parser, family, finetune))
    groups = {title: parser.add_argument_group(title) for title in group_titles()}
    flags = _flags(finetune)
    spellings = {flag.name: [flag.name] for flag in flags}
    for flag in flags:
        if flag.policy == ALIAS:
            spellings[flag.alias_of].append(flag.name)
    for flag in flags:
        if flag.policy == ALIAS:
            continue
        text = flag.help
        if shown_by_default(flag):
            text = " ".join(filter(None, (text, default_note(flag, family,
                                                             _REQUIRED_WITHOUT_PRESET))))
        elif not show_all:
            text = argparse.SUPPRESS
        kwargs: dict[str, Any] = dict(dest=flag.dest, default=None,
                                      help=text.replace("%", "%%"))
        if flag.type is not None:
            kwargs.update(type=_case_insensitive(flag), choices=flag.choices,
                          metavar=flag.metavar, nargs=flag.nargs)
        elif flag.policy == REFUSED:
            kwargs.update(nargs="*", metavar="VALUE")
        else:
            kwargs.update(action="store_const", const=flag.const)
        groups[help_group(flag)].add_argument(*spellings[flag.name], **kwargs)
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
               finetune: bool = False) -> tuple[Config, list[str]]:
    """`parse_run`'s config and notices."""
    config, notices, _ = parse_run(argv, family, finetune)
    return config, notices


def parse_run(argv: list[str] | None, family: str, finetune: bool = False
              ) -> tuple[Config, list[str], PipelinePlan | None]:
    """Parse Megatron-LM flags (argv None: sys.argv[1:]) for a 'gpt' or 'llama' model; with
    `finetune`, finetune_llama.py's flags too, and the architecture may come from --hf-checkpoint.

    Returns the config, the notices to print once (rank 0) and --pipeline-plan's plan, its file
    read here once (None without the flag; the launcher resolves the run's plan from it). Raises
    ConfigError naming the flag for an unknown flag, a refused one, or a combination that cannot
    run at its TP size.
    """
    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"family must be one of {sorted(FAMILY_DEFAULTS)}, not {family!r}")
    flags = _flags(finetune)
    parser = build_parser(family, finetune)
    # every bad flag of the command, reported together
    args, extras, errors = _parse_every_value(parser, argv)
    errors += _unknown(extras, flags)
    json_notices, json_fields = ([], {}) if errors else _apply_deepspeed_config(args, parser)
    given = _given_values(args, flags)
    errors += [error for flag, value in given.items() for error in flag_errors(flag, value)]
    if errors:
        raise ConfigError(*errors)
    notices = _grouped_notices([flag for flag in given if flag.policy == NOTICE]) + json_notices
    if args.llama_model and family != "llama":
        raise ConfigError("--llama-model asks for a Llama model: use pretrain_llama.py, whose "
                          "defaults are Llama's (RMSNorm, SwiGLU, RoPE)")
    fields = _field_tree(given, json_fields)
    parallel, train = fields["parallel"], fields["train"]
    notices += _apply_zero_rules(args.use_distributed_optimizer, parallel["zero"])
    notices += _inert_settings(train)
    _check_fp8_flags(train["precision"].get("fp8"))
    # Megatron-DeepSpeed's --num-key-value-heads means grouped-query attention on its own.
    group_query_attention = args.group_query_attention or args.num_key_value_heads is not None
    notices += _apply_model_rules(group_query_attention, fields["model"], parallel,
                                  parallel.get("tensor_model_parallel_size", 1))
    model_config = _model_config(args, family, given, fields)
    plan = _apply_pipeline_rules(parallel, model_config.num_layers)
    notices += _step_schedule(train.get("schedule", {}), model_config.seq_length)
    config = Config(model_config, build(ParallelConfig, parallel), build(TrainConfig, train))
    validate(config, finetune=finetune, plan=plan)
    from megadomino.pipeline.schedules import check_schedule  # torch: only once parsed

    check_schedule(config.parallel)
    return config, notices, plan


def _apply_deepspeed_config(args: argparse.Namespace, parser: argparse.ArgumentParser
                            ) -> tuple[list[str], dict[str, Any]]:
    """--deepspeed_config's flags set on `args`; returns its notices and the fields only it sets."""
    if args.deepspeed_config is None:
        return [], {}
    from megadomino.cli.deepspeed_config import apply_deepspeed_config  # it imports us

    return apply_deepspeed_config(args, parser)


def _given_values(args: argparse.Namespace, flags: tuple[Flag, ...]) -> dict[Flag, Any]:
    """Each flag the command gives (an alias under its flag) with its value, in `flags` order."""
    return {flag: getattr(args, flag.dest) for flag in flags
            if flag.policy != ALIAS and getattr(args, flag.dest) is not None}


def _field_tree(given: dict[Flag, Any], json_fields: dict[str, Any]) -> dict[str, Any]:
    """Nested config fields: `given` by row (later rows win), then --deepspeed_config's own."""
    fields: dict[str, Any] = {"model": {}, "parallel": {"domino": {}, "zero": {}},
                              "train": {"precision": {}, "checkpoint": {}}}
    for path, value in [*((flag.field, value) for flag, value in given.items()),
                        *json_fields.items()]:
        if path is not None:
            *sections, name = path.split(".")
            target = fields
            for section in sections:
                target = target.setdefault(section, {})
            target[name] = value
    domino = fields["parallel"]["domino"]
    if domino.get("batch_slices") == "auto":  # not a slice count: the plan measured at start-up
        del domino["batch_slices"]
        fields["parallel"]["domino_auto"] = True
    return fields


def _apply_zero_rules(use_distributed_optimizer: bool, zero: dict[str, Any]) -> list[str]:
    """One ZeRO stage from the optimizer flags, bucket size only at stage 0; returns notices."""
    if use_distributed_optimizer:  # Megatron-LM's distributed optimizer is ZeRO stage 1
        if zero.get("stage", 1) != 1:
            raise ConfigError(f"--use-distributed-optimizer is ZeRO stage 1 and contradicts "
                              f"--zero-stage {zero['stage']}: give one of them")
        zero["stage"] = 1
    if zero.get("stage", 0) != 0 and "bucket_numel" in zero:
        raise ConfigError("--ddp-bucket-size sizes plain data parallelism's all-reduce buckets; "
                          "--zero-stage reduces layer by layer: drop one of them")
    if zero.get("stage", 0) == 0 and zero.pop("reduce_dtype", None) is not None:
        return ["--grad-reduce-in-bf16: at --zero-stage 0 gradients are reduced in fp32; "
                "with --use-distributed-optimizer they are reduced in bf16"]
    return []


def _model_config(args: argparse.Namespace, family: str, given: dict[Flag, Any],
                  fields: dict[str, Any]) -> ModelConfig:
    """The architecture of --model-preset, --hf-checkpoint or `family`, the given fields winning."""
    model_fields = fields["model"]
    hf_checkpoint = fields["train"]["checkpoint"].get("hf_checkpoint")
    if args.model_preset is not None:
        model_config = ModelConfig.preset(args.model_preset, **model_fields)
    elif hf_checkpoint is not None:
        model_config = _model_config_from_hf(hf_checkpoint, model_fields)
    else:
        missing = [f.name for f in FLAGS if f.name in _REQUIRED_WITHOUT_PRESET and f not in given]
        if missing:
            raise ConfigError(f"{', '.join(missing)} required (or give --model-preset NAME)")
        model_config = ModelConfig(**{**FAMILY_DEFAULTS[family], **model_fields})
    if args.no_position_embedding and model_config.position_embedding_type != "rope":
        raise ConfigError("--no-position-embedding is refused: models without position "
                          "embeddings are not implemented (with --position-embedding-type rope "
                          "it is accepted: rope adds no position embedding)")
    return model_config


def _apply_pipeline_rules(parallel_fields: dict[str, Any],
                          num_layers: int) -> PipelinePlan | None:
    """A plan sets the PP size (its stage count); virtual stages pick the interleaved schedule.
    Returns --pipeline-plan's plan (None without it)."""
    path = parallel_fields.get("pipeline_plan")
    plan = read_plan(path, num_layers) if path not in (None, AUTO) else None  # auto: launch's
    if plan is not None and "pipeline_model_parallel_size" not in parallel_fields:
        # the plan's stages are the pipeline: their count is its size
        parallel_fields["pipeline_model_parallel_size"] = plan.size
    if "pipeline_schedule" not in parallel_fields:
        # Megatron runs the interleaved schedule whenever a stage holds virtual stages.
        chunks = build(ParallelConfig, parallel_fields).virtual_chunks(num_layers)
        if chunks > 1:
            parallel_fields["pipeline_schedule"] = "interleaved"
    return plan


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
            sets = f"`{flag.field}`"
            if flag.type is None:
                sets += f" = `{flag.const!r}`"
        notes = flag.text
        if flag.name in RANGES:
            notes += f" Range: {RANGES[flag.name]}."
        if flag.values_note:
            notes += f" {flag.values_note}"
        rows.append(f"| {usage} | {flag.policy} | {sets} | {notes} |")
    return "\n".join(rows) + "\n"


def flag_errors(flag: Flag, value: Any) -> list[str]:
    """Why `flag` given `value` cannot run: a value out of its RANGES, or refused ([]: it can)."""
    errors = []
    allowed = RANGES.get(flag.name)
    values = value if isinstance(value, list) else [value]
    if allowed is not None and any(v not in allowed for v in values):
        kind = "an integer " if flag.type is not float else ""
        errors.append(f"{flag.name}={value} is invalid: it must be {kind}{allowed}")
    reason = flag.refusal(value)
    if reason is not None:
        shown = flag.name if flag.type is None else f"{flag.name}={value}"
        errors.append(f"{shown} is refused: {reason}")
    return errors


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


def _parse_every_value(parser: argparse.ArgumentParser, argv: list[str] | None
                       ) -> tuple[argparse.Namespace, list[str], list[str]]:
    """parser.parse_known_args, with every value argparse rejects (a type, a choice, a missing
    value) reported instead of only the first: each rejected flag is dropped with its values and
    the rest parsed again. Returns the arguments, the unknown ones and those messages."""
    argv = list(sys.argv[1:] if argv is None else argv)
    errors: list[str] = []
    while True:
        try:
            args, extras = parser.parse_known_args(argv)
            return args, extras, errors
        except ConfigError as err:
            errors.append(str(err))
            rest = _without_rejected(argv, str(err))
            if rest is None:  # not one flag's value: nothing to drop
                raise ConfigError(*errors) from None
            argv = rest


def _without_rejected(argv: list[str], message: str) -> list[str] | None:
    """`argv` without the flag argparse's `message` ("argument --a/--b: ...") names, every
    occurrence with the values after it (the run is refused anyway), or None when it names none
    of argv's flags."""
    named = re.match(r"argument ([^:]+):", message)
    names = named.group(1).split("/") if named else []
    rest, index = [], 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token.split("=", 1)[0] not in names:
            rest.append(token)
            continue
        while "=" not in token and index < len(argv) and not argv[index].startswith("--"):
            index += 1
    return rest if len(rest) < len(argv) else None


def _unknown(extras: list[str], flags: tuple[Flag, ...]) -> list[str]:
    """A message for each unknown flag among `extras` (with the flag it likely misspells), or
    for the first stray value when there is none."""
    unknown = [arg.split("=", 1)[0] for arg in extras if arg.startswith("-")]
    if extras and not unknown:
        return [f"unexpected argument {extras[0]!r}: values follow the flag they set"]
    messages = []
    for name in dict.fromkeys(unknown):
        close = closest_flag(name, [flag.name for flag in flags])
        hint = f"; did you mean {close}?" if close else ""
        messages.append(f"unknown flag {name}: megadomino neither implements, accepts nor "
                        f"refuses it (see docs/flags.md){hint}")
    return messages


def _grouped_notices(flags: list[Flag]) -> list[str]:
    """One line per notice text, naming every given flag that shares it."""
    by_text: dict[str, list[str]] = {}
    for flag in flags:
        by_text.setdefault(flag.text, []).append(flag.name)
    return [f"{', '.join(names)}: {text}" for text, names in by_text.items()]


def _apply_model_rules(group_query_attention: bool, model_fields: dict[str, Any],
                       parallel_fields: dict[str, Any], tp: int) -> list[str]:
    """Megatron-LM's cross-flag rules for the architecture and how its layers run; edits the
    fields, returns notices."""
    if group_query_attention:
        model_fields.setdefault("num_query_groups", 1)  # Megatron-LM's --num-query-groups default
    elif "num_query_groups" in model_fields:
        raise ConfigError("--num-query-groups is read only with --group-query-attention "
                          "(Megatron-LM would ignore it): add --group-query-attention")
    if parallel_fields.get("recompute_granularity") == "selective" and parallel_fields.get(
            "recompute_method"):
        raise ConfigError("--recompute-method applies to --recompute-granularity full only")
    # Under --pipeline-plan each stage's TP degree is the plan's: a TP > 1 stage uses SP.
    if tp == 1 and parallel_fields.get("sequence_parallel") and not parallel_fields.get(
            "pipeline_plan"):
        parallel_fields["sequence_parallel"] = False
        return ["--sequence-parallel: dropped, it has no effect with "
                "--tensor-model-parallel-size 1"]
    return []


def _step_schedule(schedule_fields: dict[str, Any], seq_length: int) -> list[str]:
    """--step-batch-size-schedule's text as [[threshold samples, batch], ...]; a notice when
    --global-batch-size repeats its last batch (the pair Megatron-LM refuses)."""
    text = schedule_fields.get("step_batch_size_schedule")
    if text is None:
        return []
    steps = parse_step_schedule(text, seq_length)
    schedule_fields["step_batch_size_schedule"] = steps
    if schedule_fields.get("global_batch_size") == steps[-1][1]:
        return [f"--global-batch-size: {steps[-1][1]}, the last batch of "
                "--step-batch-size-schedule, which sets every step's batch (Megatron-LM refuses "
                "the two flags together; they agree here)"]
    return []


def _inert_settings(train_fields: dict[str, Any]) -> list[str]:
    """Settings that Megatron-LM reads only with a feature the command leaves off, which it
    then ignores without a word: dropped from the fields, each with a notice."""
    notices = []
    precision = train_fields["precision"]
    fp8 = "train.precision.fp8."
    if "fp8" in precision and "format" not in precision["fp8"]:
        names = ", ".join(_flag_setting(fp8 + name) for name in precision.pop("fp8"))
        notices.append(f"{names}: not read, FP8 is off without --fp8-format (Megatron-LM builds "
                       "its FP8 recipe only with --fp8-format)")
    ends = [name for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
            if name in precision.get("fp8", {})]
    if ends and not precision["fp8"].get("first_last_layers_bf16"):
        for name in ends:
            del precision["fp8"][name]
        names = ", ".join(_flag_setting(fp8 + name) for name in ends)
        notices.append(f"{names}: not read without --first-last-layers-bf16 (Megatron-LM reads "
                       "them only with it)")
    schedule = train_fields.get("schedule", {})
    if schedule.get("eval_iters", 0) < 0:
        notices.append(f"--eval-iters={schedule['eval_iters']}: no evaluation (Megatron-LM "
                       "evaluates only when --eval-iters is positive)")
        schedule["eval_iters"] = 0
    data = train_fields.get("data", {})
    if "data_sharding" in data and data.get("dataloader_type", "single") == "single":
        del data["data_sharding"]
        notices.append("--no-data-sharding: not read, the single loader reads consecutive "
                       "samples (--dataloader-type cyclic reads it)")
    return notices


def _flag_setting(field: str) -> str:
    """The flag (of FLAGS) that sets the config field at path `field`."""
    return next(flag.name for flag in FLAGS if flag.field == field and flag.policy != ALIAS)


def _check_fp8_flags(fp8_fields: dict[str, Any] | None) -> None:
    """The delayed-scaling --fp8-* options need that recipe."""
    if fp8_fields is None or fp8_fields.get("recipe") != "tensorwise":
        return
    delayed = [name for name in ("amax_history_len", "amax_compute_algo", "margin", "interval")
               if name in fp8_fields]
    if delayed:
        raise ConfigError(f"--fp8-{delayed[0].replace('_', '-')} applies to --fp8-recipe "
                          "delayed; tensorwise scales each tensor by its own amax")
