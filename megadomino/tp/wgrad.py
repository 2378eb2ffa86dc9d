"""A backward split in two, for zero-bubble pipeline schedules (ZB-H1, ZBV): B computes the
stage's input gradient now; W computes the linears' weight gradients later, in a bubble.

    store = WeightGradStore(chunk)                   # one per model chunk, its executor's
    backward_input(output, grad_output, store, m)    # B of micro-batch m
    ...                                              # other micro-batches' F and B
    backward_weight(store, m)                        # W of micro-batch m

What is deferred: the weight gradient of every one of our linears (tp/layers.py's column- and
row-parallel, with and without sequence parallelism, and tp/fp8.py's FP8 linear), and the bias
gradient where it is summed inside the linear's own backward and W keeps the high-precision
output gradient anyway (the column-parallel linear's bias in its GEMM). While a store defers
(inside `WeightGradStore.defer`), such a backward computes the input gradient and its collective
(the all-reduce, or the reduce-scatter under sequence parallelism) and records a closure
over the operands the rest needs: the output gradient and the input (under sequence parallelism
this rank's chunk, re-gathered in W: the kept input stays 1/tp of the sequence), or the FP8
codes. Every other parameter (norms, embeddings, the biases added outside the GEMMs, the QKV bias
summed by the split's backward, the FP8 linear's bias) gets its gradient in B, as an unsplit
backward gives it: zero-bubble implementations defer only the GEMMs' weight gradients too.

How gradients reach the data-parallel engine: exactly as in an unsplit backward, through each
parameter's AccumulateGrad node. B hands autograd no gradient for a deferred parameter (its
AccumulateGrad still runs, and the engine's post-accumulate-grad hook sees `.grad` None: it
records nothing, zero/grads.py). W builds one small autograd node per recorded linear whose
edges are the linear's own edges to its parameters' AccumulateGrad, and runs them all in one
`torch.autograd.backward`: each node's backward runs the closure (the same `weight_grad` GEMM,
accumulating into the engine's fp32 `main_grad` under gradient-accumulation fusion and handing
autograd a placeholder, or the same FP8 GEMM) and returns the gradients to those edges. So
`.grad` accumulation, the layout contract, the stealing of a fresh gradient and every hook
(the engine's included) are autograd's own. Ordering: W's nodes run in the order B recorded them
(the order of the unsplit backward; each node's AccumulateGrad runs before the next node, as
autograd schedules AccumulateGrad first), so the hooks of the deferred parameters fire in the
unsplit backward's order among themselves; a parameter that two recorded linears share (a
weight used twice in one chunk) gets their sum once, added in that order, as autograd sums it.

Numerics: B and W run the GEMMs, casts and collectives of the unsplit backward on the same
operands, so one micro-batch's input and parameter gradients are bit-identical to an unsplit
backward's (fp32 on CPU, tests/test_wgrad.py). Over micro-batches, each parameter's accumulated
gradient is the same sum added in the order its micro-batches' W's (deferred parameters) or B's
(the rest) ran: bit-identical when W's run in B's order, else equal up to the reassociation of an
fp32 sum (within 1e-6 relative). A parameter with a gradient from both passes (a word embedding
tied to the output layer in one chunk) gets the B part first, then the W part: its sum over two
micro-batches is associated differently from the unsplit backward's (within 1e-6 relative).

The engine: run every B and W under its `no_sync()` and reduce after the last W
(`reduce_gradients()`), as the pipeline runs its backwards. A synced B would launch a unit's
reduction once the parameters B reports complete it, before W's gradients (a tied embedding's
second part) arrive; under `no_sync()` a parameter that reports in both passes (twice per
micro-batch) only accumulates.

A store lives as long as its chunk's executor wants it and owns no module-level state: its
parameters point to it weakly (`param.wgrad_store`), which is how a linear's backward, on
whatever thread autograd runs it, finds whether it defers (one attribute read and a check when
it does not). Refused up front (`check_split_backward`): Domino's schedule, the GEMM-fused TP
collectives (--tp-comm-overlap) and CUDA graphs, whose backwards compute weight gradients inside
their own kernels or graphs.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence

import torch
from torch import nn

from megadomino.config import ConfigError, ParallelConfig

Compute = Callable[[], tuple[torch.Tensor | None, ...]]


class WeightGradStore:
    """The deferred weight gradients of one model chunk, by key (the micro-batch).

    Invariants: a key is pending from the end of its B (`defer`) until its W (`run`), which runs
    once; a store defers one backward at a time; a parameter belongs to at most one live store.
    A W never run leaves its parameters' gradients (and fused main_grad buffers) untouched."""

    def __init__(self, module: nn.Module):
        self._params = set()
        for param in module.parameters():
            owner = getattr(param, "wgrad_store", None)
            if owner is not None and owner() not in (None, self):
                raise ValueError("a parameter of this module already belongs to another live "
                                 "WeightGradStore: one store per model chunk")
            param.wgrad_store = weakref.ref(self)
            self._params.add(id(param))
        self._pending: dict[Hashable, list[tuple[Compute, tuple]]] = {}
        self._recording: list[tuple[Compute, tuple]] | None = None

    @classmethod
    def of(cls, module: nn.Module) -> WeightGradStore:
        """The live store made for `module` (owning all its parameters), else a new one: one
        store per chunk, whoever asks first (the executor, a start-up timing pass)."""
        for param in module.parameters():
            ref = getattr(param, "wgrad_store", None)
            owner = ref() if ref is not None else None
            if owner is not None and all(id(p) in owner._params for p in module.parameters()):
                return owner
            break
        return cls(module)

    @contextlib.contextmanager
    def defer(self, key: Hashable) -> Iterator[None]:
        """Inside: every backward of our linears defers its weight gradients, recorded under
        `key` when the block ends without an error (B raised: nothing is kept)."""
        if self._recording is not None:
            raise RuntimeError("a WeightGradStore defers one backward at a time")
        if key in self._pending:
            raise RuntimeError(f"the weight gradients of {key!r} are still pending: run its W "
                               "(backward_weight) before its next B")
        self._recording = []
        try:
            yield
            self._pending[key] = self._recording
        finally:
            self._recording = None

    def owns(self, param: torch.Tensor) -> bool:
        """Whether `param` is this store's and the store is deferring now."""
        return self._recording is not None and id(param) in self._params

    def record(self, ctx, compute: Compute, inputs: Sequence[int]) -> None:
        """From a linear's backward (ctx: its node): `compute()` returns the gradients of its
        forward inputs `inputs` (None where not needed), which W hands to those inputs' edges.
        Every forward argument before them is a tensor (autograd keeps edges for tensor
        arguments only, so the index is also the edge's). An input that needs no gradient is
        left out; one that does must be a leaf parameter (its AccumulateGrad node), since B's
        autograd run frees every other node before W."""
        params = []
        for index in inputs:
            if not ctx.needs_input_grad[index]:
                params.append(None)
                continue
            node = ctx.next_functions[index][0]
            param = getattr(node, "variable", None)  # AccumulateGrad's leaf
            if param is None:
                raise RuntimeError(f"a split backward defers a linear's weight gradient onto a "
                                   f"leaf parameter; input {index} of {ctx.name()} comes from "
                                   f"{node.name()}")
            params.append(param)
        if any(param is not None for param in params):
            self._recording.append((compute, tuple(params)))

    def run(self, key: Hashable) -> None:
        """W of `key`: the recorded computations, in recording order, their gradients handed to
        the parameters' AccumulateGrad nodes by one autograd run (module docstring)."""
        records = self._pending.pop(key, None)
        if records is None:
            raise RuntimeError(f"no weight gradients of {key!r} are pending: its W ran already, "
                               "or no B deferred them")
        with torch.enable_grad():
            # the last created runs first: create the first record's node last
            roots = [_DeferredGrads.apply(compute, *(p for p in params if p is not None))
                     for compute, params in _masked(reversed(records))]
        records.clear()  # the nodes hold the closures now, each drops its own once it ran
        if roots:
            torch.autograd.backward(roots, [root.new_empty(0) for root in roots])

    def pending(self) -> list[Hashable]:
        """The keys whose W has not run, oldest B first."""
        return list(self._pending)


