"""ConfigError and the one-line check every section's validation uses."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; each message names the flag, the value and what works.
    Several messages (every bad flag of one command) print as one `error:` line each."""

    def __init__(self, *messages: str, alike: bool = False):
        super().__init__("\n".join(messages))
        self.messages = list(messages)
        self.alike = alike
        """Raised on every rank with the same messages (one rank's outcome, broadcast): one
        rank a node prints it."""


def check(ok: bool, flag: str, value, expected: str) -> None:
    """Raise ConfigError '`flag`=`value` is invalid: it must be `expected`' unless `ok`."""
    if not ok:
        raise ConfigError(f"{flag}={value} is invalid: it must be {expected}")
