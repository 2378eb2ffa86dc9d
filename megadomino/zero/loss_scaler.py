"""fp16 loss scaling with Megatron-LM's semantics, and what one optimizer step did.

The engine's step unscales the gradients, takes one decision on every rank (skip the update when
any rank's gradients hold inf/NaN) and reports it in a StepResult; the loop does not advance the
LR schedule for a skipped step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadomino.config import ConfigError


class DynamicLossScaler:
    """Megatron's DynamicGradScaler. An overflow resets the growth count and uses up one unit of
    hysteresis; once hysteresis is exhausted each further overflow multiplies the scale by
    `backoff_factor` (not below `min_scale`). `window` overflow-free steps in a row multiply it by
    `growth_factor` and restore the hysteresis (only growth restores it: clean steps between two
    overflows do not)."""

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if not 0 < min_scale <= initial_scale:
            raise ConfigError(f"--min-loss-scale={min_scale} is invalid: it must be in "
                              f"(0, --initial-loss-scale ({initial_scale})]")
        if window < 1:
            raise ConfigError(f"--loss-scale-window={window} is invalid: it must be >= 1")
        if hysteresis < 1:
            raise ConfigError(f"--hysteresis={hysteresis} is invalid: it must be >= 1")
        self.scale = float(initial_scale)
        self.min_scale, self.window, self.hysteresis = float(min_scale), window, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.window:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = state["growth_tracker"]
        self._hysteresis_tracker = state["hysteresis_tracker"]


@dataclass
class StepResult:
    """What one optimizer step did. grad_norm: the global norm of the unscaled gradients before
    clipping (a 0-dim fp32 tensor on the device), None when the step was skipped."""

    skipped: bool
    grad_norm: torch.Tensor | None
    loss_scale: float | None
