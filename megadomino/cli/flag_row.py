"""One row of the flag policy (`Flag`), its five policies, and the builders the tables use.

    implemented  a Megatron-LM flag that works as in Megatron-LM (a few values may be refused)
    alias        another spelling of a row's flag (an older Megatron-LM name, a fork's, or
                 `--local_rank`): argparse stores it where that row's flag goes
    ours         one of megadomino's own flags
    notice       a Megatron-LM flag that only tunes performance, logging or memory, or names
                 something we always do: accepted, and reported in one grouped notice
    refused      a Megatron-LM flag for a feature we lack: an error that says why (where a value
                 asks for nothing, such as a parallel size of 1, it is accepted)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megadomino.config.train import FP8_AUTO, FP8_ROLES

IMPLEMENTED, ALIAS, OURS, NOTICE, REFUSED = "implemented", "alias", "ours", "notice", "refused"


@dataclass(frozen=True)
class Flag:
    """One row of the flag policy."""

    name: str
    policy: str
    text: str
    """What the flag does (implemented, ours, alias), the notice (notice) or the reason
    (refused)."""
    field: str | None = None
    """The field's path in megadomino.config.Config ('model.num_layers', 'parallel.zero.stage',
    'train.schedule.lr'); None: parse_args handles it."""
    type: Callable[[str], Any] | None = None
    """Parses the value; None for a switch, which stores `const` (refused switches swallow
    whatever values follow them)."""
    const: Any = True
    choices: tuple | None = None
    nargs: str | None = None
    """argparse nargs for a flag taking several values (--data-path)."""
    supported: tuple | None = None
    """Values that work; any other is refused, with `text` (refused) or `unsupported`."""
    unsupported: str = ""
    alias_of: str | None = None
    """alias: the name of the row this spelling belongs to."""
    group: str | None = None
    """An implemented or ours row that sets no single field: the config section (a field path
    prefix, 'model') whose --help group lists it (cli/flag_help.HELP_GROUPS)."""

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def metavar(self) -> str:
        if self.choices is not None:  # the usage line shows only the choices that work
            shown = self.choices if self.supported is None else self.supported
            return "{" + ",".join(str(c) for c in shown) + "}"
        if self.type is None:
            return "..." if self.policy == REFUSED else ""
        names = {int: "N", count: "N", float: "X", slices_or_auto: "N|auto",
                 roles_or_auto: "all|auto|ROLE,...", value: "VALUE"}
        return names.get(self.type, "NAME")

    @property
    def help(self) -> str:
        """The --help text: the policy, the text and the values note."""
        return " ".join(filter(None, (f"[{self.policy}] {self.text}", self.values_note)))

    @property
    def values_note(self) -> str:
        """Which values work and which are refused, with the reason; '' when every value the
        flag parses works. --help and docs/flags.md both say it."""
        if self.supported is None:
            return ""
        accepted = ", ".join(str(v) for v in self.supported)
        if self.policy == REFUSED:
            return f"(accepted at {accepted})"
        if self.choices is None:
            return f"Values other than {accepted} are refused: {self.unsupported}."
        refused = ", ".join(str(c) for c in self.choices if c not in self.supported)
        return f"Accepted: {accepted}; refused: {refused} ({self.unsupported})."

    def refusal(self, value: Any) -> str | None:
        """Why the flag given with `value` is refused, or None when it works."""
        if self.supported is not None and value in self.supported:
            return None
        if self.policy == REFUSED:
            return self.text
        return self.unsupported if self.supported is not None else None


def slices_or_auto(value: str) -> int | str:
    """An integer, or 'auto' (resolved at start-up by megadomino.overlap.domino.autotune)."""
    return value if value == "auto" else int(value)


def roles_or_auto(value: str) -> tuple[str, ...] | str:
    """--fp8-linears: 'all' (every role of FP8_ROLES), 'auto', or a comma list of roles, kept as
    given (the validator names a role it does not know)."""
    if value in ("all", FP8_AUTO):
        return FP8_ROLES if value == "all" else value
    return tuple(role.strip() for role in value.split(","))


def count(value: str) -> int:
    """A whole count, also written as a float: '2e8' -> 200000000 (argparse's error otherwise)."""
    number = float(value)
    if number != int(number):
        raise ValueError(f"{value} is not a whole number")
    return int(number)


def impl(name: str, field: str | None, type_: Callable | None, text: str, **kw) -> Flag:
    return Flag(name, IMPLEMENTED, text, field, type_, **kw)


def ours(name: str, field: str | None, type_: Callable | None, text: str, **kw) -> Flag:
    return Flag(name, OURS, text, field, type_, **kw)


def alias(name: str, of: str, text: str) -> Flag:
    return Flag(name, ALIAS, text, alias_of=of)


def notice(name: str, text: str, type_: Callable | None = None, **kw) -> Flag:
    return Flag(name, NOTICE, text, None, type_, **kw)


def notices(names: tuple[str, ...], text: str, type_: Callable | None = None) -> list[Flag]:
    """Rows sharing one notice; `type_` None: switches, else every one takes one value."""
    return [Flag(name, NOTICE, text, None, type_) for name in names]


def refuse(names: tuple[str, ...], text: str) -> list[Flag]:
    return [Flag(name, REFUSED, text) for name in names]


def value(text: str) -> str:
    """A value kept as given: notices accept a value they do not read."""
    return text


@dataclass(frozen=True)
class Range:
    """The values a numeric flag accepts: low and high bounds (None: unbounded), each inclusive
    or not. Checked on every rank before any process group (arguments.parse_args)."""

    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True

    def __contains__(self, value: float) -> bool:
        if value != value:  # NaN
            return False
        if self.low is not None and (value < self.low or value == self.low
                                     and not self.low_inclusive):
            return False
        return self.high is None or value < self.high or (value == self.high
                                                          and self.high_inclusive)

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>=' if self.low_inclusive else '>'} {self.low:g}"
        return (f"in {'[' if self.low_inclusive else '('}{self.low:g}, {self.high:g}"
                f"{']' if self.high_inclusive else ')'}")
