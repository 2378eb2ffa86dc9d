"""ZeroPlusPlus: the data-parallel engine. ZeRO stage 0 (plain data parallelism), 1 or 3, with
ZeRO++'s qwZ, hpZ and qgZ at the sharded stages.

    engine = ZeroPlusPlus(model, dims, optimizer_factory, ZeroConfig(stage=3, ...),
                          clip_grad=1.0, loss_scaler=None)
    engine = build_engine(model, dims, config)   # as a megadomino.config.Config describes it

The engine works over `dims.dp_group`; tensor parallelism is orthogonal (each TP rank shards its
own TP shards alike). With DiLoCo (--diloco-inner-steps) `build_engine` builds it on a site's view
of the grid (its DP group the site's) and gives it the outer optimizer (`outer`, zero/diloco.py),
which every H-th `step` runs across the sites. It takes over the model's parameters (each unit's
become views of one flat buffer): at stage 3 they are empty outside a forward or backward, so read
weights through `full_state_dict()`.

Stage 0 is Megatron's DDP: every rank holds the whole model, fp32 masters and optimizer state;
gradients accumulate in fp32 buckets (`partition.find_buckets`, --ddp-bucket-size) that are
all-reduced (mean) as backward completes them. Stages 1 and 3 shard by units of layers. The
three stages share the gradient path (`grads.GradReducer`), the optimizer, its grad norm,
clipping and fp16 loss scaling (`sharded.ShardedOptimizer`).

How a training loop uses it:

    engine.set_lr(lr)
    for micro in range(num_micro):                  # gradients start zeroed
        with engine.no_sync() if micro < num_micro - 1 else contextlib.nullcontext():
            loss = engine(tokens, labels=labels, loss_mask=mask).sum() / mask.sum()
            engine.backward(loss / num_micro)       # not loss.backward(): fp16 scaling, reduction
    result = engine.step()                          # loss_scaler.StepResult; zeroes grads
    engine.loss_scaler                              # for logging (None unless fp16)
    evaluation: engine(...) (or the model itself) under torch.no_grad(): gathers as it goes
    checkpoint: engine.state_dict() / engine.load_state_dict() on every rank (sharded: each
    (TP, DP) rank saves its own), engine.full_state_dict() for the unsharded weights (the same
    on all ranks); the model's own state dicts see empty parameters at stage 3
    memory: engine.memory_stats() (bytes held; CUDA peak), beside the loop's peak-memory log

`no_sync()` defers the reduction to the last micro-batch at stages 0 and 1; stage 3 reduces every
backward (it has no whole-gradient buffer to accumulate in), so there it changes nothing.
Non-trainable parameters are left alone (whole on every rank, not optimized).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from megadomino.config import Config, ConfigError, OptimizerConfig, ZeroConfig
from megadomino.config.batches import BatchSchedule
from megadomino.distributed import comm as dist_comm
from megadomino.zero.collectives import CommCounter
from megadomino.zero.diloco import DiLoCo
from megadomino.zero.fp8_gather import adopt_fp8_weights
from megadomino.zero.grads import GradReducer
from megadomino.zero.loss_scaler import DynamicLossScaler, StepResult
from megadomino.zero.params import FullParams, MemoryMeter, PartitionedParams
from megadomino.zero.partition import FlatUnit, find_buckets, find_units, idle_dp_rank
from megadomino.zero.sharded import OptimizerFactory, ShardedOptimizer


class ZeroPlusPlus:
    """The engine. `__call__` (stage 3), `backward`, `step`, `load_state_dict` and
    `full_state_dict` are collective (over the DP group; `step` over the ranks of one model
    replica, with DiLoCo's outer step over the world, `full_state_dict` over TP too): every rank
    calls them in the same order."""

    def __init__(self, model: nn.Module, dims, optimizer_factory: OptimizerFactory,
                 config: ZeroConfig, *, clip_grad: float = 0.0,
                 loss_scaler: DynamicLossScaler | None = None,
                 decoupled: tuple[nn.Parameter, ...] = (), one_backward_per_step: bool = False):
        """`decoupled`: parameters the optimizer keeps in their own groups, whose LR
        `set_lr(lr, decoupled_lr)` sets apart (Megatron's --decoupled-lr: the word embedding
        and the output layer). `one_backward_per_step` (stages 0 and 1): every step runs exactly
        one backward, so gradients are written over the last step's instead of zeroed and
        added to (grads.py); a second backward in a step is refused."""
        config.check_dims(dims)
        runner = getattr(getattr(model, "decoder", None), "runner", None)
        if config.overlap_param_gather and getattr(runner, "bypasses_layer_hooks", False):
            raise ConfigError("--overlap-param-gather waits for each layer's gather in the "
                              "layer's forward hook, which the Domino schedule bypasses: drop "
                              "one of them")
        if config.stage == 3 and getattr(runner, "bypasses_layer_hooks", False):
            raise ConfigError("--zero-stage 3 gathers each layer in the layer's forward hook, "
                              "which the Domino schedule bypasses: use --zero-stage 1 with Domino")
        self.model, self.dims, self.config = model, dims, config
        self.loss_scaler = loss_scaler
        self.outer: DiLoCo | None = None
        """DiLoCo's outer optimizer across sites (`build_engine` sets it), run by `step` after
        every H-th inner step; None: none."""
        self.comm = CommCounter(dims.gpus_per_node)
        self.meter = MemoryMeter()
        # --fp8-param-gather: the FP8 linears' weights (their scaling switched to current); a
        # model or stage with none (--fp8-linears, --first-last-layers-bf16) gathers as usual
        fp8 = adopt_fp8_weights(model) if config.fp8_param_gather else None
        if config.stage == 0:
            self.units = [FlatUnit(name, params, 1, 0)
                          for name, params in find_buckets(model, config.bucket_numel)]
            self.params: FullParams | PartitionedParams = FullParams(self.units, dims, self.comm,
                                                                     gathered=False)
            on_unit_done = None
        elif config.stage == 1:
            found = find_units(model, config.layers_per_unit, config.unit_params,
                               config.min_units)
            self.units = [FlatUnit(name, params, dims.dp, dims.dp_rank)
                          for name, _, params in found]
            _check_every_dp_rank_holds(self.units, dims, config.stage)
            modules = [m for _, m, _ in found] if config.overlap_param_gather else None
            self.params = FullParams(self.units, dims, self.comm, modules=modules,
                                     fp8_weights=fp8)
            on_unit_done = None
        else:
            found = find_units(model, config.layers_per_unit, config.unit_params,
                               config.min_units)
            self.units = [FlatUnit(name, params, dims.dp, dims.dp_rank)
                          for name, _, params in found]
            _check_every_dp_rank_holds(self.units, dims, config.stage)
            self.params = PartitionedParams(self.units, [m for _, m, _ in found], model, dims,
                                            config, self.comm, self.meter, fp8_weights=fp8)
            on_unit_done = self.params.release
        self.grads = GradReducer(self.units, dims, config, self.comm, self.meter, on_unit_done,
                                 overwrite=one_backward_per_step)
        self.optimizer = ShardedOptimizer(self.units, self.params.shards, self.grads.grad_shards,
                                          dims, self.comm, optimizer_factory, clip_grad,
                                          loss_scaler, config.on_nonfinite,
                                          whole=config.stage == 0,
                                          decoupled=frozenset(id(p) for p in decoupled))

    def __call__(self, *args, **kwargs):
        """The model's forward (stage 3: with the gathers its hooks issue)."""
        return self.model(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.grads.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (times the loss scale in fp16) and the DP reduction of gradients,
        finished before returning."""
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        loss.backward()
        self.grads.finish()
        self.params.release_all()

    def reduce_gradients(self) -> None:
        """Reduce what backward passes run under `no_sync()` accumulated (stages 0 and 1), as a
        synced last backward would: for a caller that runs the backward passes itself (the
        pipeline's executor: autograd.backward on stage outputs)."""
        self.grads.finish()
        self.params.release_all()

    def accumulated_grad(self, param: nn.Parameter) -> torch.Tensor:
        """Stages 0 and 1, between `no_sync()` backwards and `reduce_gradients()`: the view of
        `param`'s accumulated, not yet reduced gradient in its unit's buffer (the pipeline sums
        the tied embedding's over the first and last stage there)."""
        return self.grads.accumulated(param)

    def step(self) -> StepResult:
        """Clip, step the sharded optimizer, with DiLoCo count the inner step (and run the outer
        step at the H-th), and make the model see the new weights (stage 1: all-gather; stage 3:
        next gathers, hpZ copies dropped); then zero the gradients. A step with inf/NaN
        gradients is skipped (see ZeroConfig.on_nonfinite)."""
        self.params.release_all()
        result = self.optimizer.step(self.grads.found_nonfinite)
        outer = self.outer is not None and self.outer.after_inner_step()
        if outer or not result.settled or not result.skipped:  # pending: unchanged if skipped
            self.params.refresh()
        self.grads.zero_grad()
        return result

    def zero_grad(self) -> None:
        self.grads.zero_grad()

    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        """The LR of the next step: `decoupled_lr` for the decoupled parameters when given."""
        self.optimizer.set_lr(lr, decoupled_lr)

    # ---- state ----------------------------------------------------------------------------------

    def _layout(self) -> dict:
        dims = self.dims
        return {"stage": self.config.stage, "dp": dims.dp, "dp_rank": dims.dp_rank, "tp": dims.tp,
                "tp_rank": dims.tp_rank, "units": [(u.name, u.padded_numel) for u in self.units]}

    def state_dict(self) -> dict:
        """This rank's shard: optimizer state, fp32 masters (the weights), loss scaler, layout.
        Tensors are references: serialize before the next step."""
        return {"layout": self._layout(), "kind": self.optimizer_kind,
                **self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard (saved by the same DP rank of the same layout), then refresh the
        parameters: stage 1 all-gathers, stage 3 drops gathered and hpZ secondary copies."""
        saved, mine = state["layout"], self._layout()
        if saved != mine:
            raise ValueError(layout_mismatch(saved, mine))
        self.params.release_all()
        self.optimizer.load_state_dict(state)
        self.params.refresh()

    @property
    def optimizer_kind(self) -> str:
        """The torch optimizer's class name ('AdamW', 'SGD'): a checkpoint's state loads only
        into the same kind."""
        return type(self.optimizer.optimizer).__name__

    @property
    def sharded(self) -> bool:
        """Whether this rank's optimizer state is a DP chunk (stages 1 and 3) rather than the
        whole (stage 0)."""
        return self.config.stage != 0

    def state_by_parameter(self) -> dict[int, dict[str, torch.Tensor]]:
        """Stage 0: per parameter (keyed by id), its AdamW state and, for a parameter that is not
        fp32, its fp32 master, each in the parameter's shape (references; the step count a
        copy, since the flat AdamW pass shares one among its parameters). The layout-free
        form a checkpoint keeps by parameter name, loadable at another TP degree."""
        if self.sharded:
            raise RuntimeError("state_by_parameter() is stage 0's: a sharded engine's state "
                               "is state_dict()")
        state = self.optimizer.optimizer.state
        entries = {}
        for param, master in self.optimizer.pieces:
            entry = {key: value.clone() if key == "step" else value.view(param.shape)
                     for key, value in state.get(master, {}).items()}
            if param.dtype != torch.float32:
                entry["master"] = master.view(param.shape)
            entries[id(param)] = entry
        return entries

    @torch.no_grad()
    def load_state_by_parameter(self, entries: dict[int, dict[str, torch.Tensor]],
                                loss_scaler: dict | None) -> None:
        """The inverse of state_by_parameter(): masters copied in (then into the parameters),
        AdamW state through torch's own load_state_dict (it puts `step` where the fused and
        foreach kernels want it); parameters without an entry keep fresh state."""
        if self.sharded:
            raise RuntimeError("load_state_by_parameter() is stage 0's")
        adamw = self.optimizer.optimizer
        index = {id(m): i for i, m in enumerate(
            m for group in adamw.param_groups for m in group["params"])}
        torch_state = adamw.state_dict()
        torch_state["state"] = {}
        for param, master in self.optimizer.pieces:
            entry = entries.get(id(param), {})
            if "master" in entry:
                master.copy_(entry["master"].reshape(-1))
            moments = {key: value if key == "step" else value.reshape(master.shape)
                       for key, value in entry.items() if key != "master"}
            if moments:
                torch_state["state"][index[id(master)]] = moments
        adamw.load_state_dict(torch_state)
        self.optimizer.adopt_state()
        if self.loss_scaler is not None and loss_scaler is not None:
            self.loss_scaler.load_state_dict(loss_scaler)
        self.optimizer.copy_masters_to_shards()
        self.params.refresh()  # stage 0: the parameters' version counters bumped

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights on CPU, the same on every rank: the model's `full_state_dict()`
        (unsharded over TP too) where it has one, else its named parameters gathered over DP."""
        self.params.materialize()
        try:
            if hasattr(self.model, "full_state_dict"):
                return self.model.full_state_dict()
            return {name: param.detach().cpu().clone()
                    for name, param in self.model.named_parameters()}
        finally:
            self.params.release_all()

    def memory_stats(self) -> dict[str, int | None]:
        """Bytes this rank holds: persistent (parameters: whole at stage 1, this rank's shards at
        stage 3; fp32 masters where the parameters are not fp32; optimizer state; gradient
        shards), the peak of the transient buffers the engine tracks (gathered units, hpZ copies,
        gradient buffers; stage 1's whole fp32 gradient buffers count here from the start) and,
        on CUDA, the device's peak allocation."""
        def size(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)
        masters = [m for m, s in zip(self.optimizer.masters, self.params.shards) if m is not s]
        states = [v for state in self.optimizer.optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor)]
        device = self.optimizer.masters[0].device
        return {"params": self.params.nbytes, "masters": size(masters),
                "optimizer_state": size(states), "grad_shards": size(self.grads.grad_shards),
                "transient_peak": self.meter.peak,
                "device_peak": torch.cuda.max_memory_allocated(device)
                if device.type == "cuda" else None}


def _check_every_dp_rank_holds(units: list[FlatUnit], dims, stage: int) -> None:
    """ConfigError on every rank when a DP rank's chunk of every unit would be padding alone (a
    model too small for the DP degree), before anything is sharded. The layouts are the same on
    every DP and TP rank of a pipeline stage, so those ranks agree without a word; pipeline
    stages' layouts differ, so with stages the ranks share their verdicts (all_gather_object)."""
    numels = [unit.numel for unit in units]
    idle = idle_dp_rank(numels, dims.dp) if numels else None  # none: nothing to train
    error = None
    if idle is not None:
        ranks = f"rank {idle}" if idle == dims.dp - 1 else f"ranks {idle} to {dims.dp - 1}"
        fits = max(d for d in range(1, dims.dp + 1) if idle_dp_rank(numels, d) is None)
        error = (f"--zero-stage {stage} shards every unit of parameters over the {dims.dp} "
                 f"data-parallel ranks, but this model is too small: {ranks} would hold nothing "
                 f"but padding (its largest unit has {max(numels)} elements): run it on fewer "
                 f"data-parallel ranks (e.g. {fits}), or at --zero-stage 0")
    if dims.pp > 1:
        error = next((e for e in dist_comm.all_gather_object(error) if e is not None), None)
    if error is not None:
        raise ConfigError(error)


def layout_mismatch(saved: dict, mine: dict) -> str:
    """Why a sharded checkpoint does not fit this engine, naming what to pass."""
    if {k: v for k, v in saved.items() if k != "units"} != \
            {k: v for k, v in mine.items() if k != "units"}:
        return (f"checkpoint layout {saved} does not match this engine's {mine}: sharded state "
                "loads only at the same stage, degrees, rank and units (use full_state_dict to "
                "change them)")

    def names(units: list) -> str:
        return ", ".join(str(unit[0]) for unit in units[:3]) + (", ..." if len(units) > 3 else "")
    return (f"the checkpoint's ZeRO units are not this engine's: saved {len(saved['units'])} "
            f"({names(saved['units'])}), here {len(mine['units'])} ({names(mine['units'])}). "
            "Sharded state loads only into the same units: pass the --zero-layers-per-unit (or "
            "--zero-unit-params) it was saved with (checkpoints from before units of "
            "--zero-unit-params became the default were saved one layer a unit: "
            "--zero-layers-per-unit 1)")


def optimizer_factory(config: OptimizerConfig, lr: float) -> OptimizerFactory:
    """The run's optimizer (--optimizer) with its hyper-parameters: torch's AdamW (its fused
    kernel, which takes the skip decision on the device: zero/sharded.py) or torch's SGD with
    momentum (foreach). The engine's groups set weight decay 0 for 1-D parameters; the schedule
    sets `lr` each step."""
    if config.optimizer == "sgd":
        return functools.partial(torch.optim.SGD, lr=lr, momentum=config.sgd_momentum,
                                 weight_decay=config.weight_decay, foreach=True)
    return functools.partial(torch.optim.AdamW, lr=lr, weight_decay=config.weight_decay,
                             betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                             fused=True)


def build_engine(model: nn.Module, dims, config: Config) -> ZeroPlusPlus:
    """The engine a run's config describes: its ZeRO stage and options, the optimizer
    --optimizer names, clipping to --clip-grad, a dynamic loss scaler exactly when --fp16, with
    --decoupled-lr the model's embedding and output weights in their own groups, and with
    --diloco-inner-steps the engine inside this rank's site (`dims.site_view()`) and DiLoCo's
    outer optimizer across the sites."""
    train = config.train
    precision, scaler = train.precision, None
    if precision.fp16:
        scaler = DynamicLossScaler(precision.initial_loss_scale, precision.min_loss_scale,
                                   precision.loss_scale_window, precision.hysteresis)
    factory = optimizer_factory(train.optimizer, train.schedule.lr)
    decoupled = ()
    if train.schedule.decoupled_lr is not None:
        decoupled = tuple(model.embedding_and_output_weights())
    one_backward = (config.parallel.pipeline_model_parallel_size == 1
                    and BatchSchedule.from_config(train.schedule, dims.dp).one_micro_batch)
    engine = ZeroPlusPlus(model, dims.site_view(), factory, config.parallel.zero,
                          clip_grad=train.optimizer.clip_grad, loss_scaler=scaler,
                          decoupled=decoupled, one_backward_per_step=one_backward)
    if config.parallel.diloco.enabled:
        engine.outer = DiLoCo(engine, dims, config.parallel.diloco)
    return engine
