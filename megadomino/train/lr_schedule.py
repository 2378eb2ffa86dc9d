"""Megatron-LM's learning-rate schedule: linear warmup from 0, then constant, linear or cosine.

Megatron counts scheduler steps (one per *successful* optimizer step; an fp16 step skipped for
overflow does not advance it) and the optimizer step numbered `n` (0-based) runs at `lr(n)`, so
with warmup the very first step runs at lr 0, as in Megatron.
"""

from __future__ import annotations

import math

from megadomino.config import ConfigError, ScheduleConfig

DECAY_STYLES = ("constant", "linear", "cosine")


class LRSchedule:
    """lr(step): warmup over `warmup_iters`, then decay to `min_lr` at `decay_iters`, flat after."""

    def __init__(self, max_lr: float, min_lr: float, warmup_iters: float, decay_iters: int,
                 decay_style: str):
        if decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style={decay_style} is invalid: it must be one of "
                              f"{', '.join(DECAY_STYLES)}")
        if not 0.0 <= min_lr <= max_lr:
            raise ConfigError(f"--min-lr={min_lr} is invalid: it must be in [0, --lr ({max_lr})]")
        if decay_iters < 1:
            raise ConfigError(f"--lr-decay-iters={decay_iters} is invalid: it must be >= 1")
        if not 0 <= warmup_iters <= decay_iters:
            raise ConfigError(f"LR warmup of {warmup_iters} iterations is invalid: it must be in "
                              f"[0, --lr-decay-iters ({decay_iters})]")
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_iters, self.decay_iters = warmup_iters, decay_iters
        self.decay_style = decay_style

    @classmethod
    def from_config(cls, config: ScheduleConfig, train_iters: int) -> LRSchedule:
        """Megatron's defaults: decay over --lr-decay-iters or else the whole run; a warmup
        fraction, when given, is a fraction of the decay iterations and wins over --lr-warmup-iters.
        """
        decay_iters = config.lr_decay_iters if config.lr_decay_iters is not None else train_iters
        if config.lr_warmup_fraction is not None:
            warmup_iters = config.lr_warmup_fraction * decay_iters
        else:
            warmup_iters = config.lr_warmup_iters
        return cls(config.lr, config.min_lr, warmup_iters, decay_iters, config.lr_decay_style)

    def __call__(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        decay_ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)
