"""ConfigError and the one-line check every section's validation uses."""

from __future__ import annotations

import os


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


def check_writable(flag: str, directory: str) -> None:
    """`flag`'s directory (--save, --tensorboard-dir, --data-cache-path,
    --pipeline-placement-dir) must be one this process
    can write, or creatable in one: found at start-up, on every rank, rather than at the first
    write, hours in, on the one rank that writes."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise ConfigError(f"{flag}={directory} is invalid: {path} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}={directory} is invalid: {path} is not writable by this user")
