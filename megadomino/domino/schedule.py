"""The Domino overlap engine: a TransformerBlock's layers run over N batch slices and K hidden
(ffn) slices, with every tensor-parallel collective launched async and waited only where its
result is consumed - in the forward, in the backward, and across layer boundaries.

Units. Each layer and batch slice i is cut at its communication points into small autograd
graphs whose inputs are detached leaves, so that the schedule (not autograd's node order) decides
what runs between a collective's launch and its wait:

    glue_in(l, i):   (h_{l-1}, m_{l-1}) -> x = h_{l-1} + dropout(m_{l-1} + b_fc2), u = ln1(x)
    attention(l, i): u (gathered under SP)  -> a: this rank's partial attention output
    glue_mid(l, i):  (x, reduce(a))         -> h = x + dropout(a + b_proj), v = ln2(h)
    mlp(l, i):       v (gathered under SP)  -> m_1..m_K: partial outputs of the K ffn chunks
    glue_out(i):     (h_{L-1}, m_{L-1})     -> y = h + dropout(m + b_fc2)

Forward order per layer: attention(l, 0..N-1) then mlp(l, 0..N-1). The reduce of a (all-reduce,
or reduce-scatter under sequence parallelism) and of each m_k is launched as soon as it is
computed; glue_mid / the next layer's glue_in wait for it. So slice i's reduce overlaps slice
i+1's GEMMs, chunk k's overlaps chunk k+1's, and the last slice's overlaps the next layer's first
slice (the schedule owns the loop over layers).

Backward order (explicit; every call is `torch.autograd.grad` on one unit): for l = L-1..0:
mlp(l, i) for each i - preceded by glue_in(l+1, i) - then attention(l, i) for each i - preceded by
glue_mid(l, i). A unit's input-gradient reduce is launched right after its data-gradient GEMMs;
its weight-gradient GEMMs are deferred (units.py) and run right after that launch, so they
overlap it, and the wait happens only when the next unit of the same slice needs the gradient,
after the other slices' units ran. Parameter gradients are summed over slices in fp32 and handed
to autograd once per layer (`torch.autograd.backward` on the leaf parameters), so gradient hooks
(the DP gradient buffer) see one accumulation per parameter per backward, layer by layer.

Streams: everything is enqueued on the current stream; collectives are async work handles whose
`wait()` makes the current stream wait for them. No reliance on CUDA_DEVICE_MAX_CONNECTIONS.

RNG: dropout draws happen per slice in the order above (default generator for activations every
TP rank holds whole, the model-parallel stream for attention probabilities and sequence shards),
so masks differ from the unsliced model's though they are drawn from the same streams; with
activation recompute each unit's generator states are captured in the forward and restored
when it is recomputed, so the recompute replays the same masks.

Recompute: with `recompute_granularity='full'` the chosen layers ('uniform': every layer,
'block': the first recompute_num_layers) keep only their glue_in inputs per slice and are rebuilt
(with their forward collectives) just before their backward. 'selective' works unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megadomino.config import DominoPlan
from megadomino.distributed import random as tp_random
from megadomino.distributed.mappings import all_gather_dim0, all_reduce, reduce_scatter_dim0
from megadomino.domino.units import Pending, WgradSink, domino_linear, leaf


@dataclass
class _Unit:
    """The graphs of one (layer, slice). Fields are filled as the schedule goes."""

    inputs: list = field(default_factory=list)       # glue_in's input values (kept for recompute)
    rng: dict = field(default_factory=dict)          # generator states (recompute with dropout)
    in_leaves: list = field(default_factory=list)
    x: torch.Tensor | None = None
    u: torch.Tensor | None = None
    u_leaf: torch.Tensor | None = None
    a: torch.Tensor | None = None
    x_leaf: torch.Tensor | None = None
    a_leaf: torch.Tensor | None = None
    h: torch.Tensor | None = None
    v: torch.Tensor | None = None
    v_leaf: torch.Tensor | None = None
    m_parts: list = field(default_factory=list)
    grad_x: torch.Tensor | None = None


class DominoRunner:
    """Runs `block.layers` through the Domino schedule (the final norm stays with the block)."""

    def __init__(self, block, plan: DominoPlan):
        self.block, self.plan = block, plan
        self.config, self.dims = block.config, block.dims
        self.parallel = block.parallel
        self.sp = self.parallel.sequence_parallel and self.dims.tp > 1
        self.sinks: list[WgradSink] = []
        """The sinks of the passes in progress, innermost last: a forward (or a forward re-run
        by recompute inside a backward) queues its weight-gradient GEMMs on the last one."""

    def __call__(self, x: torch.Tensor, rotary) -> torch.Tensor:
        """x (s, b, h) (s/tp under sequence parallelism) -> the last layer's output."""
        if not torch.is_grad_enabled():
            sink = WgradSink(False)
            self.sinks.append(sink)
            try:
                return self._forward(x, rotary, build=False)[0]
            finally:
                self.sinks.pop()
        anchor = torch.empty(0, device=x.device, requires_grad=True)
        return _DominoBlock.apply(x, anchor, self, rotary)

    # ---- helpers -------------------------------------------------------------------------
    def _recomputed(self, layer_index: int) -> bool:
        config = self.parallel
        if config.recompute_granularity != "full" or not self.block.training:
            return False
        return config.recompute_method == "uniform" or layer_index < config.recompute_num_layers

    def _rng_capture(self) -> tuple:
        device_state = torch.cuda.get_rng_state() if torch.cuda.is_available() \
            else torch.get_rng_state()
        return device_state, tp_random.tracker_of(self.dims).get_states()

    def _rng_restore(self, state: tuple) -> None:
        device_state, tracker_states = state
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(device_state)
        else:
            torch.set_rng_state(device_state)
        tp_random.tracker_of(self.dims).set_states(tracker_states)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """A unit's input: the whole sequence (all-gathered under sequence parallelism)."""
        return all_gather_dim0(t.detach(), self.dims.tp_group)[0] if self.sp else t.detach()

    def _reduce(self, partial: torch.Tensor, pending: Pending) -> None:
        """Launch the reduction of a partial output (all-reduce, or reduce-scatter under SP) on
        the TP group. (A second TP communicator with fewer NCCL CTAs for the overlapped ones
        measured slower: BENCHMARKS.md.)"""
        group = self.dims.tp_group
        if self.sp:
            pending.add(*reduce_scatter_dim0(partial.detach(), group, async_op=True))
        else:
            data = partial.detach()
            pending.add(data, all_reduce(data, group, async_op=True))

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of a unit's partial output from its reduced output's (under SP, the
        reduce-scatter's backward is an all-gather)."""
        return all_gather_dim0(grad, self.dims.tp_group)[0] if self.sp else grad

    def _reduce_grad(self, grad: torch.Tensor) -> Pending:
        pending = Pending()
        self._reduce(grad, pending)
        return pending

    def _glue_params(self, index: int, which: str) -> list:
        layers = self.block.layers
        if which == "in":
            params = list(layers[index].input_layernorm.parameters())
            if index > 0 and layers[index - 1].mlp.linear_fc2.bias is not None:
                params.append(layers[index - 1].mlp.linear_fc2.bias)
        elif which == "mid":
            layer = layers[index]
            params = list(layer.pre_mlp_layernorm.parameters())
            if layer.self_attention.linear_proj.bias is not None:
                params.append(layer.self_attention.linear_proj.bias)
        else:
            bias = layers[-1].mlp.linear_fc2.bias
            params = [bias] if bias is not None else []
        return [p for p in params if p.requires_grad]

    @staticmethod
    def _residual(layer, residual, reduced, bias) -> torch.Tensor:
        return residual + layer.hidden_dropout(reduced if bias is None else reduced + bias)

    # ---- the units -----------------------------------------------------------------------
    def _glue_in(self, index: int, unit: _Unit, build: bool) -> None:
        layers = self.block.layers
        if build:
            unit.in_leaves = [leaf(t) for t in unit.inputs]
            values = unit.in_leaves
        else:
            values = unit.inputs
        if index == 0:
            x = values[0]
        else:
            prev = layers[index - 1]
            x = self._residual(prev, values[0], values[1], prev.mlp.linear_fc2.bias)
        unit.x, unit.u = x, layers[index].input_layernorm(x)

    def _attention(self, index: int, unit: _Unit, rotary, pending: Pending, build: bool):
        attention = self.block.layers[index].self_attention
        u_full = self._gather(unit.u)
        unit.u_leaf = leaf(u_full) if build else u_full
        sink = self.sinks[-1]
        qkv = domino_linear(sink, unit.u_leaf, attention.linear_qkv.weight,
                            attention.linear_qkv.bias)
        unit.a = domino_linear(sink, attention.attend(qkv, rotary), attention.linear_proj.weight)
        self._reduce(unit.a, pending)

    def _glue_mid(self, index: int, unit: _Unit, reduced_a: torch.Tensor, build: bool) -> None:
        layer = self.block.layers[index]
        unit.x_leaf = leaf(unit.x) if build else unit.x
        unit.a_leaf = leaf(reduced_a) if build else reduced_a
        unit.h = self._residual(layer, unit.x_leaf, unit.a_leaf,
                                layer.self_attention.linear_proj.bias)
        unit.v = layer.pre_mlp_layernorm(unit.h)

    def _mlp(self, index: int, unit: _Unit, pending: Pending | None, build: bool) -> None:
        mlp = self.block.layers[index].mlp
        v_full = self._gather(unit.v)
        unit.v_leaf = leaf(v_full) if build else v_full
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        ffn_local = fc2.weight.shape[1]
        chunk = ffn_local // self.plan.hidden_slices
        unit.m_parts = []
        sink = self.sinks[-1]
        for k in range(self.plan.hidden_slices):
            start = k * chunk
            if self.config.swiglu:
                gate = domino_linear(sink, unit.v_leaf, fc1.weight, fc1.bias, 0, start, chunk)
                up = domino_linear(sink, unit.v_leaf, fc1.weight, fc1.bias, 0, ffn_local + start,
                                   chunk)
                act = F.silu(gate) * up
            elif self.plan.hidden_slices == 1:
                act = mlp.activation(domino_linear(sink, unit.v_leaf, fc1.weight, fc1.bias))
            else:
                act = mlp.activation(
                    domino_linear(sink, unit.v_leaf, fc1.weight, fc1.bias, 0, start, chunk))
            part = domino_linear(sink, act, fc2.weight, None, 1, start, chunk)
            unit.m_parts.append(part)
            if pending is not None:
                self._reduce(part, pending)

    # ---- forward -------------------------------------------------------------------------
    def _slice(self, t: torch.Tensor | None, start: int, size: int):
        if t is None or t.shape[1] == 1:
            return t
        return t.narrow(1, start, size)

    def _forward(self, x: torch.Tensor, rotary, build: bool):
        """Run the schedule; returns (output, units[layer][slice], output leaves)."""
        sizes = self.plan.slice_sizes(x.shape[1])
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        rotaries = [None if rotary is None else
                    tuple(self._slice(t, s, n) for t in rotary) for s, n in zip(starts, sizes)]
        n_slices = len(sizes)
        units: list[list[_Unit]] = []
        inputs = [[x.narrow(1, s, n).contiguous()] for s, n in zip(starts, sizes)]
        pending_m: list = [None] * n_slices
        for index in range(len(self.block.layers)):
            layer_build = build and not self._recomputed(index)
            capture = build and not layer_build and self._has_dropout()
            layer_units = [_Unit() for _ in range(n_slices)]
            with torch.set_grad_enabled(layer_build):
                pending_a = []
                for i, unit in enumerate(layer_units):
                    if pending_m[i] is not None:
                        inputs[i] = [inputs[i][0], pending_m[i].wait()]
                    unit.inputs = inputs[i]
                    if capture:
                        unit.rng["in"] = self._rng_capture()
                    self._glue_in(index, unit, layer_build)
                    pending_a.append(Pending())
                    self._attention(index, unit, rotaries[i], pending_a[i], layer_build)
                for i, unit in enumerate(layer_units):
                    if capture:
                        unit.rng["mid"] = self._rng_capture()
                    self._glue_mid(index, unit, pending_a[i].wait(), layer_build)
                    pending_m[i] = Pending()
                    self._mlp(index, unit, pending_m[i], layer_build)
                    inputs[i] = [unit.h.detach()]
            if build and not layer_build:  # keep only what the recompute starts from
                layer_units = [_Unit(inputs=u.inputs, rng=u.rng) for u in layer_units]
            units.append(layer_units)
        last = self.block.layers[-1]
        outputs, out_leaves = [], []
        for i in range(n_slices):
            h, m = inputs[i][0], pending_m[i].wait()
            if build:
                h, m = leaf(h), leaf(m)
                out_leaves.append((h, m))
            outputs.append(self._residual(last, h, m, last.mlp.linear_fc2.bias))
        output = torch.cat([o.detach() for o in outputs], dim=1) if build else \
            torch.cat(outputs, dim=1)
        return output, units, (outputs, out_leaves, rotaries)

    def _has_dropout(self) -> bool:
        return self.config.hidden_dropout > 0 or self.config.attention_dropout > 0

    def _rebuild(self, index: int, layer_units: list[_Unit], rotaries: list) -> None:
        """Recompute one layer's graphs (all slices) from the kept glue_in inputs."""
        current = self._rng_capture() if self._has_dropout() else None
        pending_a = []
        for i, unit in enumerate(layer_units):
            if "in" in unit.rng:
                self._rng_restore(unit.rng["in"])
            self._glue_in(index, unit, True)
            pending_a.append(Pending())
            self._attention(index, unit, rotaries[i], pending_a[i], True)
        for i, unit in enumerate(layer_units):
            if "mid" in unit.rng:
                self._rng_restore(unit.rng["mid"])
            self._glue_mid(index, unit, pending_a[i].wait(), True)
            self._mlp(index, unit, None, True)
        if current is not None:
            self._rng_restore(current)

    # ---- backward ------------------------------------------------------------------------
    def _grad(self, sink: WgradSink, outputs, grads, leaves, params):
        """Gradients of one unit's graph: returns the leaves' grads, adds the params' to sink."""
        pairs = [(o, g) for o, g in zip(outputs, grads) if o is not None and o.requires_grad]
        wanted = [leaf for leaf in leaves if leaf is not None] + params
        result = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                     allow_unused=True)
        for param, grad in zip(params, result[len(wanted) - len(params):]):
            if grad is not None:
                sink.add(param, grad)
        leaf_grads = iter(result[: len(wanted) - len(params)])
        return [None if leaf is None else next(leaf_grads) for leaf in leaves]

    def backward(self, state, grad_output: torch.Tensor) -> torch.Tensor:
        units, (outputs, out_leaves, rotaries), sink = state
        layers = self.block.layers
        n_layers, n_slices = len(layers), len(out_leaves)
        sizes = [o.shape[1] for o in outputs]
        grad_slices = [g.contiguous() for g in grad_output.split(sizes, dim=1)]
        grad_h, grad_m = [None] * n_slices, [None] * n_slices
        for i in range(n_slices):
            grad_h[i], grad_m[i] = self._grad(sink, [outputs[i]], [grad_slices[i]],
                                              list(out_leaves[i]), self._glue_params(-1, "out"))
        pending_u: list = []
        for index in reversed(range(n_layers)):
            if self._recomputed(index):
                with torch.enable_grad():
                    self._rebuild(index, units[index], rotaries)
            pending_v = []
            for i in range(n_slices):
                if index < n_layers - 1:
                    grad_h[i], grad_m[i] = self._glue_in_backward(sink, index + 1,
                                                                  units[index + 1][i],
                                                                  pending_u[i])
                unit = units[index][i]
                grad_m_full = self._output_grad(grad_m[i])
                (grad_v,) = self._grad(sink, unit.m_parts, [grad_m_full] * len(unit.m_parts),
                                       [unit.v_leaf], [])
                pending_v.append(self._reduce_grad(grad_v))
                sink.run_deferred()
            if index < n_layers - 1:
                sink.flush(layers[index + 1].parameters())
                units[index + 1] = None
            pending_u = []
            for i in range(n_slices):
                unit = units[index][i]
                unit.grad_x, grad_a = self._grad(sink, [unit.h, unit.v],
                                                 [grad_h[i], pending_v[i].wait()],
                                                 [unit.x_leaf, unit.a_leaf],
                                                 self._glue_params(index, "mid"))
                (grad_u,) = self._grad(sink, [unit.a], [self._output_grad(grad_a)],
                                       [unit.u_leaf], [])
                pending_u.append(self._reduce_grad(grad_u))
                sink.run_deferred()
        grad_inputs = [self._glue_in_backward(sink, 0, units[0][i], pending_u[i])[0]
                       for i in range(n_slices)]
        sink.flush(layers[0].parameters())
        return torch.cat(grad_inputs, dim=1)

    def _glue_in_backward(self, sink, index: int, unit: _Unit, pending: Pending):
        """Wait for the unit's input-gradient reduction, then back through glue_in: returns the
        gradients of glue_in's inputs ((h, m) of the previous layer, or the block input)."""
        grad_u = pending.wait()
        params = self._glue_params(index, "in")
        if index == 0:  # x is the input leaf itself: its residual gradient passes straight on
            (grad_input,) = self._grad(sink, [unit.u], [grad_u], unit.in_leaves, params)
            return grad_input + unit.grad_x, None
        return self._grad(sink, [unit.x, unit.u], [unit.grad_x, grad_u], unit.in_leaves, params)


class _DominoBlock(torch.autograd.Function):
    """The whole layer stack as one autograd node whose backward is DominoRunner.backward."""

    @staticmethod
    def forward(ctx, x, anchor, runner: DominoRunner, rotary):
        sink = WgradSink(runner.plan.batch_slices > 1)
        runner.sinks.append(sink)
        try:
            with torch.enable_grad():
                output, units, outs = runner._forward(x, rotary, build=True)
        finally:
            runner.sinks.pop()
        ctx.runner, ctx.state = runner, (units, outs, sink)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        runner, state = ctx.runner, ctx.state
        ctx.state = None
        runner.sinks.append(state[2])
        try:
            grad_x = runner.backward(state, grad_output.contiguous())
        finally:
            runner.sinks.pop()
        return grad_x, None, None, None
