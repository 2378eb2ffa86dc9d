"""--manual-gc: Python's garbage collector on a schedule every rank shares, as in Megatron-LM."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from megadomino.config import RuntimeConfig


class ManualGC:
    """Without --manual-gc: does nothing. With it, the automatic collector is off for the run (its
    pauses fall on one rank at a time while the others wait in the next collective) and every
    rank collects at the start, after each --manual-gc-interval-th iteration (0: never) and,
    unless --no-manual-gc-eval, before and after evaluation. The collector is enabled again on
    exit if it was before."""

    def __init__(self, config: RuntimeConfig):
        self.enabled, self.interval = config.manual_gc, config.manual_gc_interval
        self.around_evaluation = config.manual_gc_eval
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> ManualGC:
        if self.enabled:
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()

    def after_iteration(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        if self.enabled and self.around_evaluation:
            gc.collect()
        yield
        if self.enabled and self.around_evaluation:
            gc.collect()
