"""fp16 loss scaling with Megatron-LM's semantics, and what one optimizer step did.

The engine's step unscales the gradients, takes one decision on every rank (skip the update when
any rank's gradients hold inf/NaN) and reports it in a StepResult; the loop does not advance the
LR schedule for a skipped step.
"""

from __future__ import annotations

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


class StepResult:
    """What one optimizer step did. grad_norm: the global norm of the unscaled gradients before
    clipping (a 0-dim fp32 tensor on the device), None (or, when the skip is pending, NaN) when
    the step was skipped. `skipped` may be given as a 0-dim bool tensor on the device, the skip
    the step decided there: then the step was enqueued without the host waiting for it, and the
    flag is read on first access (`settled` says whether it has been), which the training loop
    puts off until the next step's forward and backward are enqueued.

    On CUDA the flag is copied to pinned host memory as soon as it is given, behind an event:
    reading it waits for that event, the step it belongs to, and not for what was enqueued on
    the stream since (`.item()` would wait for all of it, the next step's backward too, and the
    GPU would then idle while the host enqueued the next optimizer step)."""

    __slots__ = ("_skipped", "_ready", "grad_norm", "loss_scale")

    def __init__(self, skipped: bool | torch.Tensor, grad_norm: torch.Tensor | None,
                 loss_scale: float | None):
        self._ready = None
        if isinstance(skipped, torch.Tensor) and skipped.is_cuda:
            host = torch.empty(skipped.shape, dtype=skipped.dtype, device="cpu",
                               pin_memory=True)
            host.copy_(skipped, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
            skipped = host
        self._skipped, self.grad_norm, self.loss_scale = skipped, grad_norm, loss_scale

    @property
    def skipped(self) -> bool:
        if isinstance(self._skipped, torch.Tensor):
            if self._ready is not None:
                self._ready.synchronize()
                self._ready = None
            self._skipped = bool(self._skipped.item())
        return self._skipped

    @property
    def settled(self) -> bool:
        return not isinstance(self._skipped, torch.Tensor)

    def __repr__(self) -> str:
        skipped = self._skipped if self.settled else "pending"
        return f"StepResult(skipped={skipped}, grad_norm={self.grad_norm}, " \
               f"loss_scale={self.loss_scale})"
