"""--deepspeed_config FILE: a DeepSpeed JSON config, read as Megatron-DeepSpeed's run uses it.

Each key of the table (megadomino.cli.deepspeed_keys.KEYS) stands for flags (its value becomes
each flag's command-line text and goes through that flag's own parsing, range and refusal, so a
key and its flag set the same field alike), or is a notice (it only tunes DeepSpeed's runtime:
accepted, with one line saying what happens here instead), or an error when its value asks for
something megadomino lacks. A key not in the table is an error naming it: DeepSpeed ignores
unknown top-level keys, and a misspelt one would be a setting silently lost. `null` counts as
absent, as DeepSpeed's readers take it. Every error is one line naming --deepspeed_config, the
file and the key, before any process group.

The file is read only with --deepspeed, as Megatron-DeepSpeed reads it. Where the JSON and the
command line differ, the side Megatron-DeepSpeed's run uses wins, with a notice naming both:
  - ZeRO (stage, ZeRO++), bf16 / fp16, loss scaling, gradient clipping: the JSON. DeepSpeed's
    engine reads them only from it (Megatron-DeepSpeed hands it a bare optimizer, so --clip-grad
    and the loss-scale flags never reach it). Such a flag the JSON leaves out is used, with a
    notice that DeepSpeed would leave it at its default. A JSON turning bf16 (fp16) off under
    --bf16 (--fp16) is an error: DeepSpeed would train the 16-bit weights without fp32 masters.
  - The global batch: --global-batch-size (Megatron-DeepSpeed resets DeepSpeed's batch to it at
    every step). The micro-batch must agree: DeepSpeed's accumulation count and Megatron's loader
    would split the batch differently.
  - Optimizer and LR scheduler: Megatron-DeepSpeed hands DeepSpeed its own, made from the flags,
    and DeepSpeed then ignores the JSON's; so with any of `OPTIMIZER_FLAGS` given, the JSON's are
    not used. Otherwise the JSON's optimizer (DeepSpeed's defaults for the parameters it leaves
    out) sets the flags, at the constant LR DeepSpeed keeps without a scheduler. DeepSpeed's
    schedulers are an error: they start one step late and warm up over at least two steps,
    log-shaped by default, which no Megatron schedule reproduces.
The batch triple is DeepSpeed's: train_batch_size = micro x gradient_accumulation_steps x DP. DP
is known only with the world, so the steps stay in the config, and megadomino.config.batches
derives or checks the global batch with them when the world is known (still before any group).

Sources (repository@commit path): microsoft/Megatron-DeepSpeed@f4157bea69 megatron/training.py
(_create_ds_config_dict, pretrain: read under --deepspeed only; setup_model_and_optimizer: its own
optimizer and scheduler to deepspeed.initialize; train: set_train_batch_size every iteration),
megatron/optimizer/__init__.py (bare optimizer under --deepspeed). microsoft/DeepSpeed@38327e07f6
deepspeed/runtime/config.py (_set_batch_related_parameters, _batch_assertion, fp16 xor bf16,
get_dynamic_loss_scale_args), runtime/zero/config.py and config_utils.py (ZeRO keys, unknown ones
forbidden), runtime/engine.py (_configure_optimizer, _configure_lr_scheduler prefer the client's;
_configure_distributed_model casts by the JSON), ops/adam/fused_adam.py (Adam's defaults),
runtime/lr_schedules.py.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser, Namespace
from typing import Any

from megadomino.cli.arguments import flag_errors
from megadomino.cli.deepspeed_keys import (
    ADAM_ONLY,
    AGREE,
    BATCH,
    DEFAULTS,
    ENGINE,
    KEYS,
    NUMBER,
    OFF,
    ON,
    OPTIMIZER_FLAGS,
    SECTIONS,
    SGD_ONLY,
    SKIP,
    Key,
)
from megadomino.cli.flags import FLAGS
from megadomino.cli.misspelling import closest_flag
from megadomino.config import ConfigError

ROWS = {flag.name: flag for flag in FLAGS}


def apply_deepspeed_config(args: Namespace,
                           parser: ArgumentParser) -> tuple[list[str], dict[str, Any]]:
    """Read `args.deepspeed_config` onto `args` (the command line, parsed by `parser`) by the
    rules above. Returns the notices and the config fields no flag sets ({dotted path: value})."""
    where = f"--deepspeed_config={args.deepspeed_config}"
    if not args.deepspeed:
        return [f"{where}: not read without --deepspeed (Megatron-DeepSpeed reads it only then, "
                "and takes every setting from the flags otherwise)"], {}
    found: dict[str, Any] = {}
    by_text: dict[str, list[str]] = {}
    _walk(_read(args.deepspeed_config, where), "", found, by_text, where)
    present = set(found)
    merge = _Merge(args, parser, where)
    _precision(found, merge)
    fields = _batch(found, merge)
    _optimizer(found, merge)
    for path, value in found.items():
        merge.set(KEYS[path], value)
    notices = [f"{where}: {', '.join(paths)}: {text}" for text, paths in by_text.items()]
    return notices + merge.notices + merge.engine_only(present), fields


def _read(path: str, where: str) -> dict:
    def no_duplicates(pairs: list) -> dict:
        keys = [key for key, _ in pairs]
        for key in keys:
            if keys.count(key) > 1:
                raise ConfigError(f"{where}: {key} appears twice (DeepSpeed refuses that too)")
        return dict(pairs)

    try:
        with open(path) as file:
            data = json.load(file, object_pairs_hook=no_duplicates)
    except OSError as err:
        raise ConfigError(f"{where}: cannot read the file: {err.strerror}") from None
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"{where}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the file holds {_kind(data)}, not an object of settings")
    return data


def _kind(value: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return names.get(value if isinstance(value, type) else type(value), "null")


def _walk(section: dict, prefix: str, found: dict[str, Any], by_text: dict[str, list[str]],
          where: str) -> None:
    """Each key of `section` (at `prefix`) into `found`, its notice into `by_text`; an error for
    an unknown key, a wrong type, or a value asking for something megadomino lacks."""
    for name, value in section.items():
        path = prefix + name
        if value is None:
            continue
        if path == "zero_optimization" and isinstance(value, bool):  # DeepSpeed's old form
            found["zero_optimization.stage"] = int(value)
        elif path in SECTIONS:
            _check_type(path, value, (dict,), where)
            _walk(value, path + ".", found, by_text, where)
        elif path not in KEYS:
            known = {key[len(prefix):].split(".")[0] for key in (*KEYS, *SECTIONS)
                     if key.startswith(prefix)}
            close = closest_flag(name, sorted(known))
            hint = f"; did you mean {prefix}{close}?" if close else ""
            raise ConfigError(f"{where}: {path} is not a DeepSpeed setting megadomino knows "
                              f"(docs/deepspeed_config.md lists them){hint}")
        else:
            key = KEYS[path]
            _check_type(path, value, key.kinds, where)
            if key.error and not key.accepts(value):
                raise ConfigError(f"{where}: {path}={json.dumps(value)} is refused: {key.error}")
            if key.notice:
                by_text.setdefault(key.notice, []).append(path)
            found[path] = value


def _check_type(path: str, value: Any, kinds: tuple[type, ...], where: str) -> None:
    if object in kinds:
        return
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        expected = "a number" if kinds == NUMBER else " or ".join(map(_kind, kinds))
        raise ConfigError(f"{where}: {path} is {_kind(value)} ({json.dumps(value)}): it must be "
                          f"{expected}")


class _Merge:
    """The JSON's values set onto the command line's, each parsed and checked as its flag."""

    def __init__(self, args: Namespace, parser: ArgumentParser, where: str):
        self.args, self.parser, self.where = args, parser, where
        self.cli = {dest: value for dest, value in vars(args).items() if value is not None}
        """What the command line gave, before the JSON."""
        self.notices: list[str] = []

    def given(self, flag: str) -> Any:
        return self.cli.get(ROWS[flag].dest)

    def set(self, key: Key, json_value: Any, texts: tuple | None = None) -> None:
        """Each flag of `key` to its text (default: `key.texts` of the value), unless the
        command line gave another value that wins (`key.wins`)."""
        try:
            texts = key.texts(json_value) if texts is None else texts
        except ValueError as err:
            raise ConfigError(f"{self.where}: {key.path}={json.dumps(json_value)}: {err}") from None
        for flag, text in zip(key.flags, texts):
            if text == SKIP:
                continue
            value = None if text == OFF else self._parse(key.path, json_value, flag, text)
            mine = self.given(flag)
            if mine is not None and mine != value:
                shown = f"{self.where}'s {key.path}={json.dumps(json_value)}"
                if key.wins == AGREE:
                    raise ConfigError(f"{flag}={mine} contradicts {shown}: give one value")
                self.notices.append(f"{flag}={mine} and {shown} differ: the "
                                    f"{'JSON' if key.wins == ENGINE else 'flag'} wins, as "
                                    f"{key.wins}")
                if key.wins != ENGINE:
                    continue
            setattr(self.args, ROWS[flag].dest, value)

    def _parse(self, path: str, json_value: Any, flag: str, text: str) -> Any:
        tokens = [flag] if text == ON else [f"{flag}={text}"]
        try:
            value = getattr(self.parser.parse_known_args(tokens)[0], ROWS[flag].dest)
            errors = flag_errors(ROWS[flag], value)
        except ConfigError as err:
            errors = err.messages
        if errors:
            raise ConfigError(f"{self.where}: {path}={json.dumps(json_value)} ({flag}): "
                              f"{errors[0]}")
        return value

    def engine_only(self, present: set[str]) -> list[str]:
        """A notice naming the flags DeepSpeed's engine reads only from the JSON that the
        command line gave and the JSON leaves out."""
        flags = [flag for path, key in KEYS.items() if key.wins == ENGINE and path not in present
                 for flag in key.flags if self.given(flag) is not None]
        if not present & {"bf16.enabled", "bfloat16.enabled", "fp16.enabled"}:
            flags += [flag for flag in ("--bf16", "--fp16") if self.given(flag)]
        if not flags:
            return []
        return [f"{', '.join(flags)}: given on the command line only, and used; DeepSpeed's "
                f"engine reads them only from {self.where}, and would leave them at its defaults"]


def _precision(found: dict[str, Any], merge: _Merge) -> None:
    """bf16 / fp16: the JSON's choice wins, as DeepSpeed's engine casts the model by it; fp16's
    other keys are read only when the JSON enables it, as DeepSpeed reads them."""
    if "bf16.enabled" in found and "bfloat16.enabled" in found:
        raise ConfigError(f"{merge.where}: bf16 and bfloat16 (its old name) are both given: "
                          "keep bf16")
    enabled = {"bf16": found.pop("bf16.enabled", found.pop("bfloat16.enabled", None)),
               "fp16": found.pop("fp16.enabled", None)}
    if enabled["bf16"] and enabled["fp16"]:
        raise ConfigError(f"{merge.where}: bf16 and fp16 are both enabled (DeepSpeed refuses "
                          "that too): enable one")
    for name, other in (("bf16", "fp16"), ("fp16", "bf16")):
        if enabled[name] is False and merge.given(f"--{name}"):
            raise ConfigError(f"--{name} contradicts {merge.where}'s {name}.enabled=false: "
                              f"DeepSpeed would train the {name} weights without fp32 master "
                              "weights, which megadomino does not do: drop one")
        if enabled[name]:
            merge.set(Key(f"{name}.enabled", flags=(f"--{name}",)), True, (ON,))
            if merge.given(f"--{other}"):
                setattr(merge.args, other, None)
                merge.notices.append(f"--{other} and {merge.where}'s {name}.enabled=true "
                                     f"differ: the JSON wins, as {ENGINE}")
    unread = [path for path in found if path.startswith("fp16.")]
    if unread and not enabled["fp16"]:
        for path in unread:
            del found[path]
        merge.notices.append(f"{merge.where}: {', '.join(unread)}: not read, the JSON does not "
                             "enable fp16 (DeepSpeed reads them only then)")


def _batch(found: dict[str, Any], merge: _Merge) -> dict[str, Any]:
    """DeepSpeed's batch triple: the micro and global batch are their flags' (set by the
    caller); the accumulation steps go to the config, unless --global-batch-size replaces the
    JSON's batch (Megatron-DeepSpeed then recomputes them from it)."""
    micro, train = found.get("train_micro_batch_size_per_gpu"), found.get("train_batch_size")
    steps = found.pop("gradient_accumulation_steps", None)
    if micro is None and merge.given("--micro-batch-size") is None and (
            train is not None or steps is not None):
        raise ConfigError(f"{merge.where}: without train_micro_batch_size_per_gpu, DeepSpeed "
                          "derives the micro-batch from the data-parallel size, known only at "
                          "launch: add it (or --micro-batch-size)")
    if steps is None:
        return {}
    if steps < 1:
        raise ConfigError(f"{merge.where}: gradient_accumulation_steps={steps} is invalid: it "
                          "must be >= 1")
    flag_batch = merge.given("--global-batch-size")
    if flag_batch is not None and flag_batch != train:
        merge.notices.append(f"{merge.where}: gradient_accumulation_steps={steps}: not used, as "
                             f"{BATCH} and recomputes the steps from it")
        return {}
    return {"train.schedule.gradient_accumulation_steps": steps}


