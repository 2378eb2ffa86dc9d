"""The global batch over the run: fixed, ramped up from a smaller one as samples are consumed
(Megatron-LM's --rampup-batch-size START INCREMENT SAMPLES), or stepped at sample thresholds
(Megatron-LM's --step-batch-size-schedule), and the run length that follows.

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

A stepped schedule, as Megatron-LM's StepBatchsizeNumMicroBatchesCalculator computes it: pairs
(THRESHOLD, BATCH) sorted by threshold, the first at 0; the iteration that starts at `consumed`
samples runs the BATCH of the last pair whose THRESHOLD <= consumed. On the command line the
thresholds count tokens (Megatron-LM's reading whenever --seq-length is given, which it always is
here: THRESHOLD // seq-length samples) with K/M/B/T suffixes; in the config they are samples.
With --train-samples the run has every iteration that starts below it (update_train_iters: the
last batch may overrun --train-samples). The schedule's last batch is the run's global batch,
the one the LR lengths of a --train-iters run are counted in. Megatron-LM checks that a batch
tiles into micro-batch x DP only when it is reached; here every batch of the schedule is checked
before the run starts.
"""

from __future__ import annotations

import bisect
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
    """(start, increment, samples), or None: the batch is fixed (or stepped)."""
    steps: tuple[tuple[int, int], ...] | None = None
    """((threshold samples, batch), ...) from threshold 0 up, or None: not stepped."""

    @classmethod
    def from_config(cls, config: ScheduleConfig, dp: int) -> BatchSchedule:
        """The run's schedule; ConfigError naming the flag when the batches do not tile."""
        mbs = config.micro_batch_size
        if mbs < 1:
            raise ConfigError(f"--micro-batch-size={mbs} is invalid: it must be >= 1")
        gbs = _global_batch(config, mbs, dp)
        steps = config.step_batch_size_schedule
        if steps is not None:
            steps = _checked_steps(steps, config, mbs * dp)
            return cls(steps[-1][1], mbs, dp, steps=steps)
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
        if self.steps is not None:
            at = bisect.bisect_right([threshold for threshold, _ in self.steps], consumed)
            return self.steps[at - 1][1]
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

    @property
    def one_micro_batch(self) -> bool:
        """Every step runs one micro-batch per DP rank: a fixed global batch of micro x DP."""
        return (self.rampup is None and self.steps is None
                and self.global_batch_size == self.micro_batch_size * self.dp)

    @property
    def final_micro_batches(self) -> int:
        """Micro-batches per DP rank once any ramp-up or stepped schedule is done."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

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
        if self.steps is not None:  # every iteration that starts below train_samples
            while consumed < train_samples:
                consumed += self.global_batch(consumed)
                iterations += 1
            return iterations
        if self.rampup is not None:
            while consumed <= self.rampup[2]:
                consumed += self.global_batch(consumed)
                iterations += 1
        return iterations + (train_samples - consumed) // self.global_batch_size

    def samples_in(self, iterations: int) -> int:
        """The samples the first `iterations` iterations consume."""
        if self.rampup is None and self.steps is None:
            return iterations * self.global_batch_size
        consumed = 0
        for _ in range(iterations):
            consumed += self.global_batch(consumed)
        return consumed


def sample_counts(schedule: ScheduleConfig, dp: int) -> tuple[int, int, int]:
    """Samples the train, valid and test splits must hold for this run (Megatron-LM's sizing)."""
    batches = BatchSchedule.from_config(schedule, dp)
    gbs, iters = batches.global_batch_size, batches.train_iterations(schedule)
    evaluations = iters // schedule.eval_interval + 1 if schedule.eval_interval > 0 else 0
    return (batches.samples_in(iters), evaluations * schedule.eval_iters * gbs,
            schedule.eval_iters * gbs)


def _global_batch(config: ScheduleConfig, mbs: int, dp: int) -> int:
    """--global-batch-size, else micro-batch x DP x the accumulation steps of a DeepSpeed JSON;
    with both, DeepSpeed's rule: they must be equal."""
    steps, tile = config.gradient_accumulation_steps, mbs * dp
    if steps is None:
        return config.global_batch_size if config.global_batch_size is not None else tile
    where = "--deepspeed_config's gradient_accumulation_steps"
    if config.rampup_batch_size is not None or config.step_batch_size_schedule is not None:
        raise ConfigError(f"{where} fixes the batch, which --rampup-batch-size or "
                          "--step-batch-size-schedule changes: give one of them")
    if config.global_batch_size not in (None, steps * tile):
        raise ConfigError(f"{where}={steps} makes the global batch --micro-batch-size ({mbs}) "
                          f"x data-parallel size ({dp}) x {steps} = {steps * tile}, not "
                          f"{config.global_batch_size} (its train_batch_size or "
                          "--global-batch-size): DeepSpeed requires them equal")
    return steps * tile


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


SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_step_schedule(text: str, seq_length: int) -> list[list[int]]:
    """--step-batch-size-schedule "THRESHOLD:BATCH ..." (spaces or commas between pairs, K/M/B/T
    suffixes, thresholds in tokens) as [[threshold samples, batch], ...] sorted by threshold, the
    numbers read as Megatron-LM reads them (int(float(number) x suffix))."""
    pairs = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        try:
            if not sep:
                raise ValueError(entry)
            tokens, size = _number(threshold), _number(batch)
        except ValueError:
            raise ConfigError(f"--step-batch-size-schedule entry {entry!r} is invalid: each entry "
                              "is THRESHOLD:BATCH, e.g. '0:16 2.4B:320' (thresholds in tokens, "
                              "K/M/B/T suffixes)") from None
        pairs.append([tokens // seq_length, size])
    if not pairs:
        raise ConfigError("--step-batch-size-schedule is empty: give THRESHOLD:BATCH pairs, e.g. "
                          "'0:16 2.4B:320'")
    return sorted(pairs, key=lambda pair: pair[0])


def _number(text: str) -> int:
    text = text.strip().upper()
    scale = SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _checked_steps(steps: list, config: ScheduleConfig, tile: int) -> tuple[tuple[int, int], ...]:
    """Megatron-LM's rules (first threshold 0, strictly increasing, positive batches), and ours:
    every batch tiles into micro-batch x DP, the batch is not ramped as well, and a given
    --global-batch-size is the schedule's last batch."""
    flag = "--step-batch-size-schedule"
    steps = tuple((int(threshold), int(batch)) for threshold, batch in steps)
    if config.rampup_batch_size is not None:
        raise ConfigError(f"{flag} and --rampup-batch-size both set the batch size: give one")
    if steps[0][0] != 0:
        raise ConfigError(f"{flag} is invalid: its first threshold must be 0 (samples), not "
                          f"{steps[0][0]}")
    for (before, _), (after, _) in zip(steps, steps[1:]):
        if after <= before:
            raise ConfigError(f"{flag} is invalid: thresholds must increase, got {before} then "
                              f"{after} samples (a token threshold is divided by --seq-length)")
    for _, batch in steps:
        if batch < 1 or batch % tile:
            raise ConfigError(f"{flag} batch {batch} is invalid: every batch must be a positive "
                              f"multiple of --micro-batch-size x data-parallel size ({tile})")
    last = steps[-1][1]
    if config.global_batch_size is not None and config.global_batch_size != last:
        raise ConfigError(f"--global-batch-size={config.global_batch_size} contradicts {flag}, "
                          f"whose last batch is {last}: drop --global-batch-size (Megatron-LM "
                          "refuses the two together)")
    return steps
