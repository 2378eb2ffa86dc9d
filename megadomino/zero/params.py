"""Where the parameters live: whole on every rank (stages 0 and 1) or partitioned and gathered per
unit just before use (stage 3, with qwZ and hpZ).

Both holders keep, per unit, this rank's chunk of the flat parameters in the model's dtype
(`shards[i]`, [shard_numel]), which the optimizer's fp32 masters are copied into after a step, and
`refresh()` makes the model see the new values (stage 0: the shard is the whole unit, the
parameters themselves, nothing to do; stage 1: all-gather into the parameters; stage 3:
drop every gathered copy and hpZ secondary, so that the next gather fetches the new shards).

Stage 3 mechanics. Outside a unit's use its parameters' `.data` is an empty tensor. A forward
pre-hook on the unit's module (on each of them, for a unit of several layers) waits for (or
issues) the gather, points every parameter at its view of the gathered flat buffer and launches
the next unit's gather asynchronously (prefetch), so that it overlaps this unit's compute. A
forward hook (on its last module) frees the unit again (the root unit, holding the embeddings and
the output layer, is kept while grad is enabled: backward needs it first) and, when grad is
enabled, threads the unit's outputs through `_BeforeBackward`, whose backward gathers the unit
again (and prefetches the unit before it) before autograd reaches the unit's own backward.
The gradient reducer frees a unit once all its gradients have arrived; `release_all()` after
backward frees the rest. Autograd keeps the *parameter* (not its data) for backward, so it reads
whatever `.data` holds when backward runs: the re-gathered values.

hpZ. The first gather of a unit after a refresh goes over the whole DP group (quantized with qwZ)
and leaves each rank a secondary copy: its 1/P of the gathered flat buffer, P = the node's DP
ranks. Later gathers (backward, further micro-batches) all-gather those copies inside the node,
unquantized: forward and backward see the same (once-quantized) weights. `refresh()` (after each
step and each checkpoint load) drops the copies.

qwZ without hpZ. Every gather of a unit (forward, backward, each micro-batch) goes over the DP
group quantized. The weights do not change within a step, so this rank's quantized shard (the
send payload: q and fp32 scales, `collectives.quantize_shard`) is made at the unit's first gather
after a refresh and sent again by the later ones, not quantized again; `refresh()` drops it.
Memory: per unit, about shard_numel * weight_bits / 8 bytes plus 4 per block of `block_size`
(and under 32 bytes of padding), from the first forward until the step: for bf16 weights, half
the shards' bytes at int8, a quarter at int4; counted in the MemoryMeter.

FP8 parameter gather (`fp8`, zero/fp8_gather.py): stage 1's gathers after a step and stage 3's
gathers move the FP8 linears' weights as e4m3 codes, which the linears use as gathered; the flat
buffer's FP8-weight elements are then not written (stage 1 keeps its own exact shard there, and
`materialize()` gathers the exact shards, as stage 3's does). Stage 3 makes each unit's payload
once per refresh, as qwZ does, and holds the gathered codes beside the unit's flat buffer.

Version counters. A parameter's `.data` is a view of a flat buffer, so the engine's writes (the
step into a shard, a gather into the buffer) leave the parameter's own version counter where it
was. Readers that cache what they derive from a weight key on that counter (tp/fp8.py: a linear's
FP8 codes, reused over a step's micro-batches), so the holders bump it wherever the values the
parameters show may have changed: at every refresh (after a step or a state load), and at stage
3 around materialize()'s exact gathers (the training gathers may be quantized: qwZ).

Collectives: gathers are issued from the hooks in unit order, which is the same on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from megadomino.config import ZeroConfig
from megadomino.zero import collectives
from megadomino.zero.collectives import CommCounter, Pending
from megadomino.zero.fp8_gather import FP8Layout, Scales, all_gather_fp8
from megadomino.zero.partition import FlatUnit


class MemoryMeter:
    """Bytes of the transient buffers the engine holds (gathered units, hpZ copies, qwZ's
    cached quantized shards, gradient buffers): the current total and its peak."""

    def __init__(self):
        self.current = 0
        self.peak = 0

    def hold(self, tensor: torch.Tensor) -> None:
        self.current += tensor.numel() * tensor.element_size()
        self.peak = max(self.peak, self.current)

    def drop(self, tensor: torch.Tensor) -> None:
        self.current -= tensor.numel() * tensor.element_size()


class FullParams:
    """Stages 0 and 1: each unit's parameters are views of one flat buffer. Stage 1 all-gathers
    it after a step; at stage 0 (`gathered` False: units laid out over one rank) this rank's
    shard is the whole buffer, which the step updates in place.

    With `modules` (--overlap-param-gather: unit i's modules, find_units's) the all-gathers of a
    refresh are launched and left in flight: a forward pre-hook on each of unit i's modules
    waits for unit i's just before its first use, so the gathers of later units overlap the
    forward of earlier ones. Every other reader of the parameters waits for all of them first
    (`release_all`, which the engine calls before a step, a state load and after backward;
    `materialize`, before the weights are read whole). The values are the same bits either
    way: only when the wait happens moves."""

    def __init__(self, units: list[FlatUnit], dims, comm: CommCounter, gathered: bool = True,
                 modules: list[tuple[nn.Module, ...]] | None = None,
                 fp8_weights: dict | None = None):
        """`fp8_weights`: the weights gathered in FP8, by parameter id, and their linears'
        FP8States (--fp8-param-gather)."""
        self.units, self.dims, self.comm, self.gathered = units, dims, comm, gathered
        self.flats = []
        for unit in units:
            flat = unit.flatten([p.detach() for p in unit.params], _dtype_of(unit))
            for param, view in zip(unit.params, unit.views(flat)):
                param.data = view
            self.flats.append(flat)
        self.shards = [unit.shard(flat) for unit, flat in zip(units, self.flats)]
        self.fp8 = _fp8_layouts(units, fp8_weights, dims)
        self.scales = Scales(self.fp8, dims.dp_group, comm) if fp8_weights else None
        self.codes = [None if layout is None else torch.empty(unit.padded_numel,
                                                              dtype=torch.uint8,
                                                              device=self.flats[0].device)
                      for unit, layout in zip(units, self.fp8)]
        self.overlap = modules is not None
        self.pending: list = [None] * len(units)
        for index, unit_modules in enumerate(modules or ()):
            for module in unit_modules:
                module.register_forward_pre_hook(lambda _m, _a, i=index: self._wait(i))

    @property
    def nbytes(self) -> int:
        """Bytes of parameter storage held for good: every unit whole (and the gathered FP8
        codes of the units gathered so)."""
        return sum(flat.numel() * flat.element_size() for flat in self.flats) + sum(
            codes.numel() for codes in self.codes if codes is not None)

    def refresh(self) -> None:
        """All-gather every unit's shard into the model's parameters (stage 1); with overlap,
        left in flight for the forward hooks. Every stage: the parameters' version counters
        bumped (the step wrote their flat buffers)."""
        for unit in self.units:
            _changed(unit.params)
        if not self.gathered:
            return
        self.release_all()
        scales = None
        if self.scales is not None:
            self.scales.clear()
            scales = self.scales.get(self.shards)
        self.pending = []
        for index, (flat, shard, layout) in enumerate(zip(self.flats, self.shards, self.fp8)):
            if layout is None:
                self.pending.append(self.comm.all_gather(flat, shard.clone(), self.dims.dp_group,
                                                         "weights step", async_op=True))
                continue
            layout.unpublish()
            self.pending.append(all_gather_fp8(
                self.comm, layout, layout.encode(shard, scales[index]), scales[index],
                self.dims.dp_group, "weights step", out=flat, codes=self.codes[index]))
        if not self.overlap:
            self.release_all()

    def _wait(self, index: int) -> None:
        work, self.pending[index] = self.pending[index], None
        if work is not None:
            work.wait()

    def materialize(self) -> None:
        """The parameters whole and exact: any gather still in flight finished; the units
        gathered in FP8 gathered again from their exact shards (collective over DP)."""
        self.release_all()
        for unit, flat, shard, layout in zip(self.units, self.flats, self.shards, self.fp8):
            if layout is not None:
                self.comm.all_gather(flat, shard.clone(), self.dims.dp_group,
                                     "weights state dict")
                _changed(unit.params)

    def release_all(self) -> None:
        """Finish every gather still in flight (nothing is released at stages 0 and 1)."""
        for index in range(len(self.pending)):
            self._wait(index)


class _BeforeBackward(torch.autograd.Function):
    """Identity; its backward calls `hook` before the gradient flows on into the unit."""

    @staticmethod
    def forward(ctx, hook, x):
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hook()
        return None, grad


class PartitionedParams:
    """Stage 3: units gathered on demand by module hooks (see the module docstring)."""

    def __init__(self, units: list[FlatUnit], modules: list[tuple[nn.Module, ...]],
                 root: nn.Module, dims, config: ZeroConfig, comm: CommCounter,
                 meter: MemoryMeter, fp8_weights: dict | None = None):
        """`modules[i]`: unit i's modules in run order (find_units). Each one's forward pre-hook
        gathers the unit (a no-op while it is gathered: activation recompute may re-run a unit
        from any of its layers), the last one's forward hook releases it. `fp8_weights`: the
        weights gathered in FP8, by parameter id, and their linears' FP8States
        (--fp8-param-gather)."""
        self.units, self.dims, self.config, self.comm, self.meter = units, dims, config, comm, \
            meter
        self.shards: list[torch.Tensor] = []
        # What a released parameter's `.data` is: made once, as releases come per parameter.
        self._empties = [[_empty_like(p) for p in unit.params] for unit in units]
        for unit, empties in zip(units, self._empties):
            flat = unit.flatten([p.detach() for p in unit.params], _dtype_of(unit))
            self.shards.append(unit.shard(flat).clone())
            for param, empty in zip(unit.params, empties):
                param.data = empty
        count = len(units)
        self.full: list[torch.Tensor | None] = [None] * count
        self.pending: list[Pending | None] = [None] * count
        self.from_primary = [False] * count
        self.secondary: list[torch.Tensor | None] = [None] * count
        self.quantized: list[torch.Tensor | None] = [None] * count  # qwZ without hpZ
        self.exact = [False] * count
        """Unit i is gathered by materialize() (exact, unquantized) and not released since."""
        self.fp8_payloads: list[tuple[torch.Tensor, ...] | None] = [None] * count
        self.fp8 = _fp8_layouts(units, fp8_weights, dims)
        self.scales = Scales(self.fp8, dims.dp_group, comm) if fp8_weights else None
        self.is_root = [run[0] is root for run in modules]
        for index, run in enumerate(modules):
            for module in run:
                module.register_forward_pre_hook(lambda _m, _a, i=index: self._before_forward(i))
            run[-1].register_forward_hook(
                lambda _m, _a, output, i=index: self._after_forward(i, output))

    @property
    def nbytes(self) -> int:
        """Bytes of parameter storage held for good: this rank's shards."""
        return sum(shard.numel() * shard.element_size() for shard in self.shards)

    # ---- gather and release ----------------------------------------------------------------

    def launch(self, index: int, tag: str) -> None:
        """Start gathering unit `index` unless it is gathered or in flight (bytes counted under
        `tag`)."""
        if self.full[index] is not None or self.pending[index] is not None:
            return
        shard, dims, config = self.shards[index], self.dims, self.config
        secondary = self.secondary[index]
        self.from_primary[index] = secondary is None
        if secondary is not None:
            self.pending[index] = collectives.all_gather(self.comm, secondary,
                                                         dims.intra_node_group, tag)
        elif self.fp8[index] is not None:
            scales = self.scales.get(self.shards)[index]
            self.pending[index] = all_gather_fp8(self.comm, self.fp8[index],
                                                 self._fp8_payload(index, scales), scales,
                                                 dims.dp_group, tag)
        elif config.quantized_weights:
            self.pending[index] = collectives.all_gather_quantized(
                self.comm, shard, dims.dp_group, config.weight_bits, config.block_size, tag,
                payload=self._quantized_shard(index), full_range=config.quantize_full_range)
        else:
            self.pending[index] = collectives.all_gather(self.comm, shard, dims.dp_group, tag)

    def fetch(self, index: int, tag: str) -> None:
        """Make unit `index`'s parameters whole (wait for its gather; launch it if need be)."""
        if self.full[index] is not None:
            return
        self.launch(index, tag)
        full = self.pending[index].wait()
        self.pending[index] = None
        self.full[index] = full
        self.meter.hold(full)
        layout = self.fp8[index]
        if layout is not None and layout.codes is not None:  # handed to the linears
            self.meter.hold(layout.codes)
        if self.config.hpz and self.from_primary[index]:
            part = full.numel() // self.dims.dp_per_node
            start = self.dims.intra_node_rank * part
            self.secondary[index] = full[start:start + part].clone()
            self.meter.hold(self.secondary[index])
        for param, view in zip(self.units[index].params, self.units[index].views(full)):
            param.data = view

    def release(self, index: int) -> None:
        """Free unit `index`'s gathered copy (waiting out a gather still in flight)."""
        if self.pending[index] is not None:
            self.pending[index].wait()
            self.pending[index] = None
        if self.full[index] is None:
            return
        for param, empty in zip(self.units[index].params, self._empties[index]):
            param.data = empty
        if self.exact[index]:  # the next gather may be quantized: other values
            self.exact[index] = False
            _changed(self.units[index].params)
        self.meter.drop(self.full[index])
        self.full[index] = None
        layout = self.fp8[index]
        if layout is not None and layout.codes is not None:
            self.meter.drop(layout.codes)
            layout.unpublish()

    def release_all(self) -> None:
        for index in range(len(self.units)):
            self.release(index)

    def materialize(self) -> None:
        """Gather every unit exactly (unquantized, from the primary shards) until
        release_all()."""
        self.release_all()
        for index, shard in enumerate(self.shards):
            self.pending[index] = collectives.all_gather(self.comm, shard, self.dims.dp_group,
                                                         "weights state dict")
            self.from_primary[index] = False
            self.fetch(index, "weights state dict")
            self.exact[index] = True
            _changed(self.units[index].params)

    def _quantized_shard(self, index: int) -> torch.Tensor | None:
        """qwZ without hpZ: unit `index`'s quantized shard, made once per refresh (see the module
        docstring). With hpZ, None: only the first gather after a refresh quantizes."""
        if self.config.hpz:
            return None
        if self.quantized[index] is None:
            self.quantized[index] = collectives.quantize_shard(
                self.shards[index], self.config.weight_bits, self.config.block_size,
                self.config.quantize_full_range)
            self.meter.hold(self.quantized[index])
        return self.quantized[index]

    def _fp8_payload(self, index: int, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Unit `index`'s FP8 payloads (codes, other parameters), made once per refresh."""
        if self.fp8_payloads[index] is None:
            self.fp8_payloads[index] = self.fp8[index].encode(self.shards[index], scales)
            for payload in self.fp8_payloads[index]:
                self.meter.hold(payload)
        return self.fp8_payloads[index]

    def refresh(self) -> None:
        """The shards changed: drop gathered copies, hpZ secondaries (the next gather of each
        unit goes over the DP group and makes a new secondary), qwZ's quantized shards and the
        FP8 payloads and scales; the parameters' version counters bumped."""
        self.release_all()
        for unit in self.units:
            _changed(unit.params)
        if self.scales is not None:
            self.scales.clear()
        for index, payloads in enumerate(self.fp8_payloads):
            for payload in payloads or ():
                self.meter.drop(payload)
            self.fp8_payloads[index] = None
        for copies in (self.secondary, self.quantized):
            for index, copy in enumerate(copies):
                if copy is not None:
                    self.meter.drop(copy)
                    copies[index] = None

    # ---- hooks -----------------------------------------------------------------------------

    def _before_forward(self, index: int) -> None:
        self.fetch(index, "weights forward")
        if self.config.prefetch and index + 1 < len(self.units):
            self.launch(index + 1, "weights forward")

    def _after_forward(self, index: int, output):
        if not torch.is_grad_enabled():
            self.release(index)
            return output
        if self.is_root[index]:
            return output
        self.release(index)
        hook = lambda: self._before_backward(index)  # noqa: E731
        if isinstance(output, torch.Tensor):
            return _BeforeBackward.apply(hook, output) if output.requires_grad else output
        if isinstance(output, tuple):
            return tuple(_BeforeBackward.apply(hook, x)
                         if isinstance(x, torch.Tensor) and x.requires_grad else x
                         for x in output)
        return output

    def _before_backward(self, index: int) -> None:
        self.fetch(index, "weights backward")
        if self.config.prefetch and index > 0:
            self.launch(index - 1, "weights backward")


def _fp8_layouts(units: list[FlatUnit], fp8_weights: dict | None,
                 dims) -> list[FP8Layout | None]:
    return [FP8Layout.of(unit, fp8_weights, dims.dp, dims.dp_rank, _dtype_of(unit))
            if fp8_weights else None for unit in units]


def _changed(params: list[nn.Parameter]) -> None:
    """Bump the version counters of `params`, whose values the engine changed through their flat
    buffer (module docstring)."""
    torch.autograd.graph.increment_version(params)


def _dtype_of(unit: FlatUnit) -> torch.dtype:
    dtypes = {p.dtype for p in unit.params}
    if len(dtypes) != 1:
        raise ValueError(f"ZeRO unit {unit.name} mixes parameter dtypes {sorted(map(str, dtypes))}:"
                         " a unit is one flat buffer of one dtype")
    return dtypes.pop()


def _empty_like(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=param.dtype, device=param.device)
