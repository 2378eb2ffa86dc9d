"""ConfigError and the one-line check every section's validation uses."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag, the value and what works."""


def check(ok: bool, flag: str, value, expected: str) -> None:
    """Raise ConfigError '`flag`=`value` is invalid: it must be `expected`' unless `ok`."""
    if not ok:
        raise ConfigError(f"{flag}={value} is invalid: it must be {expected}")