def _masked(records) -> Iterator[tuple[Compute, tuple]]:
    """Each record's closure reduced to the gradients of the parameters it has edges to."""
    for compute, params in records:
        keep = tuple(param is not None for param in params)
        if all(keep):
            yield compute, params
        else:
            yield (lambda c=compute, k=keep: tuple(g for g, kept in zip(c(), k) if kept)), params


class _DeferredGrads(torch.autograd.Function):
    """W's node for one linear: forward takes its parameters (so that the node's edges are their
    AccumulateGrad nodes, as the linear's were) and returns an empty tensor to start from;
    backward runs the deferred closure and returns its gradients to those edges."""

    @staticmethod
    def forward(ctx, compute: Compute, *params: torch.Tensor) -> torch.Tensor:
        ctx.compute = compute
        return params[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grads = ctx.compute()
        ctx.compute = None  # free the operands before the next node runs
        return (None, *grads)


def deferring_store(param: torch.Tensor) -> WeightGradStore | None:
    """The store that defers `param`'s gradient now, or None: the check every linear's backward
    makes (an attribute read when no store has the parameter)."""
    ref = getattr(param, "wgrad_store", None)
    store = ref() if ref is not None else None
    return store if store is not None and store.owns(param) else None


def defer_or_compute(ctx, param: torch.Tensor, compute: Callable[[], torch.Tensor],
                     index: int = 1) -> torch.Tensor | None:
    """A linear's weight gradient (forward input `index`, the parameter `param`): `compute()`
    now, or None with `compute` recorded for W when a store defers it."""
    store = deferring_store(param)
    if store is None:
        return compute()
    store.record(ctx, lambda: (compute(),), (index,))
    return None


def backward_input(outputs: torch.Tensor | Sequence[torch.Tensor],
                   grad_outputs: torch.Tensor | Sequence[torch.Tensor] | None,
                   store: WeightGradStore, key: Hashable) -> None:
    """B: `torch.autograd.backward(outputs, grad_outputs)` with the linears' weight gradients
    deferred into `store` under `key` (the micro-batch). Input gradients land where autograd
    puts them (the stage input's `.grad`), every other parameter's gradient too."""
    with store.defer(key):
        torch.autograd.backward(outputs, grad_tensors=grad_outputs)


def backward_weight(store: WeightGradStore, key: Hashable) -> None:
    """W: the weight gradients `backward_input` deferred under `key`; refused when there are
    none pending (run twice, or never deferred)."""
    store.run(key)


def check_split_backward(parallel: ParallelConfig, tp: int, requested_by: str) -> None:
    """Refuse, naming the flag, the ways of running the layers whose backward computes weight
    gradients inside its own kernels or graphs, which a split backward cannot defer.
    `requested_by`: the flag and value that asked for the split (e.g. "--pipeline-schedule
    zb-h1"), for the message."""
    plan = parallel.domino
    refused = {
        "--domino-batch-slices": plan.batch_slices > 1 or parallel.domino_auto,
        "--domino-hidden-slices": plan.hidden_slices > 1,
        "--domino-explicit-backward": plan.explicit_backward,
        "--tp-comm-overlap": parallel.tp_comm_overlap and parallel.sequence_parallel and tp > 1,
        "--enable-cuda-graph": parallel.enable_cuda_graph,
    }
    reasons = {"--tp-comm-overlap": "its GEMM-fused collectives compute weight gradients in "
               "their own backward", "--enable-cuda-graph": "the captured backward computes "
               "every gradient inside its graph"}
    for flag, on in refused.items():
        if on:
            why = reasons.get(flag, "Domino's schedule runs the weight-gradient GEMMs itself")
            raise ConfigError(f"{flag} is off with {requested_by}, which splits each backward "
                              f"into input- and weight-gradient passes: {why}; drop one of them")
