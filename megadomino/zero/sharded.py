"""The sharded optimizer: fp32 master shards, the user's optimizer over them, the global step.

One optimizer for every stage: at stage 0 a rank's chunk of a unit is the whole unit, so the
same code keeps whole fp32 masters (plain data parallelism with mixed precision).
Each rank keeps fp32 masters of its chunk of every unit (for fp32 models the parameter shard
itself) and hands the user's optimizer one tensor per (parameter, this rank's chunk) overlap, a
view into the masters whose `.grad` is the matching view of the reduced gradient shard (Megatron's
distributed optimizer does the same). Parameters of 2 or more dims get weight decay, the rest
(biases, norm weights) none: `optimizer_factory([{"params": decayed}, {"params": rest,
"weight_decay": 0.0}])` (groups left out when empty). The `decoupled` parameters (the word
embedding and output layer under --decoupled-lr) make two more such groups, marked
`"decoupled": True`, which `set_lr` gives their own rate (Megatron's param groups).

The step, collective over the ranks of one model replica (every rank must call it):
  1. gradients of `sequence_parallel` parameters are summed over the TP group (their reduced
     shards line up across TP ranks: the layouts are identical);
  2. fp16: gradients are unscaled by the loss scale;
  3. one all-reduce of [sum of squares, inf/NaN found] over the ranks that hold different
     gradients gives the global grad norm (Megatron's rule under TP: `tensor_model_parallel`
     shards counted on every TP rank, replicated parameters on TP rank 0 only) and a decision all
     ranks share: a non-finite step is skipped (always with a loss scaler, whose scale backs off;
     else per `on_nonfinite`, 'error' raising FloatingPointError everywhere). Stages 1 and 3:
     DP ranks hold disjoint chunks, the all-reduce is over the ranks of one model replica
     (`dims.replica_group`: the world, or a DiLoCo site's ranks). Stage 0: DP ranks hold
     the same (all-reduced) gradients, so it is over the TP group, then the pipeline group
     (pipeline stages hold different parameters; the last stage's copy of a tied embedding,
     marked `pipeline_duplicate`, is counted on the first stage only), and the
     found flag is in it only with a loss scaler (nothing else sets it; a non-finite norm
     skips the step all the same);
  4. clip to `clip_grad` by that norm (torch's clip_grads_with_norm_ coefficient), optimizer step,
     masters copied into the parameter shards (the caller then refreshes the parameters). The
     fused Adam / AdamW kernels clip as they read each gradient (their `grad_scale`, set to 1 /
     the coefficient), so clipping adds no pass over the gradients; others multiply first.

The skip decision stays on the device where the optimizer can take it there: torch's fused Adam /
AdamW kernels read a `found_inf` flag and leave the parameters, moments and step counts as they
were when it is set, so the step is enqueued right behind the statistics' all-reduce and the host
reads the decision only afterwards (reading it first would leave the GPU idle while the host
enqueues the optimizer). Other optimizers (SGD: torch's fused SGD initialises its momentum on a
skipped first step) are stepped only after the host has read the decision.

On CUDA, AdamW runs as one pass per flat master (`adamw_flat`, a Triton kernel:
kernels/adamw_flat.py; its torch reference on CPU): its moments are flat buffers beside the
masters (torch's optimizer state holds views of them, so its
state_dict and load_state_dict keep their format), each element's learning rate and weight decay
come from its parameter group by a small per-element group index, and the same pass writes the
parameter shard's bf16/fp16 copy. Each element is read and written once: the per-parameter fused
kernel plus the separate copy moved 34 bytes an element, this moves 31 (about 30% less time for
the step of a 1.3B model: benchmarks/bench_optimizer.py). The step count is one device tensor
shared by every parameter of the optimizer (all of them step together; state_dict gives each its
own copy). Elsewhere (CPU, SGD)
torch's optimizer steps over the per-parameter views.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megadomino.kernels.adamw_flat import adamw_flat
from megadomino.zero.collectives import CommCounter
from megadomino.zero.loss_scaler import DynamicLossScaler, StepResult
from megadomino.zero.partition import FlatUnit

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


class ShardedOptimizer:
    def __init__(self, units: list[FlatUnit], param_shards: list[torch.Tensor],
                 grad_shards: list[torch.Tensor], dims, comm: CommCounter,
                 optimizer_factory: OptimizerFactory, clip_grad: float,
                 loss_scaler: DynamicLossScaler | None, on_nonfinite: str, whole: bool = False,
                 decoupled: frozenset[int] = frozenset(), flat: bool | None = None):
        """`whole`: stage 0 (every DP rank holds the whole units and the same gradients);
        `decoupled`: ids of the parameters whose pieces go to the decoupled groups; `flat`:
        step AdamW by adamw_flat (None: on CUDA for AdamW, `_flat_by_default`)."""
        self.dims, self.comm, self.clip_grad, self.whole = dims, comm, clip_grad, whole
        self.loss_scaler, self.on_nonfinite = loss_scaler, on_nonfinite
        self.param_shards, self.grad_shards = param_shards, grad_shards
        self.masters = [s if s.dtype == torch.float32 else s.float() for s in param_shards]
        groups: dict[tuple[bool, bool], list[torch.Tensor]] = {
            (decoupled_group, decay): [] for decoupled_group in (False, True)
            for decay in (True, False)}
        self.pieces: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        """(parameter, the view of the masters holding its piece of this rank's chunk)."""
        self._counted: list[torch.Tensor] = []
        self._sequence_parallel: list[torch.Tensor] = []
        self._spans: list[tuple[torch.Tensor, int, slice]] = []
        """(view of the masters, index of its master, its span there) per piece."""
        for index, (unit, master, grad) in enumerate(zip(units, self.masters, grad_shards)):
            for piece in unit.pieces:
                param = unit.params[piece.index]
                span = slice(piece.shard_start, piece.shard_start + piece.numel)
                master_piece, grad_piece = master[span], grad[span]
                master_piece.grad = grad_piece
                self.pieces.append((param, master_piece))
                self._spans.append((master_piece, index, span))
                decay = len(unit.shapes[piece.index]) >= 2
                groups[(id(param) in decoupled, decay)].append(master_piece)
                if (getattr(param, "tensor_model_parallel", False) or dims.tp_rank == 0) \
                        and not getattr(param, "pipeline_duplicate", False):
                    self._counted.append(grad_piece)
                if dims.tp > 1 and getattr(param, "sequence_parallel", False):
                    self._sequence_parallel.append(grad_piece)
        param_groups = [{"params": params, **({} if decay else {"weight_decay": 0.0}),
                         **({"decoupled": True} if decoupled_group else {})}
                        for (decoupled_group, decay), params in groups.items() if params]
        if not param_groups:
            raise ValueError(f"DP rank {dims.dp_rank} holds no parameter: the model is too "
                             f"small to shard over {dims.dp} ranks")
        self.optimizer = optimizer_factory(param_groups)
        self._skips_on_device = (isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW)
                                 and bool(self.optimizer.defaults.get("fused")))
        self.flat = flat if flat is not None else self._flat_by_default()
        if self.flat:
            self._init_flat()

    def _flat_by_default(self) -> bool:
        """adamw_flat on CUDA for AdamW (no amsgrad, maximize or differentiable)."""
        defaults = self.optimizer.defaults
        return (type(self.optimizer) is torch.optim.AdamW and self.masters[0].is_cuda
                and not any(defaults.get(key) for key in ("amsgrad", "maximize",
                                                          "differentiable")))

    def _init_flat(self) -> None:
        """Flat moments beside the masters, each element's group index, one step counter, and
        torch's state pointed at views of them."""
        device = self.masters[0].device
        self._step = torch.zeros((), device=device)
        self._exp_avg = [torch.zeros_like(m) for m in self.masters]
        self._exp_avg_sq = [torch.zeros_like(m) for m in self.masters]
        self._group = [torch.zeros(m.shape, dtype=torch.uint8, device=device)
                       for m in self.masters]
        group_of = {id(p): i for i, group in enumerate(self.optimizer.param_groups)
                    for p in group["params"]}
        for piece, unit, span in self._spans:
            self._group[unit][span] = group_of[id(piece)]
        self._point_state()

    def _point_state(self) -> None:
        state = self.optimizer.state
        for piece, unit, span in self._spans:
            state[piece] = {"step": self._step, "exp_avg": self._exp_avg[unit][span],
                            "exp_avg_sq": self._exp_avg_sq[unit][span]}

    @torch.no_grad()
    def adopt_state(self) -> None:
        """After torch's load_state_dict replaced the state with loaded tensors: copy them into
        the flat moments and point the state at those again (the step count is the loaded
        one; a piece the checkpoint had no state for starts with zero moments)."""
        if not self.flat:
            return
        state = self.optimizer.state
        steps = [state[piece]["step"] for piece, _, _ in self._spans
                 if "step" in state.get(piece, {})]
        self._step.fill_(float(steps[0]) if steps else 0.0)
        for piece, unit, span in self._spans:
            loaded = state.get(piece, {})
            for key, flat in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                if key in loaded and loaded[key] is not None:
                    flat[unit][span].copy_(loaded[key].reshape(-1))
                else:
                    flat[unit][span].zero_()
        self._point_state()

    def _step_flat(self, coef: torch.Tensor | None, nonfinite: torch.Tensor) -> None:
        """Step 4 by adamw_flat: one pass per flat master (a Triton kernel on CUDA), clipping by
        `coef` as the gradients are read, nothing changed where `nonfinite`."""
        groups = self.optimizer.param_groups
        device = self.masters[0].device
        hyper = torch.tensor([[g["lr"] for g in groups], [g["weight_decay"] for g in groups]],
                             dtype=torch.float32, device="cpu")  # whatever the default device
        if device.type == "cuda":  # from pinned memory: the copy never waits for the stream
            hyper = hyper.pin_memory().to(device, non_blocking=True)
        beta1, beta2 = groups[0]["betas"]
        eps = groups[0]["eps"]
        scale = torch.ones((), device=device) if coef is None else coef.reshape(())
        skip = nonfinite.reshape(()).float()
        self._step += 1 - skip
        step = torch.clamp(self._step, min=1.0)
        for unit, (master, grad, shard) in enumerate(zip(self.masters, self.grad_shards,
                                                         self.param_shards)):
            adamw_flat(master, grad, self._exp_avg[unit], self._exp_avg_sq[unit],
                       self._group[unit], hyper[0], hyper[1], beta1, beta2, eps, step, scale,
                       skip, None if shard is master else shard)

    def step(self, found_nonfinite: torch.Tensor) -> StepResult:
        """Steps 1-4 of the module docstring; `found_nonfinite`: this rank's flag from the
        reduction (qgZ checks before quantizing)."""
        self._sum_sequence_parallel()
        device = self.masters[0].device
        found = found_nonfinite.float().reshape(1)
        scale = None
        if self.loss_scaler is not None:
            scale = self.loss_scaler.scale
            inv_scale = torch.full((1,), 1.0 / scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(self.grad_shards, found, inv_scale)
        square, found_total = self._reduce_stats(found)
        nonfinite = (found_total > 0) | ~torch.isfinite(square)
        grad_norm = square.sqrt()
        coef = (torch.clamp(self.clip_grad / (grad_norm + 1e-6), max=1.0)
                if self.clip_grad > 0 else None)
        if coef is not None and not (self._skips_on_device or self.flat):
            torch._foreach_mul_(self.grad_shards, coef)
        on_device = self.flat or self._skips_on_device
        if self.flat:  # the masters' shards are written in the same pass
            self._step_flat(coef, nonfinite)
        elif self._skips_on_device:
            # the fused kernel divides each gradient by grad_scale as it reads it: clipping
            # costs no pass of its own over the gradients
            self.optimizer.grad_scale = None if coef is None else (1.0 / coef).reshape(1)
            self.optimizer.found_inf = nonfinite.float()
            self.optimizer.step()
            self.copy_masters_to_shards()  # the same values again if the step was skipped
        if on_device and self.loss_scaler is None and self.on_nonfinite == "skip":
            # nothing on the host depends on the skip before the next step: leave it pending
            # (StepResult) so that the host does not wait here for the step to finish
            flag = nonfinite.reshape(())
            return StepResult(skipped=flag, loss_scale=None,
                              grad_norm=torch.where(flag, torch.nan, grad_norm.reshape(())))
        if on_device:
            skipped = bool(nonfinite.item())  # read once the step is enqueued
        elif not (skipped := bool(nonfinite.item())):
            self.optimizer.step()
            self.copy_masters_to_shards()
        if skipped:
            if self.loss_scaler is not None:
                self.loss_scaler.update(found_inf=True)
            elif self.on_nonfinite == "error":
                raise FloatingPointError("inf or NaN in the gradients (on at least one rank); "
                                         "on_nonfinite='skip' skips such steps instead")
            return StepResult(skipped=True, grad_norm=None, loss_scale=scale)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        return StepResult(skipped=False, grad_norm=grad_norm, loss_scale=scale)

    def _reduce_stats(self, found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(global sum of squared gradients, ranks' found flags summed), 0-dim tensors on the
        device: step 3."""
        square = torch.zeros(1, device=found.device)
        if self._counted:
            square += torch.nn.utils.get_total_norm(self._counted, norm_type=2.0).float() ** 2
        if not self.whole:
            stats = torch.cat([square, found])
            self.comm.all_reduce(stats, self.dims.replica_group, "scalars")
            return stats[0], stats[1]
        stats = square if self.loss_scaler is None else torch.cat([square, found])
        if self.dims.tp > 1:
            self.comm.all_reduce(stats, self.dims.tp_group, "scalars")
        if self.dims.pp > 1:  # each stage's sum counted once (ParallelDims.pp_replicas)
            stats /= self.dims.pp_replicas
            self.comm.all_reduce(stats, self.dims.pp_group, "scalars")
        return stats[0], stats[1:].sum()

    @torch.no_grad()
    def copy_masters_to_shards(self) -> None:
        for shard, master in zip(self.param_shards, self.masters):
            if shard is not master:
                shard.copy_(master)

    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        """`lr` for every group, `decoupled_lr` (when given) for the decoupled ones."""
        for group in self.optimizer.param_groups:
            group["lr"] = decoupled_lr if decoupled_lr is not None and group.get(
                "decoupled") else lr

    def _sum_sequence_parallel(self) -> None:
        if not self._sequence_parallel:
            return
        flat = torch.cat(self._sequence_parallel)
        self.comm.all_reduce(flat, self.dims.tp_group, "sequence parallel")
        offset = 0
        for grad in self._sequence_parallel:
            grad.copy_(flat[offset:offset + grad.numel()])
            offset += grad.numel()

    def state_dict(self) -> dict:
        """This rank's optimizer state, fp32 master shards and loss scaler (references, but for
        the step counts: each parameter gets its own copy of the shared one, as torch's
        optimizers keep them, so that torch's AdamW loading it does not count a step once per
        parameter)."""
        optimizer = self.optimizer.state_dict()
        if self.flat:
            optimizer["state"] = {index: {**entry, "step": entry["step"].clone()}
                                  for index, entry in optimizer["state"].items()}
        return {"optimizer": optimizer, "masters": self.masters,
                "loss_scaler": None if self.loss_scaler is None
                else self.loss_scaler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """The inverse of state_dict() on the same layout; the parameter shards are updated."""
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"checkpoint has {len(state['masters'])} master shards, this "
                             f"engine {len(self.masters)}")
        for master, saved in zip(self.masters, state["masters"]):
            if saved.shape != master.shape:
                raise ValueError(f"master shard of {tuple(saved.shape)} elements, expected "
                                 f"{tuple(master.shape)}: the checkpoint was sharded otherwise")
            master.copy_(saved)
        # how the kernels run is this engine's choice, not the checkpoint's (older checkpoints
        # saved foreach on CPU; the skip decision needs the fused kernels)
        kernels = [{key: group[key] for key in ("fused", "foreach") if key in group}
                   for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, keep in zip(self.optimizer.param_groups, kernels):
            group.update(keep)
        self.adopt_state()
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.copy_masters_to_shards()
