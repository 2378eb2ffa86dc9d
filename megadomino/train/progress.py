"""Progress lines for a phase that may take a while (validation): a line when it starts, then,
once it has run `quiet_s`, at most one line every `every_s` with the steps done and the time."""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """`tick(done)` after each of `total` steps; lines go to `log` (None: silent, other ranks)."""

    def __init__(self, log: Callable[[str], None] | None, what: str, total: int, unit: str,
                 quiet_s: float = 5.0, every_s: float = 10.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.log, self.what, self.total, self.unit = log, what, total, unit
        self.quiet_s, self.every_s, self.clock = quiet_s, every_s, clock
        self.start, self.last = clock(), None
        if log is not None:
            log(f" {what}: {total} {unit}")

    def tick(self, done: int) -> None:
        if self.log is None or done >= self.total:
            return
        now = self.clock()
        if now - self.start >= self.quiet_s and (self.last is None
                                                 or now - self.last >= self.every_s):
            self.last = now
            self.log(f" {self.what}: {done}/{self.total} {self.unit} in "
                     f"{now - self.start:.0f} s")
