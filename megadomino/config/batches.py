"""The global batch over the run: fixed, or ramped up from a smaller one as samples are consumed
(Megatron-LM's --rampup-batch-size START INCREMENT SAMPLES), and the run length that follows.

Ramp-up, as Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator computes it: the batch
grows from START to --global-batch-size in (GBS - START) / INCREMENT equal increments, one every
SAMPLES / increments consumed samples (a float), so the iteration that starts at `consumed`
samples runs

    START + int(consumed / (SAMPLES / increments)) * INCREMENT     while consumed <= SAMPLES
    GBS                                                            after

samples, split into micro-batches of micro_batch_size on every DP rank. With --train-samples
the run length counts the ramp's iterations one by one (every iteration that starts within
SAMPLES), then the constant phase's whole batches (Megatron-LM's `update_train_iters`: a
partial last batch is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

from megadomino.config.check import ConfigError
from megadomino.config.train import ScheduleConfig


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch at every point of a run on `dp` data-parallel ranks."""

    global_batch_size: int
    micro_batch_size: int
    dp: int
    rampup: tuple[int, int, int] | None = None
    """(start, increment, samples), or None: the batch is fixed."""

    @classmethod
    def from_config(cls, config: ScheduleConfig, dp: int) -> BatchSchedule:
        """The run's schedule; ConfigError naming the flag when the batches do not tile."""
        mbs = config.micro_batch_size
        if mbs < 1:
            raise ConfigError(f"--micro-batch-size={mbs} is invalid: it must be >= 1")
        gbs = config.global_batch_size if config.global_batch_size is not None else mbs * dp
        if gbs < 1 or gbs % (mbs * dp) != 0:
            raise ConfigError(
                f"--global-batch-size={gbs} is invalid: it must be a positive multiple of "
                f"--micro-batch-size ({mbs}) x data-parallel size ({dp}) = {mbs * dp}")
        rampup = config.rampup_batch_size
        if rampup is not None:
            rampup = tuple(rampup)
            _check_rampup(rampup, gbs, mbs * dp)
        return cls(gbs, mbs, dp, rampup)

    def global_batch(self, consumed: int) -> int:
        """The global batch of the iteration that starts after `consumed` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        if consumed > samples:
            return self.global_batch_size
        samples_per_increment = samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed / samples_per_increment) * increment

    def micro_batches(self, consumed: int) -> int:
        """Micro-batches per DP rank in the iteration that starts after `consumed` samples."""
        return self.global_batch(consumed) // (self.micro_batch_size * self.dp)

    def train_iterations(self, config: ScheduleConfig) -> int:
        """--train-iters, or the iterations --train-samples holds: the ramp's one by one, then
        whole batches."""
        if config.train_iters is not None:
            iters = config.train_iters
        elif config.train_samples is not None:
            iters = self._iterations_in(config.train_samples)
        else:
            raise ConfigError("the run length is missing: pass --train-iters or --train-samples")
        if iters < 1:
            raise ConfigError(f"the run has {iters} iterations: --train-iters (or --train-samples "
                              f"/ --global-batch-size) must give at least one")
        return iters

    def _iterations_in(self, train_samples: int) -> int:
        iterations, consumed = 0, 0
        if self.rampup is not None:
            while consumed <= self.rampup[2]:
                consumed += self.global_batch(consumed)
                iterations += 1
        return iterations + (train_samples - consumed) // self.global_batch_size

    def samples_in(self, iterations: int) -> int:
        """The samples the first `iterations` iterations consume."""
        if self.rampup is None:
            return iterations * self.global_batch_size
        consumed = 0
        for _ in range(iterations):
            consumed += self.global_batch(consumed)
        return consumed


def _check_rampup(rampup: tuple, gbs: int, tile: int) -> None:
    """Megatron-LM's rules, plus ours: every batch of the ramp tiles into micro x DP."""
    if len(rampup) != 3:
        raise ConfigError(f"--rampup-batch-size={list(rampup)} is invalid: it must be three "
                          "integers, START INCREMENT SAMPLES")
    start, increment, samples = rampup
    if min(rampup) < 1:  # SAMPLES 0 would divide by zero in Megatron-LM's formula
        raise ConfigError(f"--rampup-batch-size={list(rampup)} is invalid: START, INCREMENT and "
                          "SAMPLES must be positive")
    if start >= gbs or (gbs - start) % increment != 0:
        raise ConfigError(f"--rampup-batch-size={list(rampup)} is invalid: START must be below "
                          f"--global-batch-size ({gbs}) and reach it in whole INCREMENTs")
    if start % tile or increment % tile:
        raise ConfigError(f"--rampup-batch-size={list(rampup)} is invalid: START and INCREMENT "
                          f"must be multiples of --micro-batch-size x data-parallel size "
                          f"({tile}), so that every batch of the ramp splits into micro-batches")
