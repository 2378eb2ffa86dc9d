"""Mixed-precision AdamW: fp32 master weights, TP-correct global grad-norm clipping, fp16 scaling.

The optimizer reads gradients from `param.main_grad` (the fp32 buffer of `training.ddp.GradBuffer`,
already averaged over DP). bf16/fp16 parameters get an fp32 master copy that AdamW updates and
that is copied back into the model after each step; fp32 parameters are their own master.
1-D parameters (biases, norm weights) get no weight decay.

Grad norm under TP: a parameter marked `tensor_model_parallel = True` is a shard, so its squared
norm is summed over the TP group; any other parameter is replicated (identical gradient on every
TP rank once `finish_grad_sync()` has summed the sequence-parallel ones) and is counted on TP rank
0 only. Megatron's rule, in one all-reduce of one scalar.

fp16: `DynamicLossScaler` with Megatron's semantics. The step unscales the gradients, all-reduces
"found inf/NaN" over the whole world so every rank takes the same decision, and skips the update
(and the LR schedule's step, see the loop) when any rank overflowed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megadomino.config import ConfigError, TrainConfig
from megadomino.parallel import ParallelDims


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
    clipping (a 0-dim fp32 tensor, not synced to the host), None when the step was skipped."""

    skipped: bool
    grad_norm: torch.Tensor | None
    loss_scale: float | None


class MixedPrecisionAdamW:
    """AdamW over fp32 masters of `params`, whose gradients are their `main_grad`."""

    def __init__(self, params: Iterable[nn.Parameter], dims: ParallelDims, *, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float, clip_grad: float,
                 loss_scaler: DynamicLossScaler | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.dims = dims
        self.clip_grad = clip_grad
        self.loss_scaler = loss_scaler
        self.masters = [p if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        self._sharded = [getattr(p, "tensor_model_parallel", False) for p in self.params]
        decay = [m for m in self.masters if m.ndim >= 2]
        no_decay = [m for m in self.masters if m.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        on_cuda = bool(self.masters) and self.masters[0].is_cuda
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                                       eps=eps, fused=True if on_cuda else None,
                                       foreach=None if on_cuda else True)

    def set_lr(self, lr: float) -> None:
        for group in self.adamw.param_groups:
            group["lr"] = lr

    def step(self) -> StepResult:
        """Unscale (fp16), skip on overflow, clip to `clip_grad` by global norm, AdamW, and copy
        the masters into the model's parameters. Call after `GradBuffer.finish_grad_sync()`."""
        grads = [p.main_grad for p in self.params]
        scale = None
        if self.loss_scaler is not None:
            scale = self.loss_scaler.scale
            if self._unscale_and_check(grads):
                self.loss_scaler.update(found_inf=True)
                return StepResult(skipped=True, grad_norm=None, loss_scale=scale)
            self.loss_scaler.update(found_inf=False)
        grad_norm = self.global_grad_norm(grads)
        for master, grad in zip(self.masters, grads):
            master.grad = grad
        try:
            if self.clip_grad > 0:
                torch.nn.utils.clip_grads_with_norm_(self.masters, self.clip_grad, grad_norm)
            self.adamw.step()
        finally:
            for master in self.masters:
                master.grad = None
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                if param is not master:
                    param.copy_(master)
        return StepResult(skipped=False, grad_norm=grad_norm, loss_scale=scale)

    def global_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm over all of the model's gradients, the same on every rank of the TP group."""
        counted = [g for g, sharded in zip(grads, self._sharded)
                   if sharded or self.dims.tp_rank == 0]
        device = grads[0].device if grads else torch.device("cpu")
        if counted:
            square = torch.nn.utils.get_total_norm(counted, norm_type=2.0).float() ** 2
        else:
            square = torch.zeros((), device=device)
        if self.dims.tp > 1:
            dist.all_reduce(square, group=self.dims.tp_group)
        return square.sqrt()

    def _unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Multiply grads by 1/scale in place; True when any grad on any rank is inf or NaN."""
        device = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros(1, device=device)
        inv_scale = torch.full((1,), 1.0 / self.loss_scaler.scale, device=device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item() > 0)

    def state_dict(self) -> dict:
        """AdamW state, the fp32 masters of low-precision parameters (index -> tensor, so that a
        resumed run continues from the exact fp32 weights) and the loss scaler's state."""
        return {
            "adamw": self.adamw.state_dict(),
            "masters": {i: m for i, (p, m) in enumerate(zip(self.params, self.masters))
                        if p is not m},
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.adamw.load_state_dict(state["adamw"])
        with torch.no_grad():
            for i, master in state["masters"].items():
                self.masters[i].copy_(master)
                self.params[i].copy_(self.masters[i])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])


def build_optimizer(params: Iterable[nn.Parameter], dims: ParallelDims,
                    config: TrainConfig) -> MixedPrecisionAdamW:
    """The optimizer `config` describes: a dynamic loss scaler exactly when --fp16."""
    scaler = None
    if config.fp16:
        scaler = DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale,
                                   config.loss_scale_window, config.hysteresis)
    return MixedPrecisionAdamW(params, dims, lr=config.lr, weight_decay=config.weight_decay,
                               betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                               clip_grad=config.clip_grad, loss_scaler=scaler)
