"""Gradients: per-unit fp32 flat buffers, all-reduced in place (stage 0) or reduce-scattered
(plain or qgZ) into fp32 shards (stages 1 and 3).

A post-accumulate-grad hook adds each parameter's `.grad` (any dtype) into its view of its unit's
fp32 flat buffer (views made once per buffer) and frees `.grad`. At stages 0 and 1 the view is also
the parameter's main gradient (`main_grad_ref`, a weak reference): a linear whose weight is marked
`fused_wgrad` accumulates its weight gradient there inside the GEMM (tp/layers.py `weight_grad`,
Megatron's gradient-accumulation fusion) and hands autograd a placeholder, which the hook only
frees. The hook is one tensor op and a few statements: with hundreds of small parameters its host
time is what a small-micro-batch step waits on (benchmarks/zero_host_overhead.py). Holding a unit's
gradients for one `torch._foreach_add_` measured no faster (bf16 into fp32 takes foreach's
per-tensor path) and kept them alive longer.
A run with one backward a step (one micro-batch per global batch, no pipeline, no batch ramp-up:
`overwrite`) never zeroes the buffers: each gradient is written over its view (the hooks copy,
the fused GEMMs run with beta 0, which also spares them reading the buffer), a parameter that got
no gradient in a backward has its view zeroed before its unit's reduction, and a second backward
in one step is refused. Otherwise `zero_grad()` zeroes only what a backward wrote since the last
zeroing (a step's end and the next step's start zero once).
Stages 0 and 1 keep one flat buffer per unit for the whole step,
accumulating micro-batches in fp32 (`no_sync()` defers the reduction to the last micro-batch;
a synced backward reduces what accumulated since the last reduction). At stage 0 a unit is a bucket
(`partition.find_buckets`) and its buffer is also its gradient "shard": the all-reduce divides
it by dp and sums it in place, and the optimizer reads it (a second synced backward in one step
adds local gradients to the mean and reduces again, which adds their mean: the DP ranks' buffers
are equal after each reduction).
Stage 3 has no whole-gradient storage: a unit's buffer exists from its first gradient until its
reduction, so every backward reduces, inside `no_sync()` or not. Either way the shards add up
every reduction of the step.

Once a unit's gradients are all in (or at `finish()`, for units with parameters that got none),
its buffer is reduced over the DP group (stage 0: divided by dp, then all-reduce; plain: divided
by dp, then reduce-scatter; qgZ: see
`collectives.reduce_scatter_quantized`) and the result, this rank's chunk of the DP average, is
added into `grad_shards[i]`, fp32 [shard_numel], zeroed by `zero_grad()`. qgZ sets
`found_nonfinite` when a gradient it quantizes holds inf/NaN; the step all-reduces the flag with
the grad norm (which catches inf/NaN on the plain path) and skips or raises on every rank alike.

Ordering assumptions:
  * Reductions are launched in backward unit order (the last layer first, the root last),
    whatever order autograd fires the hooks in: a unit that completes early waits for the units
    before it. At most two reductions are in flight (`ZeroConfig.reduce_pipeline_depth`, 2 by
    default; 1 finishes unit i-1 instead): launching unit i finishes unit i-2 and
    advances unit i-1 (qgZ: its intra-node sums are requantized and its inter-node all-to-all
    launched), so that no wait on the compute stream follows a collective launch directly (one
    unit's backward runs between them). Memory: up to three units' fp32 gradient buffers at
    stage 3 (the two in flight and the one filling). Stage 0 reduces in place and adds nothing
    afterwards, so its all-reduces all stay in flight until `finish()` (no wait on the compute
    stream during backward). Every DP rank issues the same collectives in the same order.
  * A parameter reports at most once per backward (one AccumulateGrad per leaf per graph).
  * CUDA: the hooks run on the stream of the parameter's AccumulateGrad node (usually the one
    compute stream; under --enable-cuda-graph the graphed layers' nodes are on the capture's side
    stream), a unit's reduction is enqueued on the current stream after it waited for every
    other stream the unit's hooks ran on (`distributed.streams`), and waits make the current stream
    wait: the optimizer must run on the stream that called `finish()`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from megadomino.config import REDUCE_DTYPES, ZeroConfig
from megadomino.distributed.streams import HookStreams, weak_grad_hook
from megadomino.zero import collectives
from megadomino.zero.collectives import CommCounter, Pending
from megadomino.zero.params import MemoryMeter
from megadomino.zero.partition import FlatUnit


class _BufferState:
    """What the main-gradient references share with their reducer: whether a gradient written
    to a buffer replaces it (`overwrite`), and whether anything was written since the last
    zeroing (`dirty`)."""

    __slots__ = ("overwrite", "dirty")

    def __init__(self, overwrite: bool):
        self.overwrite, self.dirty = overwrite, True  # dirty: nothing is known of the start


class MainGradRef:
    """`param.main_grad_ref`: called, the parameter's view of its unit's fp32 buffer (None once
    the reducer is gone: weak, the buffers go with it). A writer (tp/layers.py `weight_grad`)
    writes over the view when `overwrite`, else adds to it, and calls `written()`."""

    __slots__ = ("_view", "_state")

    def __init__(self, view: torch.Tensor, state: _BufferState):
        self._view, self._state = weakref.ref(view), state

    def __call__(self) -> torch.Tensor | None:
        return self._view()

    @property
    def overwrite(self) -> bool:
        return self._state.overwrite

    def written(self) -> None:
        self._state.dirty = True


class GradReducer:
    """The gradient path of both stages; `on_unit_done(i)` is called once unit i's gradients of
    this backward are all in its buffer (stage 3 frees its gathered parameters there).
    `overwrite` (stages 0 and 1): the run has one backward a step (module docstring)."""

    def __init__(self, units: list[FlatUnit], dims, config: ZeroConfig, comm: CommCounter,
                 meter: MemoryMeter, on_unit_done: Callable[[int], None] | None = None,
                 overwrite: bool = False):
        self.units, self.dims, self.config, self.comm, self.meter = units, dims, config, comm, \
            meter
        self.on_unit_done = on_unit_done
        self.device = units[0].params[0].device
        self.found_nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        self.persistent = config.stage in (0, 1)
        self.in_place = config.stage == 0
        self.overwrite = overwrite and self.persistent
        self._state = _BufferState(self.overwrite)
        self._got = [bytearray(len(unit.params)) for unit in units]  # overwrite: who reported
        self._backwards = 0  # finished since the last zero_grad
        self.depth = len(units) + 1 if self.in_place else config.reduce_pipeline_depth
        self.buffers: list[torch.Tensor | None] = [None] * len(units)
        self._views: list[list[torch.Tensor] | None] = [None] * len(units)  # into buffers[i]
        if self.persistent:
            for index in range(len(units)):
                self._allocate(index)
                for param, view in zip(units[index].params, self._views[index]):
                    # tp/layers.py weight_grad accumulates (or writes) here
                    param.main_grad_ref = MainGradRef(view, self._state)
        self.grad_shards = list(self.buffers) if self.in_place else [
            torch.zeros(u.shard_numel, device=self.device) for u in units]
        self.order = list(range(len(units)))[::-1]
        self._position_in_order = [self.order.index(index) for index in range(len(units))]
        for index, unit in enumerate(units):
            for position, param in enumerate(unit.params):
                param.register_post_accumulate_grad_hook(
                    weak_grad_hook(self._on_grad, index, position))
        self._reported = [0] * len(units)
        self._next = 0
        self._inflight: list[tuple[int, Pending]] = []  # oldest first, at most the depth
        self._sync = True
        self._streams = HookStreams()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stages 0 and 1: backward inside only accumulates (reduce on the last micro-batch).
        Stage 3: no effect (see the module docstring)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def syncing(self) -> bool:
        return self._sync or not self.persistent

    def zero_grad(self) -> None:
        """Zero the shards (and stage 1's buffers) and the non-finite flag; start of a step.
        Nothing to do when nothing was written since the last call; with `overwrite` the
        buffers are not zeroed (stage 0's shards are its buffers)."""
        if self._inflight or self._next:
            raise RuntimeError("zero_grad() during a backward's reduction: call "
                               "engine.backward() to the end first")
        self._backwards = 0
        if not self._state.dirty:
            return
        if not (self.overwrite and self.in_place):
            for shard in self.grad_shards:
                shard.zero_()
        if self.persistent and not self.in_place and not self.overwrite:
            for buffer in self.buffers:
                buffer.zero_()
        self.found_nonfinite.zero_()
        self._state.dirty = False

    def finish(self) -> None:
        """After backward: reduce every unit not reduced yet (in order) and wait for all."""
        if self.syncing:
            self._launch_ready(force=True)
            self._finish_inflight()
        elif self.overwrite:
            self._zero_unreported()
        self._next = 0
        self._reported = [0] * len(self.units)
        if self.overwrite:
            for got in self._got:
                got[:] = bytes(len(got))
        self._backwards += 1

    def accumulated(self, param: nn.Parameter) -> torch.Tensor:
        """Stages 0 and 1: `param`'s view of its unit's persistent buffer."""
        if not self.persistent:
            raise RuntimeError("ZeRO stage 3 keeps no accumulated gradient buffer")
        for index, unit in enumerate(self.units):
            for position, member in enumerate(unit.params):
                if member is param:
                    return self._views[index][position]
        raise KeyError("the parameter is not one of the engine's")

    def _on_grad(self, index: int, position: int, param: nn.Parameter) -> None:
        """The hook of parameter `position` of unit `index`. A `.grad` of None reports nothing:
        autograd runs the hook for a parameter it got no gradient for, as a split backward's B
        gives a deferred weight (tp/wgrad.py), whose W then reports it."""
        if param.grad is None:
            return
        syncing = self.syncing
        if syncing and self._position_in_order[index] < self._next:
            raise RuntimeError(
                f"a gradient for {self.units[index].name} arrived after its reduction was "
                "launched: a parameter must receive its gradient once per backward")
        if self.overwrite and self._backwards:
            raise RuntimeError(
                "a second backward in one step: this engine was built for one backward a step "
                "(one micro-batch per global batch), so it writes gradients over the last ones "
                "instead of adding them; build it with one_backward_per_step=False")
        if self.buffers[index] is None:
            self._allocate(index)
        self._state.dirty = True
        if self.overwrite:
            self._got[index][position] = 1
        if not (self.persistent and getattr(param, "fused_wgrad", False)):
            view = self._views[index][position]  # else: in main_grad already
            if self.overwrite:
                view.copy_(param.grad)
            else:
                view.add_(param.grad)
        param.grad = None
        self._streams.note(index, self.buffers[index])
        self._reported[index] += 1
        if self._reported[index] != len(self._views[index]):
            return  # only a unit's completion can make a launch ready
        if self.on_unit_done is not None:
            self.on_unit_done(index)
        if syncing:
            self._launch_ready(force=False)

    def _allocate(self, index: int) -> None:
        unit = self.units[index]
        self.buffers[index] = torch.zeros(unit.padded_numel, device=self.device)
        self._views[index] = unit.views(self.buffers[index])
        self.meter.hold(self.buffers[index])

    def _launch_ready(self, force: bool) -> None:
        """Launch units in backward order while the next one is complete (any, if `force`)."""
        while self._next < len(self.order):
            index = self.order[self._next]
            if not force and self._reported[index] < len(self.units[index].params):
                return
            # Two-deep pipeline: the unit before the previous one finishes, the previous one
            # advances (qgZ: its inter-node all-to-all goes in flight), then this one launches.
            # (Depth 1: the previous one finishes.)
            self._finish_inflight(keep=self.depth - 1)
            for _, pending in self._inflight:
                pending.advance()
            self._inflight.append((index, self._launch(index)))
            self._next += 1

    def _zero_unreported(self, index: int | None = None) -> None:
        """With `overwrite`: zero the views of unit `index`'s (default: every unit's) parameters
        that got no gradient in this backward (they still hold the last step's)."""
        for i in range(len(self.units)) if index is None else (index,):
            if self._reported[i] < len(self.units[i].params) and self._views[i] is not None:
                for position, got in enumerate(self._got[i]):
                    if not got:
                        self._views[i][position].zero_()

    def _launch(self, index: int) -> Pending:
        config = self.config
        if self.buffers[index] is None:
            self._allocate(index)
        if self.overwrite:
            self._zero_unreported(index)
        flat = self.buffers[index]
        self._streams.join(index)
        if self.dims.dp == 1:
            return Pending(lambda: flat)
        if self.in_place:
            return collectives.all_reduce_mean(self.comm, flat, self.dims.dp_group)
        if config.quantized_gradients:
            return collectives.reduce_scatter_quantized(
                self.comm, flat, self.dims, config.gradient_bits, config.block_size,
                self.found_nonfinite, config.quantize_full_range)
        flat.div_(self.dims.dp)
        return collectives.reduce_scatter(self.comm, flat, self.dims.dp_group,
                                          REDUCE_DTYPES[config.reduce_dtype])

    def _finish_inflight(self, keep: int = 0) -> None:
        """Finish in-flight reductions, oldest first, until `keep` are left."""
        while len(self._inflight) > keep:
            self._finish_one(*self._inflight.pop(0))

    def _finish_one(self, index: int, pending: Pending) -> None:
        if self.in_place:
            pending.wait()  # the buffer is the result
            return
        self.grad_shards[index].add_(pending.wait())
        if self.persistent:
            if not self.overwrite:  # reduced: a further synced backward starts afresh
                self.buffers[index].zero_()
        else:
            self.meter.drop(self.buffers[index])
            self.buffers[index] = self._views[index] = None
