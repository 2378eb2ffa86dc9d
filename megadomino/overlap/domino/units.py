"""The pieces Domino's schedule is built from: deferred weight-gradient linears, the sink that
sums their gradients per parameter, and async reductions waited on demand (schedule.py).

A unit's linears run through `_DominoLinear`: its backward returns only the input gradient and
queues the weight-gradient GEMM on the active `WgradSink`, which the schedule runs right after it
launches the unit's input-gradient collective, so the GEMMs overlap it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class WgradSink:
    """Deferred weight-gradient GEMMs and the per-parameter sums of one backward.

    With several batch slices a parameter's gradient is a sum over slices in fp32, rounded once.
    A whole parameter's contributions (one per slice) are kept as they come, up to two, and are
    summed when its layer is flushed (_slice_sum); from a third on they go into an fp32
    accumulator. A hidden chunk's contribution (rows/columns from `start` on `dim`) goes into a
    whole-parameter accumulator, in fp32 with several slices, else in the parameter's dtype
    (chunks own disjoint rows/columns: one contribution per element). Every sum equals the
    zero-started fp32 sum bit for bit, but for the sign of an exact zero that every slice gave
    as -0 (+0 + -0 is +0)."""

    def __init__(self, sums_slices: bool):
        self.deferred: list = []
        self.whole: dict[int, tuple[torch.nn.Parameter, list[torch.Tensor]]] = {}
        self.acc: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self.sums_slices = sums_slices

    def add(self, param, grad: torch.Tensor, dim: int | None = None, start: int = 0) -> None:
        if dim is None and id(param) not in self.acc:
            parts = self.whole.setdefault(id(param), (param, []))[1]
            if len(parts) < 2:
                parts.append(grad)
            else:  # a third slice: an fp32 accumulator from here on
                self.acc[id(param)] = (param, _fp32_sum([*self.whole.pop(id(param))[1], grad]))
            return
        entry = self.acc.get(id(param))
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

    def anchor(self, params: list) -> torch.Tensor | None:
        """An autograd node over `params` (made in the forward, with grad enabled) that `flush`
        runs back from; None when no parameter requires a gradient."""
        params = [p for p in params if p.requires_grad]
        return _FlushAnchor.apply(self, *params) if params else None

    def flush(self, anchor: torch.Tensor | None) -> None:
        """Hand the summed gradients of the anchor's parameters to autograd in one call: each
        gets one accumulation and one post-accumulate hook, and a sum no one else holds becomes
        .grad without a copy."""
        if anchor is not None:
            torch.autograd.backward(anchor, torch.empty_like(anchor))

    def take(self, params) -> list:
        """The summed gradient of each of `params` in its dtype (None if it got none), removed
        from the sink."""
        grads = []
        for p in params:
            if id(p) in self.whole:
                grads.append(_slice_sum(self.whole.pop(id(p))[1], p.dtype))
            elif id(p) in self.acc:
                grads.append(self.acc.pop(id(p))[1].to(p.dtype))
            else:
                grads.append(None)
        return grads


class _FlushAnchor(torch.autograd.Function):
    """A node whose inputs are a layer's parameters and whose backward returns their sums from
    the sink, so that autograd's own AccumulateGrad nodes (and the hooks on them) receive them."""

    @staticmethod
    def forward(ctx, sink: WgradSink, *params):
        ctx.sink, ctx.params = sink, params
        return torch.empty(0, device=params[0].device)

    @staticmethod
    def backward(ctx, _):
        return None, *ctx.sink.take(ctx.params)


def _slice_sum(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One or two slices' contributions summed into `dtype`: as they are, or by one add when
    they are of `dtype` (bf16/fp16 adds compute in fp32 and round once), else in fp32."""
    if all(part.dtype == dtype for part in parts):
        return parts[0] if len(parts) == 1 else torch.add(parts[0], parts[1])
    return _fp32_sum(parts).to(dtype)


def _fp32_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ... in fp32, in order (a new tensor when there are two or more)."""
    total = parts[0].to(torch.float32)
    if len(parts) > 1:
        total = total + parts[1]
    for part in parts[2:]:
        total.add_(part)
    return total


class _DominoLinear(torch.autograd.Function):
    """y = x W^T + b, W = `param`'s `length` rows/columns from `start` on `dim` (all of it when
    dim is None; b the same rows of `bias_param`), whose backward returns only the input
    gradient and queues the weight (and bias) gradient GEMMs on the sink, to be run after the
    unit's collective was launched. The parameters enter as themselves (no detached copies);
    their gradients from this node are None: the sink hands them over (WgradSink.flush)."""

    @staticmethod
    def forward(ctx, sink, x, param, bias_param, dim, start, length):
        ctx.save_for_backward(x, param)
        ctx.sink, ctx.bias_param, ctx.chunk = sink, bias_param, (dim, start, length)
        if dim is None:
            return F.linear(x, param, bias_param)
        bias = None if bias_param is None else bias_param.narrow(0, start, length)
        return F.linear(x, param.narrow(dim, start, length), bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, param = ctx.saved_tensors
        sink, bias_param, (dim, start, length) = ctx.sink, ctx.bias_param, ctx.chunk
        weight = param if dim is None else param.narrow(dim, start, length)
        grad_out = grad_out.contiguous()  # a strided 3-D grad would make matmul batch over s
        grad_x = grad_out.matmul(weight)

        def weight_grads():
            grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
            sink.add(param, grad_2d.t().matmul(x.reshape(-1, x.shape[-1])), dim, start)
            if bias_param is not None:
                sink.add(bias_param, grad_2d.sum(0, dtype=torch.float32),
                         None if dim is None else 0, start)

        sink.deferred.append(weight_grads)
        return None, grad_x, None, None, None, None, None


def domino_linear(sink: WgradSink, x, param, bias_param=None, dim: int | None = None,
                  start: int = 0, length: int | None = None):
    """x @ param^T (+ bias) whose weight-gradient GEMMs queue on `sink` (the runner's current
    one: a forward re-run inside backward, for recompute, queues on the backward's). A chunk
    `length` rows/columns from `start` on `dim`; the whole parameter when dim is None (or the
    chunk is all of it)."""
    if dim is not None and start == 0 and length == param.shape[dim]:
        dim = None
    return _DominoLinear.apply(sink, x, param, bias_param, dim, start, length)


class Pending:
    """Partial tensors whose reduction was launched async; wait() returns their sum."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.handles: list = []

    def add(self, tensor: torch.Tensor, handle) -> None:
        self.parts.append(tensor)
        self.handles.append(handle)

    def wait(self, parts: list | None = None) -> torch.Tensor:
        """The sum of the reduced parts, or of `parts` (the same tensors with their graphs:
        the all-reduce ran in place on their storage) in the same order."""
        for handle in self.handles:
            if handle is not None:
                handle.wait()
        parts = self.parts if parts is None else parts
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total


def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_()


@dataclass
class Unit:
    """The graphs of one (layer, slice) (schedule.py). Fields are filled as the schedule goes."""

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
