"""Domino's explicit backward: `backward_actions` run one at a time over the units the forward
built (schedule.py), each compute action one `torch.autograd.grad` call.

Calls. A unit's graph starts at detached leaves, so autograd's node order cannot move work
across a collective. Where no collective separates two units in the backward (without sequence
parallelism, `DominoRunner.links`), the forward fed the partial output itself into the next
unit's graph, and one call runs back through both: glue_mid with attention, and the next
layer's glue_in (or glue_out) with mlp - two calls per layer and slice, plus glue_in of layer 0.
Under sequence parallelism every unit is its own call (the reduce-scatter's backward, an
all-gather, sits between them).

Parameter gradients are summed over slices (WgradSink) and handed to autograd once per layer
(the `flush` action: a backward call from the layer's anchor, a node over its parameters made
in the forward), so gradient hooks (the DP gradient buffer) see one accumulation per parameter
per backward, layer by layer. In capture mode (schedule.py) a layer has no anchor: `flush` only
drops its units, and the block's node returns the sums when the whole backward is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadomino.overlap.domino.units import Pending, Unit, WgradSink


@dataclass
class _Pass:
    """The state of one backward pass over units[layer][slice]."""

    sink: WgradSink
    units: list
    outputs: list         # glue_out's output per slice
    out_leaves: list      # glue_out's (h, m) leaves per slice; m None when linked to the mlp
    grad_slices: list     # the block output's gradient per slice
    grad_h: list          # per slice: the gradient of the current layer's h
    grad_m: list          # per slice: the gradient of the current layer's reduced m (unlinked)
    grad_inputs: list     # per slice: the gradient of the block input
    pending: dict
    memo: dict


class UnitBackward:
    """The backward half of DominoRunner, which supplies block, _actions, _reduce,
    _output_grad, _rebuild and _recomputed."""

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

    def _reduce_grad(self, grad: torch.Tensor) -> Pending:
        pending = Pending()
        self._reduce(grad, pending)
        return pending

    def backward(self, state, grad_output: torch.Tensor) -> torch.Tensor:
        """Run backward_actions; returns the gradient of the block's input."""
        units, (outputs, out_leaves, rotaries), sink, anchors = state
        layers = self.block.layers
        n_layers, n_slices = len(layers), len(out_leaves)
        sizes = [o.shape[1] for o in outputs]
        run = _Pass(sink, units, outputs, out_leaves,
                    [g.contiguous() for g in grad_output.split(sizes, dim=1)],
                    [None] * n_slices, [None] * n_slices, [None] * n_slices, {}, {})
        recomputed = frozenset(i for i in range(n_layers) if self._recomputed(i))
        for action in self._actions("B", n_layers, n_slices, recomputed):
            index, i = action.layer, action.slice
            if action.op == "recompute":
                with torch.enable_grad():
                    self._rebuild(index, units[index], rotaries)
            elif action.op == "flush":
                sink.flush(anchors[index])
                units[index] = None
            elif action.op == "wait":
                units[index][i].grad_reduced = run.pending.pop((action.waits, index, i)).wait()
            elif action.op in ("glue_out", "glue_in", "mlp", "glue_mid", "attention"):
                getattr(self, f"_{action.op}_backward")(run, index, i)
            else:
                raise AssertionError(f"backward action {action}")
        return torch.cat(run.grad_inputs, dim=1)

    def _glue_out_backward(self, run: _Pass, index, i: int) -> None:
        if run.out_leaves[i][1] is None:  # m linked: runs with the last mlp (_mlp_backward)
            return
        run.grad_h[i], run.grad_m[i] = self._grad(
            run.sink, [run.outputs[i]], [run.grad_slices[i]], list(run.out_leaves[i]),
            self._glue_params(-1, "out", run.memo))

    def _glue_in_backward(self, run: _Pass, index: int, i: int) -> None:
        """Back through glue_in, given its reduced input gradient: the gradients of glue_in's
        inputs ((h, m) of the previous layer, or the block input)."""
        unit: Unit = run.units[index][i]
        if unit.in_linked:  # runs with the previous layer's mlp (_mlp_backward)
            return
        params = self._glue_params(index, "in", run.memo)
        if index == 0:  # x is the input leaf itself: its residual gradient passes straight on
            (grad_input,) = self._grad(run.sink, [unit.u], [unit.grad_reduced], unit.in_leaves,
                                       params)
            run.grad_inputs[i] = grad_input + unit.grad_x
            return
        run.grad_h[i], run.grad_m[i] = self._grad(
            run.sink, [unit.x, unit.u], [unit.grad_x, unit.grad_reduced], unit.in_leaves, params)

    def _mlp_backward(self, run: _Pass, index: int, i: int) -> None:
        """dv of mlp(index, i) - through the next glue_in or glue_out first when linked - its
        reduce launched, then the deferred weight-gradient GEMMs run under it."""
        unit: Unit = run.units[index][i]
        last = index + 1 == len(run.units)
        if not last and run.units[index + 1][i].in_linked:
            after = run.units[index + 1][i]
            run.grad_h[i], grad_v = self._grad(
                run.sink, [after.x, after.u], [after.grad_x, after.grad_reduced],
                [after.in_leaves[0], unit.v_leaf], self._glue_params(index + 1, "in", run.memo))
        elif last and run.out_leaves[i][1] is None:
            run.grad_h[i], grad_v = self._grad(
                run.sink, [run.outputs[i]], [run.grad_slices[i]],
                [run.out_leaves[i][0], unit.v_leaf], self._glue_params(-1, "out", run.memo))
        else:
            grad_m = self._output_grad(run.grad_m[i])
            (grad_v,) = self._grad(run.sink, unit.m_parts, [grad_m] * len(unit.m_parts),
                                   [unit.v_leaf], [])
        run.pending[("dv", index, i)] = self._reduce_grad(grad_v)
        run.sink.run_deferred()

    def _glue_mid_backward(self, run: _Pass, index: int, i: int) -> None:
        """Back through glue_mid - and attention's data-gradient GEMMs when linked."""
        unit: Unit = run.units[index][i]
        leaves = [unit.x_leaf, unit.u_leaf if unit.a_linked else unit.a_leaf]
        unit.grad_x, grad = self._grad(run.sink, [unit.h, unit.v],
                                       [run.grad_h[i], unit.grad_reduced], leaves,
                                       self._glue_params(index, "mid", run.memo))
        unit.grad_u, unit.grad_a = (grad, None) if unit.a_linked else (None, grad)

    def _attention_backward(self, run: _Pass, index: int, i: int) -> None:
        """du of attention(index, i), its reduce launched, then its weight-gradient GEMMs."""
        unit: Unit = run.units[index][i]
        grad_u = unit.grad_u
        if not unit.a_linked:
            (grad_u,) = self._grad(run.sink, [unit.a], [self._output_grad(unit.grad_a)],
                                   [unit.u_leaf], [])
        run.pending[("du", index, i)] = self._reduce_grad(grad_u)
        run.sink.run_deferred()