def _optimizer(found: dict[str, Any], merge: _Merge) -> None:
    """The JSON's optimizer and scheduler, unless Megatron-DeepSpeed's (the flags') replace
    them."""
    section = {path: found.pop(path) for path in list(found) if path.startswith("optimizer.")}
    scheduler = found.pop("scheduler", None)
    flags = [flag for flag in OPTIMIZER_FLAGS if merge.given(flag) is not None]
    if flags and (section or scheduler is not None):
        parts = [name for name, there in (("optimizer", section), ("scheduler", scheduler))
                 if there is not None and there != {}]
        merge.notices.append(f"{merge.where}: {' and '.join(parts)}: not used, as Megatron-"
                             f"DeepSpeed hands DeepSpeed its own, made from {', '.join(flags)}")
        return
    if scheduler is not None:
        raise ConfigError(f"{merge.where}: scheduler {json.dumps(scheduler.get('type'))} is "
                          "refused: DeepSpeed's LR schedulers are not implemented (they start "
                          "one step late and warm up over at least two steps, log-shaped by "
                          "default): give Megatron's --lr, --lr-warmup-iters, --lr-decay-style, "
                          "--lr-decay-iters and --min-lr, which Megatron-DeepSpeed uses instead")
    if not section:
        return
    if "optimizer.type" not in section:
        raise ConfigError(f"{merge.where}: optimizer has no type: name Adam, AdamW or SGD")
    merge.set(KEYS["optimizer.type"], section["optimizer.type"])
    kind = merge.args.optimizer
    params = {path.split(".")[-1]: value for path, value in section.items()
              if path.startswith("optimizer.params.")}
    wrong = [name for name in params if name in (SGD_ONLY if kind == "adam" else ADAM_ONLY)]
    if wrong:
        raise ConfigError(f"{merge.where}: optimizer.params.{wrong[0]} is not a parameter of "
                          f"{section['optimizer.type']}")
    defaults = dict(DEFAULTS[kind], **({"weight_decay": 0.01} if params.get("torch_adam") else {}))
    for name, value in {**defaults, **params}.items():
        merge.set(KEYS[f"optimizer.params.{name}"], value)
    merge.set(Key("optimizer", flags=("--lr-decay-style",)), None, ("constant",))
