"""The pieces Domino's schedule is built from: deferred weight-gradient linears, the sink that
sums their gradients per parameter, and async reductions waited on demand (schedule.py).

A unit's linears run through `_DominoLinear`: its backward returns only the input gradient and
queues the weight-gradient GEMM on the active `WgradSink`, which the schedule runs right after it
launches the unit's input-gradient collective, so the GEMMs overlap it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class WgradSink:
    """Deferred weight-gradient GEMMs and the per-parameter accumulators of one backward.

    With several batch slices a parameter's gradient is a sum over slices, accumulated in fp32
    and rounded once; with one slice every element gets exactly one contribution (hidden slices
    own disjoint rows/columns), accumulated in the parameter's dtype at no conversion cost."""

    def __init__(self, sums_slices: bool):
        self.deferred: list = []
        self.acc: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self.sums_slices = sums_slices

    def add(self, param, grad: torch.Tensor, dim: int | None = None, start: int = 0) -> None:
        entry = self.acc.get(id(param))
        if entry is None and dim is None and not self.sums_slices and grad.dtype == param.dtype:
            self.acc[id(param)] = (param, grad)  # the one contribution: keep it as it is
            return
        if entry is None:
            dtype = torch.float32 if self.sums_slices else param.dtype
            entry = (param, torch.zeros(param.shape, dtype=dtype, device=grad.device))
            self.acc[id(param)] = entry
        target = entry[1] if dim is None else entry[1].narrow(dim, start, grad.shape[dim])
        target.add_(grad)

    def run_deferred(self) -> None:
        for work in self.deferred:
            work()
        self.deferred.clear()

    def flush(self, params) -> None:
        """Hand the summed gradients of `params` to autograd (one accumulation each)."""
        ready = [self.acc.pop(id(p)) for p in params if id(p) in self.acc]
        if ready:
            torch.autograd.backward([p for p, _ in ready],
                                    [g.to(p.dtype) for p, g in ready])


class _DominoLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns only the input gradient and queues the weight (and
    bias) gradient GEMMs on the sink, to be run after the unit's collective was launched.
    `weight` / `bias` are detached views of `param` rows/columns starting at `start` on `dim`."""

    @staticmethod
    def forward(ctx, sink, x, weight, bias, param, dim, start, bias_param):
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.dim, ctx.start, ctx.bias_param = param, dim, start, bias_param
        ctx.sink = sink
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # a strided 3-D grad would make matmul batch over s
        grad_x = grad_out.matmul(weight)
        sink, param, dim, start, bias_param = ctx.sink, ctx.param, ctx.dim, ctx.start, \
            ctx.bias_param

        def weight_grads():
            grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
            sink.add(param, grad_2d.t().matmul(x.reshape(-1, x.shape[-1])), dim, start)
            if bias_param is not None:
                sink.add(bias_param, grad_2d.sum(0, dtype=torch.float32), 0, start)

        sink.deferred.append(weight_grads)
        return None, grad_x, None, None, None, None, None, None


def domino_linear(sink: WgradSink, x, param, bias_param=None, dim: int | None = None,
                  start: int = 0, length: int | None = None):
    """x @ param^T (+ bias) whose weight-gradient GEMMs queue on `sink` (the runner's current
    one: a forward re-run inside backward, for recompute, queues on the backward's)."""
    weight, bias = param.detach(), None if bias_param is None else bias_param.detach()
    if dim is not None:
        weight = weight.narrow(dim, start, length)
        if bias is not None:
            bias = bias.narrow(0, start, length)
    return _DominoLinear.apply(sink, x, weight, bias, param, dim, start, bias_param)


class Pending:
    """Partial tensors whose reduction was launched async; wait() returns their sum."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.handles: list = []

    def add(self, tensor: torch.Tensor, handle) -> None:
        self.parts.append(tensor)
        self.handles.append(handle)

    def wait(self) -> torch.Tensor:
        for handle in self.handles:
            if handle is not None:
                handle.wait()
        total = self.parts[0]
        for part in self.parts[1:]:
            total = total + part
        return total


def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_()
