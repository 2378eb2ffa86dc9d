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

Backward order (explicit, backward.py: `torch.autograd.grad` on one unit, or on two where no
collective separates them): for l = L-1..0: mlp(l, i) for each i - preceded by glue_in(l+1, i) -
then attention(l, i) for each i - preceded by glue_mid(l, i). A unit's input-gradient reduce is
launched right after its data-gradient GEMMs; its weight-gradient GEMMs are deferred (units.py)
and run right after that launch, so they overlap it, and the wait happens only when the next
unit of the same slice needs the gradient, after the other slices' units ran. Parameter
gradients are summed over slices in fp32 and handed to autograd once per layer, so gradient
hooks (the DP gradient buffer) see one accumulation per parameter per backward, layer by layer.

Capture mode (`DominoRunner(..., capture_mode=True)`, what `--enable-cuda-graph` captures:
overlap/cuda_graph.py): the block's autograd node takes the layers' parameters as inputs and its
backward returns their slice sums (WgradSink.take) with the input's gradient, instead of handing
them over layer by layer from nested backward calls, which `torch.cuda.make_graphed_callables`
(one `autograd.grad` over inputs and parameters) could not see and which would accumulate into
`.grad` inside the graph's memory. The sums are the same tensors, so values and gradients equal
the eager mode's bit for bit; the gradient hooks then fire once the whole block's backward is
done, not layer by layer.

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

import torch

from megadomino.config import DominoPlan
from megadomino.distributed import random as tp_random
from megadomino.distributed.mappings import all_gather_dim0, all_reduce, reduce_scatter_dim0
from megadomino.overlap.domino.actions import Action, backward_actions, forward_actions
from megadomino.overlap.domino.backward import UnitBackward
from megadomino.overlap.domino.units import Pending, Unit, WgradSink, domino_linear, leaf


