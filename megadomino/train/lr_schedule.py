"""Megatron-LM's learning-rate schedule (its OptimizerParamScheduler): linear warmup from 0, then
constant, linear, cosine or WSD decay, counted in samples.

Megatron counts samples: every *successful* optimizer step (an fp16 step skipped for overflow
does not count) advances the schedule by that step's global batch, and the step that starts at
`n` counted samples runs at `lr(n)`, so with warmup the very first step runs at lr 0. With
--train-iters the lengths are iterations x global batch (warmup --lr-warmup-iters, decay
--lr-decay-iters or the run); with --train-samples they are --lr-warmup-samples and
--lr-decay-samples (or the run's --train-samples); a warmup fraction is that fraction of the
decay. The word embedding and output layer follow the same schedule between their own peak and
end (--decoupled-lr, --decoupled-min-lr: `lr(n, max_lr, min_lr)`).
"""

from __future__ import annotations

import math

from megadomino.config import ConfigError, ScheduleConfig
from megadomino.config.train import WSD_STYLES

DECAY_STYLES = ("constant", "linear", "cosine", "WSD")


class LRSchedule:
    """lr(step): warmup over `warmup_steps`, then decay to `min_lr` at `decay_steps`, flat after.
    WSD holds the peak until its last `wsd_decay_steps` before `decay_steps`, then anneals
    (`wsd_decay_style`)."""

    def __init__(self, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: int,
                 decay_style: str, wsd_decay_steps: int | None = None,
                 wsd_decay_style: str = "exponential"):
        if decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style={decay_style} is invalid: it must be one of "
                              f"{', '.join(DECAY_STYLES)}")
        if not 0.0 <= min_lr <= max_lr:
            raise ConfigError(f"--min-lr={min_lr} is invalid: it must be in [0, --lr ({max_lr})]")
        if decay_steps < 1:
            raise ConfigError(f"the LR decay of {decay_steps} samples is invalid: --lr-decay-iters "
                              "(or --lr-decay-samples) must give at least one")
        if not 0 <= warmup_steps <= decay_steps:
            raise ConfigError(f"LR warmup of {warmup_steps} samples is invalid: it must be in "
                              f"[0, the decay's {decay_steps}] (--lr-warmup-*, --lr-decay-*)")
        if decay_style == "WSD" and (wsd_decay_steps is None or wsd_decay_style not in WSD_STYLES):
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) and "
                              f"a --lr-wsd-decay-style of {', '.join(WSD_STYLES)}")
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.decoupled: tuple[float, float] | None = None
        """(peak, end) of the decoupled groups' LR (--decoupled-lr, --decoupled-min-lr)."""

    @classmethod
    def from_config(cls, config: ScheduleConfig, train_iters: int,
                    global_batch_size: int) -> LRSchedule:
        """The run's schedule in samples, with Megatron-LM's defaults (get_optimizer_param_
        scheduler): decay over the whole run unless its length is given; a warmup fraction is a
        fraction of the decay."""
        if config.train_samples is not None:
            decay = (config.lr_decay_samples if config.lr_decay_samples is not None
                     else config.train_samples)
            warmup = config.lr_warmup_samples
            wsd = config.lr_wsd_decay_samples
        else:
            iters = config.lr_decay_iters if config.lr_decay_iters is not None else train_iters
            decay = iters * global_batch_size
            warmup = config.lr_warmup_iters * global_batch_size
            wsd = (None if config.lr_wsd_decay_iters is None
                   else config.lr_wsd_decay_iters * global_batch_size)
        if config.lr_warmup_fraction is not None:
            warmup = config.lr_warmup_fraction * decay
        schedule = cls(config.lr, config.min_lr, warmup, decay, config.lr_decay_style, wsd,
                       config.lr_wsd_decay_style)
        if config.decoupled_lr is not None:
            schedule.decoupled = (config.decoupled_lr, config.min_lr
                                  if config.decoupled_min_lr is None else config.decoupled_min_lr)
        return schedule

    def rates(self, step: int) -> tuple[float, float | None]:
        """(the LR, the decoupled groups' LR or None without --decoupled-lr) after `step`."""
        return self(step), None if self.decoupled is None else self(step, *self.decoupled)

    def __call__(self, step: int, max_lr: float | None = None,
                 min_lr: float | None = None) -> float:
        """The LR after `step` counted samples; `max_lr` / `min_lr` replace the schedule's own
        (a parameter group's, as Megatron's param groups do)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return max_lr * float(step) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return max_lr
        if step > self.decay_steps:
            return min_lr
        decay_ratio = float(step - self.warmup_steps) / float(self.decay_steps
                                                              - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(step)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, step: int) -> float:
        anneal_start = self.decay_steps - self.wsd_decay_steps
        if step <= anneal_start:
            return 1.0
        ratio = float(step - anneal_start) / float(self.wsd_decay_steps)
        if self.wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)
