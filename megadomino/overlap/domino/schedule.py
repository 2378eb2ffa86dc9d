"""The Domino overlap engine: a TransformerBlock's layers run over N batch slices and K hidden
(ffn) slices, with every tensor-parallel collective launched async and waited only where its
result is consumed - in the forward, in the backward, and across layer boundaries.

Units. Each layer and batch slice i is cut at its communication points into small autograd
graphs whose inputs are detached leaves, so that the schedule (not autograd's node order) decides
what runs between a collective's launch and its wait. The schedule is data: the action lists of
actions.py (forward_actions, backward_actions), which DominoRunner executes one action at a time
and `actions.table` prints. The units run the layer's own pieces (TransformerLayer.residual,
its norms, Attention.partial, MLP.partial) with GEMMs whose weight gradients are deferred:

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

from megadomino.config import DominoPlan
from megadomino.distributed import random as tp_random
from megadomino.distributed.mappings import all_gather_dim0, all_reduce, reduce_scatter_dim0
from megadomino.overlap.domino.actions import backward_actions, forward_actions
from megadomino.overlap.domino.units import Pending, WgradSink, domino_linear, leaf


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
    a_reduced: torch.Tensor | None = None     # forward: reduce(a), waited for glue_mid
    grad_reduced: torch.Tensor | None = None  # backward: the reduced dv or du just waited
    grad_a: torch.Tensor | None = None
    grad_u: torch.Tensor | None = None        # backward, a linked: du from glue_mid's call
    in_linked: bool = False  # glue_in reads the previous layer's m itself (no leaf): links()
    a_linked: bool = False   # glue_mid reads a itself (no leaf): links()


class DominoRunner:
    """Runs `block.layers` through the Domino schedule (the final norm stays with the block).
    Its forward does not call the layers' modules, so their forward hooks do not run
    (`bypasses_layer_hooks`: ZeRO-3, which gathers a layer in its hook, refuses it)."""

    bypasses_layer_hooks = True

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

    def links(self) -> bool:
        """Whether a reduced output enters the next unit's graph as the partial tensor itself
        rather than as a detached leaf, so that one `autograd.grad` call runs back through both
        units (glue_mid with attention; the next glue_in, or glue_out, with mlp). True without
        sequence parallelism: the all-reduce runs in place on the partial's storage (m of K
        chunks is their sum, taken in the graph in Pending's order) and its backward is the
        identity, so values and gradients equal the leaf path's bit for bit. Under SP the
        reduce-scatter makes a new tensor whose backward is an all-gather: leaves there."""
        return not self.sp

    def _glue_params(self, index: int, which: str, memo: dict) -> list:
        """The parameters of a glue graph: the norm it applies and the bias its residual adds
        (the layer's pieces: input_layernorm / pre_mlp_layernorm, attention_bias / mlp_bias).
        Looked up once per backward (`memo`), not once per slice."""
        if (index, which) in memo:
            return memo[index, which]
        layers = self.block.layers
        if which == "in":
            params = list(layers[index].input_layernorm.parameters())
            params.append(layers[index - 1].mlp_bias if index > 0 else None)
        elif which == "mid":
            params = [*layers[index].pre_mlp_layernorm.parameters(),
                      layers[index].attention_bias]
        else:
            params = [layers[-1].mlp_bias]
        memo[index, which] = [p for p in params if p is not None and p.requires_grad]
        return memo[index, which]

    def _linear(self, x, linear, dim=None, start=0, length=None, bias=True):
        """The layer pieces' LocalLinear: a GEMM whose weight gradient is deferred to the
        current sink (units.domino_linear)."""
        return domino_linear(self.sinks[-1], x, linear.weight, linear.bias if bias else None,
                             dim, start, length)

    # ---- the units -----------------------------------------------------------------------
    def _glue_in(self, index: int, unit: _Unit, build: bool) -> None:
        layers = self.block.layers
        if build and unit.in_linked:
            unit.in_leaves = [leaf(unit.inputs[0])]
            values = [unit.in_leaves[0], unit.inputs[1]]
        elif build:
            unit.in_leaves = [leaf(t) for t in unit.inputs]
            values = unit.in_leaves
        else:
            values = unit.inputs
        if index == 0:
            x = values[0]
        else:
            prev = layers[index - 1]
            x = prev.residual(values[0], values[1], prev.mlp_bias)
        unit.x, unit.u = x, layers[index].input_layernorm(x)

    def _attention(self, index: int, unit: _Unit, rotary, pending: Pending, build: bool):
        u_full = self._gather(unit.u)
        unit.u_leaf = leaf(u_full) if build else u_full
        unit.a = self.block.layers[index].self_attention.partial(unit.u_leaf, rotary,
                                                                  self._linear)
        self._reduce(unit.a, pending)

    def _glue_mid(self, index: int, unit: _Unit, reduced_a: torch.Tensor, build: bool) -> None:
        layer = self.block.layers[index]
        unit.x_leaf = leaf(unit.x) if build else unit.x
        unit.a_linked = build and self.links()
        if unit.a_linked:  # reduced_a is a's own storage, reduced in place
            a_in = unit.a
        else:
            a_in = unit.a_leaf = leaf(reduced_a) if build else reduced_a
        unit.h = layer.residual(unit.x_leaf, a_in, layer.attention_bias)
        unit.v = layer.pre_mlp_layernorm(unit.h)

    def _mlp(self, index: int, unit: _Unit, pending: Pending | None, build: bool) -> None:
        mlp = self.block.layers[index].mlp
        v_full = self._gather(unit.v)
        unit.v_leaf = leaf(v_full) if build else v_full
        chunk = mlp.linear_fc2.weight.shape[1] // self.plan.hidden_slices
        unit.m_parts = []
        for k in range(self.plan.hidden_slices):
            part = mlp.partial(unit.v_leaf, self._linear, k * chunk, chunk)
            unit.m_parts.append(part)
            if pending is not None:
                self._reduce(part, pending)

    # ---- forward -------------------------------------------------------------------------
    def _slice(self, t: torch.Tensor | None, start: int, size: int):
        if t is None or t.shape[1] == 1:
            return t
        return t.narrow(1, start, size)

    def _forward(self, x: torch.Tensor, rotary, build: bool):
        """Run forward_actions; returns (output, units[layer][slice], output leaves)."""
        sizes = self.plan.slice_sizes(x.shape[1])
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        rotaries = [None if rotary is None else
                    tuple(self._slice(t, s, n) for t in rotary) for s, n in zip(starts, sizes)]
        n_layers, n_slices = len(self.block.layers), len(sizes)
        units = [[_Unit() for _ in range(n_slices)] for _ in range(n_layers)]
        inputs = [[x.narrow(1, s, n).contiguous()] for s, n in zip(starts, sizes)]
        pending: dict[tuple, Pending] = {}
        outputs, out_leaves = [None] * n_slices, [None] * n_slices
        last = self.block.layers[-1]
        built = [build and not self._recomputed(index) for index in range(n_layers)] + [build]
        dropout, m_linked = self._has_dropout(), [False] * n_slices
        for action in forward_actions(n_layers, n_slices, self.plan.hidden_slices):
            index, i = action.layer, action.slice
            if action.op == "glue_out":
                h, m = inputs[i]
                if build:  # m linked: out_leaves (h, None), m stays the last mlp's graph
                    h, m = leaf(h), (m if m_linked[i] else leaf(m))
                    out_leaves[i] = (h, None if m_linked[i] else m)
                outputs[i] = last.residual(h, m, last.mlp_bias)
                continue
            unit = units[index][i]
            if action.op == "wait":
                if action.waits == "m":  # the next layer's glue_in (or glue_out) input
                    m_linked[i] = built[index] and built[index + 1] and self.links()
                    reduced = pending.pop(("m", index, i)).wait(
                        unit.m_parts if m_linked[i] else None)
                    inputs[i] = [inputs[i][0], reduced]
                else:
                    unit.a_reduced = pending.pop(("a", index, i)).wait()
                continue
            layer_build = built[index]
            capture = build and not layer_build and dropout
            with torch.set_grad_enabled(layer_build):
                if action.op == "glue_in":
                    unit.inputs, unit.in_linked = inputs[i], m_linked[i]
                    if capture:
                        unit.rng["in"] = self._rng_capture()
                    self._glue_in(index, unit, layer_build)
                elif action.op == "attention":
                    pending[("a", index, i)] = Pending()
                    self._attention(index, unit, rotaries[i], pending[("a", index, i)],
                                    layer_build)
                elif action.op == "glue_mid":
                    if capture:
                        unit.rng["mid"] = self._rng_capture()
                    self._glue_mid(index, unit, unit.a_reduced, layer_build)
                    unit.a_reduced = None
                elif action.op == "mlp":
                    pending[("m", index, i)] = Pending()
                    self._mlp(index, unit, pending[("m", index, i)], layer_build)
                    inputs[i] = [unit.h.detach()]
                    if build and not layer_build:  # keep only what the recompute starts from
                        units[index][i] = _Unit(inputs=unit.inputs, rng=unit.rng)
                else:
                    raise AssertionError(f"forward action {action}")
        output = torch.cat([o.detach() for o in outputs], dim=1) if build else \
            torch.cat(outputs, dim=1)
        return output, units, (outputs, out_leaves, rotaries)

    def _has_dropout(self) -> bool:
        return self.config.hidden_dropout > 0 or self.config.attention_dropout > 0

    def _rebuild(self, index: int, layer_units: list[_Unit], rotaries: list) -> None:
        """Recompute one layer's graphs (all slices) from the kept glue_in inputs: the layer's
        forward actions again, each unit's generator states restored, no reduce of m (the
        next layer's input is not needed again)."""
        current = self._rng_capture() if self._has_dropout() else None
        pending: dict[tuple, Pending] = {}
        for action in forward_actions(len(self.block.layers), len(layer_units),
                                      self.plan.hidden_slices):
            if action.layer != index or action.waits == "m":
                continue
            unit, i = layer_units[action.slice], action.slice
            if action.op == "wait":
                unit.a_reduced = pending.pop(("a", index, i)).wait()
            elif action.op == "glue_in":
                if "in" in unit.rng:
                    self._rng_restore(unit.rng["in"])
                self._glue_in(index, unit, True)
            elif action.op == "attention":
                pending[("a", index, i)] = Pending()
                self._attention(index, unit, rotaries[i], pending[("a", index, i)], True)
            elif action.op == "glue_mid":
                if "mid" in unit.rng:
                    self._rng_restore(unit.rng["mid"])
                self._glue_mid(index, unit, unit.a_reduced, True)
                unit.a_reduced = None
            elif action.op == "mlp":
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
        """Run backward_actions; returns the gradient of the block's input."""
        units, (outputs, out_leaves, rotaries), sink = state
        layers = self.block.layers
        n_layers, n_slices = len(layers), len(out_leaves)
        sizes = [o.shape[1] for o in outputs]
        grad_slices = [g.contiguous() for g in grad_output.split(sizes, dim=1)]
        grad_h, grad_m = [None] * n_slices, [None] * n_slices
        grad_inputs = [None] * n_slices
        pending: dict[tuple, Pending] = {}
        recomputed = frozenset(i for i in range(n_layers) if self._recomputed(i))
        memo: dict = {}
        for action in backward_actions(n_layers, n_slices, recomputed):
            index, i = action.layer, action.slice
            if action.op == "glue_out":
                if out_leaves[i][1] is None:  # m linked: run with the last mlp (action mlp)
                    continue
                grad_h[i], grad_m[i] = self._grad(sink, [outputs[i]], [grad_slices[i]],
                                                  list(out_leaves[i]),
                                                  self._glue_params(-1, "out", memo))
            elif action.op == "recompute":
                with torch.enable_grad():
                    self._rebuild(index, units[index], rotaries)
            elif action.op == "flush":
                sink.flush(layers[index].parameters())
                units[index] = None
            elif action.op == "wait":
                units[index][i].grad_reduced = pending.pop((action.waits, index, i)).wait()
            elif action.op == "glue_in":
                unit = units[index][i]
                if unit.in_linked:  # runs with the previous layer's mlp (action mlp)
                    continue
                grads = self._glue_in_backward(sink, index, unit, unit.grad_reduced, memo)
                if index == 0:
                    grad_inputs[i] = grads[0]
                else:
                    grad_h[i], grad_m[i] = grads
            elif action.op == "mlp":
                unit = units[index][i]
                if index + 1 < n_layers and units[index + 1][i].in_linked:
                    after = units[index + 1][i]
                    grad_h[i], grad_v = self._grad(
                        sink, [after.x, after.u], [after.grad_x, after.grad_reduced],
                        [after.in_leaves[0], unit.v_leaf],
                        self._glue_params(index + 1, "in", memo))
                elif index + 1 == n_layers and out_leaves[i][1] is None:
                    grad_h[i], grad_v = self._grad(sink, [outputs[i]], [grad_slices[i]],
                                                   [out_leaves[i][0], unit.v_leaf],
                                                   self._glue_params(-1, "out", memo))
                else:
                    grad_m_full = self._output_grad(grad_m[i])
                    (grad_v,) = self._grad(sink, unit.m_parts,
                                           [grad_m_full] * len(unit.m_parts), [unit.v_leaf], [])
                pending[("dv", index, i)] = self._reduce_grad(grad_v)
                sink.run_deferred()
            elif action.op == "glue_mid":
                unit = units[index][i]
                leaves = [unit.x_leaf, unit.u_leaf if unit.a_linked else unit.a_leaf]
                unit.grad_x, grad = self._grad(sink, [unit.h, unit.v],
                                               [grad_h[i], unit.grad_reduced], leaves,
                                               self._glue_params(index, "mid", memo))
                unit.grad_u, unit.grad_a = (grad, None) if unit.a_linked else (None, grad)
            elif action.op == "attention":
                unit = units[index][i]
                grad_u = unit.grad_u
                if not unit.a_linked:
                    (grad_u,) = self._grad(sink, [unit.a], [self._output_grad(unit.grad_a)],
                                           [unit.u_leaf], [])
                pending[("du", index, i)] = self._reduce_grad(grad_u)
                sink.run_deferred()
            else:
                raise AssertionError(f"backward action {action}")
        return torch.cat(grad_inputs, dim=1)

    def _glue_in_backward(self, sink, index: int, unit: _Unit, grad_u: torch.Tensor,
                          memo: dict):
        """Back through glue_in, given its reduced input gradient: returns the gradients of
        glue_in's inputs ((h, m) of the previous layer, or the block input)."""
        params = self._glue_params(index, "in", memo)
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