class DominoRunner(UnitBackward):
    """Runs `block.layers` through the Domino schedule (the final norm stays with the block).
    Its forward does not call the layers' modules, so their forward hooks do not run
    (`bypasses_layer_hooks`: ZeRO-3, which gathers a layer in its hook, refuses it)."""

    bypasses_layer_hooks = True

    def __init__(self, block, plan: DominoPlan, capture_mode: bool = False):
        self.block, self.plan, self.capture_mode = block, plan, capture_mode
        self.config, self.dims = block.config, block.dims
        self.parallel = block.parallel
        self.sp = self.parallel.sequence_parallel and self.dims.tp > 1
        self._action_lists: dict[tuple, list[Action]] = {}
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
        params = [p for p in self.block.layers.parameters() if p.requires_grad] \
            if self.capture_mode else []
        return _DominoBlock.apply(x, anchor, self, rotary, *params)

    # ---- helpers -------------------------------------------------------------------------
    def _actions(self, pass_: str, *key) -> list[Action]:
        """forward_actions(layers, slices, K) ("F") or backward_actions(layers, slices,
        recomputed) ("B"): pure functions of their key, so each list is made once and kept."""
        if (pass_, key) not in self._action_lists:
            make = forward_actions if pass_ == "F" else backward_actions
            self._action_lists[pass_, key] = make(*key)
        return self._action_lists[pass_, key]

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
        """A unit's input: the whole sequence (all-gathered under sequence parallelism); the
        caller detaches it into a leaf where it builds a graph."""
        return all_gather_dim0(t.detach(), self.dims.tp_group)[0] if self.sp else t

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

    def links(self) -> bool:
        """Whether a reduced output enters the next unit's graph as the partial tensor itself
        rather than as a detached leaf, so that one `autograd.grad` call runs back through both
        units (glue_mid with attention; the next glue_in, or glue_out, with mlp). True without
        sequence parallelism: the all-reduce runs in place on the partial's storage (m of K
        chunks is their sum, taken in the graph in Pending's order) and its backward is the
        identity, so values and gradients equal the leaf path's bit for bit. Under SP the
        reduce-scatter makes a new tensor whose backward is an all-gather: leaves there."""
        return not self.sp

    def _linear(self, x, linear, dim=None, start=0, length=None, bias=True):
        """The layer pieces' LocalLinear: a GEMM whose weight gradient is deferred to the
        current sink (units.domino_linear)."""
        return domino_linear(self.sinks[-1], x, linear.weight, linear.bias if bias else None,
                             dim, start, length)

    # ---- the units -----------------------------------------------------------------------
    def _glue_in(self, index: int, unit: Unit, build: bool) -> None:
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

    def _attention(self, index: int, unit: Unit, rotary, pending: Pending, build: bool):
        u_full = self._gather(unit.u)
        unit.u_leaf = leaf(u_full) if build else u_full
        unit.a = self.block.layers[index].self_attention.partial(unit.u_leaf, rotary,
                                                                  self._linear)
        self._reduce(unit.a, pending)

    def _glue_mid(self, index: int, unit: Unit, reduced_a: torch.Tensor, build: bool) -> None:
        layer = self.block.layers[index]
        unit.x_leaf = leaf(unit.x) if build else unit.x
        unit.a_linked = build and self.links()
        if unit.a_linked:  # reduced_a is a's own storage, reduced in place
            a_in = unit.a
        else:
            a_in = unit.a_leaf = leaf(reduced_a) if build else reduced_a
        unit.h = layer.residual(unit.x_leaf, a_in, layer.attention_bias)
        unit.v = layer.pre_mlp_layernorm(unit.h)

    def _mlp(self, index: int, unit: Unit, pending: Pending | None, build: bool) -> None:
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
        units = [[Unit() for _ in range(n_slices)] for _ in range(n_layers)]
        inputs = [[x.narrow(1, s, n).contiguous()] for s, n in zip(starts, sizes)]
        pending: dict[tuple, Pending] = {}
        outputs, out_leaves = [None] * n_slices, [None] * n_slices
        last = self.block.layers[-1]
        built = [build and not self._recomputed(index) for index in range(n_layers)] + [build]
        dropout, m_linked = self._has_dropout(), [False] * n_slices
        for action in self._actions("F", n_layers, n_slices, self.plan.hidden_slices):
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
                        units[index][i] = Unit(inputs=unit.inputs, rng=unit.rng)
                else:
                    raise AssertionError(f"forward action {action}")
        output = torch.cat([o.detach() for o in outputs], dim=1) if build else \
            torch.cat(outputs, dim=1)
        return output, units, (outputs, out_leaves, rotaries)

    def _has_dropout(self) -> bool:
        return self.config.hidden_dropout > 0 or self.config.attention_dropout > 0

    def _rebuild(self, index: int, layer_units: list[Unit], rotaries: list) -> None:
        """Recompute one layer's graphs (all slices) from the kept glue_in inputs: the layer's
        forward actions again, each unit's generator states restored, no reduce of m (the
        next layer's input is not needed again)."""
        current = self._rng_capture() if self._has_dropout() else None
        pending: dict[tuple, Pending] = {}
        for action in self._actions("F", len(self.block.layers), len(layer_units),
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


class _DominoBlock(torch.autograd.Function):
    """The whole layer stack as one autograd node whose backward is DominoRunner.backward.
    `params`: none (eager mode: each layer's gradients go to autograd through its flush anchor),
    or the layers' parameters that require a gradient (capture mode: the backward returns
    their sums)."""

    @staticmethod
    def forward(ctx, x, anchor, runner: DominoRunner, rotary, *params):
        sink = WgradSink(runner.plan.batch_slices > 1)
        runner.sinks.append(sink)
        try:
            with torch.enable_grad():
                output, units, outs = runner._forward(x, rotary, build=True)
                flush_anchors = [None if params else sink.anchor(list(layer.parameters()))
                                 for layer in runner.block.layers]
        finally:
            runner.sinks.pop()
        ctx.runner, ctx.state, ctx.params = runner, (units, outs, sink, flush_anchors), params
        return output

    @staticmethod
    def backward(ctx, grad_output):
        runner, state, params = ctx.runner, ctx.state, ctx.params
        ctx.state = ctx.params = None
        runner.sinks.append(state[2])
        try:
            grad_x = runner.backward(state, grad_output.contiguous())
        finally:
            runner.sinks.pop()
        return grad_x, None, None, None, *state[2].take(params)
