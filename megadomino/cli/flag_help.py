"""How `--help` and `--help-all` present the flag table: subject groups and defaults.

`--help` lists the implemented flags and our own, each under the subject of the config section
its row sets (`HELP_GROUPS`, matched on the row's field path, or `Flag.group` for a row that sets
no single field) and each saying its default; the notice and refused rows still parse but are
hidden. `--help-all` lists every row, the notices and refusals in groups of their own with their
texts. Both print and exit 0 from argparse, before any flag is checked or any process group
exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from megadomino.cli.flag_row import IMPLEMENTED, NOTICE, OURS, REFUSED, Flag
from megadomino.config import FAMILY_DEFAULTS, Config

HELP_GROUPS: tuple[tuple[str, str], ...] = (
    ("model", "model shape"),
    ("parallel.zero", "ZeRO and the distributed optimizer"),
    ("parallel.domino", "Domino"),
    ("parallel.diloco", "DiLoCo: data parallelism across slow links"),
    ("parallel", "parallelism, recompute and speed"),
    ("train.schedule", "batch, iterations, learning-rate schedule and evaluation"),
    ("train.optimizer", "optimizer"),
    ("train.precision", "precision and FP8"),
    ("train.data", "data and tokenizer"),
    ("train.checkpoint", "checkpoints"),
    ("train.logging", "logging and profiling"),
    ("train.runtime", "seed, stopping, timeouts and memory"),
    ("deepspeed", "DeepSpeed config file"),
)
"""(field path prefix, title) of each --help group, in the order --help shows them; a row goes
to the first whose prefix its field (or `Flag.group`) starts with."""

_POLICY_GROUPS = {NOTICE: "accepted with a notice (the flag changes nothing here; the notice "
                          "says what happens instead)",
                  REFUSED: "refused (a feature megadomino lacks; an error says why)"}


def help_group(flag: Flag) -> str:
    """The title of the --help-all group `flag` (not an alias) is listed under."""
    if flag.policy in _POLICY_GROUPS:
        return _POLICY_GROUPS[flag.policy]
    path = flag.field or flag.group
    if path is None:
        raise ValueError(f"{flag.name}: give the row a field or a group (cli/flag_help.py)")
    for prefix, title in HELP_GROUPS:
        if path == prefix or path.startswith(prefix + "."):
            return title
    raise ValueError(f"{flag.name}: {path} matches no HELP_GROUPS prefix")


def group_titles() -> list[str]:
    """Every group title, in the order help shows them."""
    return [title for _, title in HELP_GROUPS] + list(_POLICY_GROUPS.values())


def shown_by_default(flag: Flag) -> bool:
    """Whether plain --help lists `flag` (aliases show as their target's other spelling)."""
    return flag.policy in (IMPLEMENTED, OURS)


def default_note(flag: Flag, family: str, required: tuple[str, ...]) -> str:
    """What a row of plain --help says of its default: '' where its text already states it."""
    if flag.name in required:
        return "(required unless --model-preset gives it)"
    if flag.type is None:
        return "(default: off)"
    if "default" in flag.text.lower():
        return ""
    if flag.field is None:
        return "(default: none)"
    value = field_default(flag.field, family)
    if value is None:
        return "(default: none)"
    if isinstance(value, (list, tuple)):
        value = " ".join(str(v) for v in value)
    return f"(default: {value})"


def field_default(path: str, family: str) -> Any:
    """The default of the config field at `path` ('train.schedule.lr'), a model field as
    `family`'s (FAMILY_DEFAULTS)."""
    *sections, name = path.split(".")
    if sections == ["model"] and name in FAMILY_DEFAULTS[family]:
        return FAMILY_DEFAULTS[family][name]
    cls = Config
    for section in sections:  # an optional section (train.precision.fp8): its dataclass's
        hint = typing.get_type_hints(cls)[section]
        cls = next(arg for arg in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(arg))
    field = _fields(cls)[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    return None if field.default_factory is dataclasses.MISSING else field.default_factory()


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {field.name: field for field in dataclasses.fields(cls)}


class HelpAll(argparse.Action):
    """--help-all: print the help of every row (`make_parser(show_all=True)`) and exit 0."""

    def __init__(self, option_strings, dest, make_parser=None, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.make_parser = make_parser

    def __call__(self, parser, namespace, values, option_string=None):
        self.make_parser(show_all=True).print_help()
        parser.exit()
