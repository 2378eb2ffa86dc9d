"""CUDA graphs for the decoder's layer stack (`--enable-cuda-graph`).

The layers' forward and backward of one micro-batch are captured once, at start-up (`capture`,
what `torch.cuda.make_graphed_callables` does, with the RNG streams registered), and replayed
every micro-batch after: one graph launch instead of hundreds of kernel and collective launches,
so the step's time is the GPU's, not the host's. This is what makes the fused GEMM +
communication path (`--sequence-parallel --tp-comm-overlap`, whose per-chunk pipelining is
host-heavy) pay: BENCHMARKS.md.

What is captured: the transformer layers only (not the embedding, final norm, output layer or
loss), forward and backward, tensor-parallel collectives included (NCCL and symmetric-memory ops
are capturable; they are first run eagerly by the warm-up, which sets up communicators and
symmetric-memory buffers). The layer inputs (hidden states, rotary tables) are copied into the
graph's static buffers on each call; the parameters are read in place, so optimizer updates are
seen - as long as nothing re-points a parameter's storage after the capture (the training loop
captures after the gradient buffer or ZeRO stage 1 engine, which flattens parameters, is built).
Parameter gradients come out of the backward graph and are accumulated by autograd outside it,
so gradient hooks (the DP gradient buffer, ZeRO stage 1) run as usual - but on the capture's
side stream (the captured autograd graph keeps the parameters' AccumulateGrad nodes made there),
while the embedding's run on the main stream: the hooks join the streams a bucket's gradients
came from before its DP reduction is enqueued (`distributed.streams`; without that join, TP 2 x
DP 2 drifted from eager training by 1e-4 relative, scripts/debug/cuda_graph_dp_drift.py).

Dropout is captured: the default generator and the TP RNG tracker's streams (which its fork
swaps in graph-safely, `distributed.random`) are registered with the graphs, so each replay draws
new masks and advances every stream as an eager micro-batch would.

FP8 linears (`--fp8-format`) are captured with their casts, amaxes and delayed-scaling steps
(all device-side); their weights are cast at every replay (FP8State.cache_weight off: the cached
cast is the host's decision, which replays skip), and their scaling buffers are put back after the
warm-up and capture, so the first replay starts from the state an eager step would (a resumed
one's included).

Domino slicing (`--domino-*`): what is captured is Domino's schedule over the layers, its async
TP collectives and waits included, run by a DominoRunner in capture mode
(overlap/domino/schedule.py): there the schedule's autograd node takes the layers' parameters as
inputs and returns their slice-summed gradients from its backward, where the eager runner hands
them to autograd layer by layer from nested backward calls (invisible to the one `autograd.grad`
that `capture` records, and accumulating into `.grad` inside the graph's memory). Same values
and gradients, bit for bit; a replay is one graph launch for the whole sliced stack, so slicing
is no longer host-bound. The eager Domino runner stays the fallback.

Limits, refused up front by the validator (megadomino.config.validate) with the flag named: no
activation recompute (it saves and restores RNG states by copying them on the host; Domino's
full recompute is refused alike), no ZeRO stage 3 (its per-layer gather hooks run on the host),
no `--domino-batch-slices auto` (its start-up timing runs the plans eagerly), no
`--fp8-param-gather` (the host hands each step's gathered codes to the linears).

Shapes are static: a call whose input shape differs from the captured one (or in eval mode /
without grad) runs the layers eagerly through the block's previous runner, same math.
Memory: the graphs keep one micro-batch's activations in a private pool, about what an eager
step holds at its peak.
"""

from __future__ import annotations

import torch
from torch import nn

from megadomino.config import ConfigError
from megadomino.distributed import random as tp_random
from megadomino.overlap.domino.schedule import DominoRunner
from megadomino.tp.fp8 import fp8_states


class _LayerStack(nn.Module):
    """The block's layers as one module (the callable that is captured; its parameters are the
    ones `capture` differentiates): the layers in order, or `runner(x, rotary)` when given (a
    DominoRunner in capture mode, whose autograd node takes these parameters)."""

    def __init__(self, layers: nn.ModuleList, runner: DominoRunner | None = None):
        super().__init__()
        self.layers = layers
        self.runner = runner

    def forward(self, x: torch.Tensor, *rotary: torch.Tensor) -> torch.Tensor:
        if self.runner is not None:
            return self.runner(x, rotary or None)
        for layer in self.layers:
            x = layer(x, rotary or None)
        return x


def layer_stack(block) -> _LayerStack:
    """What capture_layers captures for `block`: Domino's schedule in capture mode when the
    block's runner is a DominoRunner (its plan), else the layers in order."""
    runner = block.runner
    if not isinstance(runner, DominoRunner):
        return _LayerStack(block.layers)
    return _LayerStack(block.layers, DominoRunner(block, runner.plan, capture_mode=True))


class _Replay(torch.autograd.Function):
    """Replays a captured forward and backward: copies the inputs (and later the output
    gradients) into the graphs' static buffers unless they already are them, replays, and
    returns the static outputs (and input and parameter gradients) detached."""

    @staticmethod
    def forward(ctx, captured: _Captured, *args: torch.Tensor):
        for static, arg in zip(captured.inputs, args):
            if static.data_ptr() != arg.data_ptr():
                static.copy_(arg)
        captured.forward_graph.replay()
        ctx.captured = captured
        return tuple(out.detach() for out in captured.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        captured = ctx.captured
        for static, grad in zip(captured.grad_outputs, grads):
            if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        captured.backward_graph.replay()
        return (None, *(None if grad is None else grad.detach() for grad in captured.grads))


class _Captured:
    """The static buffers and graphs of one captured callable (capture())."""

    def __init__(self, module: nn.Module, sample: tuple[torch.Tensor, ...], warmup: int,
                 generators: list[torch.Generator], buffers: list[torch.Tensor]):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.inputs = sample
        wrt = [t for t in (*sample, *self.params) if t.requires_grad]
        streams = [torch.cuda.default_generators[torch.cuda.current_device()], *generators]
        states = [generator.get_state() for generator in streams]
        saved = [buffer.clone() for buffer in buffers]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy initialisation, autotuning, communicators
            for _ in range(warmup):
                outputs = _as_tuple(module(*sample))
                torch.autograd.grad([o for o in outputs if o.requires_grad], wrt,
                                    [torch.empty_like(o) for o in outputs if o.requires_grad],
                                    allow_unused=True)
                del outputs
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        for graph in (self.forward_graph, self.backward_graph):
            for generator in generators:
                graph.register_generator_state(generator)
        with torch.cuda.graph(self.forward_graph, pool=pool):
            self.outputs = _as_tuple(module(*sample))
        self.grad_outputs = [torch.empty_like(o) if o.requires_grad else None
                             for o in self.outputs]
        with torch.cuda.graph(self.backward_graph, pool=pool):
            grads = iter(torch.autograd.grad(
                [o for o in self.outputs if o.requires_grad], wrt,
                [g for g in self.grad_outputs if g is not None], allow_unused=True))
        self.grads = [next(grads) if t.requires_grad else None for t in (*sample, *self.params)]
        for generator, state in zip(streams, states):  # warm-up and capture draw nothing
            generator.set_state(state)
        for buffer, value in zip(buffers, saved):  # nor advance any state, in place
            buffer.copy_(value)


def _as_tuple(value) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def capture(module: nn.Module, sample: tuple[torch.Tensor, ...], warmup: int = 3,
            generators: list[torch.Generator] = (), buffers: list[torch.Tensor] = ()):
    """`module`'s forward on tensors shaped like `sample` and its backward (gradients of the
    inputs that require one and of every trainable parameter), captured in two CUDA graphs that
    share one memory pool; returns a function of the same arguments that replays them under
    autograd, with the parameters' gradients accumulated by autograd outside the graphs (so
    gradient hooks run as usual). What torch.cuda.make_graphed_callables does for one callable,
    plus `generators`: CUDA generators besides the default one that the module draws from (the
    TP RNG tracker's streams, swapped in graph-safely by its fork), registered with both graphs
    so that dropout replays advance them as eager calls would. `warmup` eager forward and
    backward calls run first on a side stream (gradients discarded); the generators are put back
where they were, so a graphed run draws the masks an eager one draws. `buffers`: state the
    module's training forward advances (FP8 linears' scaling buffers), put back in place after
    the warm-up and capture alike (the graphs keep their addresses)."""
    captured = _Captured(module, tuple(sample), warmup, list(generators), list(buffers))

    def replay(*args: torch.Tensor):
        outputs = _Replay.apply(captured, *args, *captured.params)
        return outputs[0] if len(outputs) == 1 else outputs

    return replay


class GraphedLayers:
    """A captured layer stack: call it like the layers (x, *rotary) -> x; `matches(x, rotary)`
    says whether a call has the captured shapes (else the caller runs the layers eagerly).
    `still_valid()` says whether memory the graphs point at outside their own pool is still the
    memory seen at capture (the symmetric-memory workspace of --tp-comm-overlap); a call after
    it changed raises instead of replaying into freed memory."""

    def __init__(self, stack: nn.Module, sample: tuple[torch.Tensor, ...],
                 still_valid=lambda: True):
        self._stack = stack
        self._shapes = [(t.shape, t.dtype, t.device) for t in sample]
        self._still_valid = still_valid

    def matches(self, args: tuple[torch.Tensor, ...]) -> bool:
        return len(args) == len(self._shapes) and all(
            (t.shape, t.dtype, t.device) == shape for t, shape in zip(args, self._shapes))

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        if not self._still_valid():
            raise RuntimeError(
                "--enable-cuda-graph: the symmetric-memory workspace of --tp-comm-overlap was "
                "re-allocated after the layers were captured (an eager fused op needed a larger "
                "one), so the graphs would use freed memory; the capture sizes it for the "
                "layers' shapes: report the shapes that grew it")
        return self._stack(*args)


class GraphedRunner:
    """The block's runner once its layers are captured: the graphs for training micro-batches of
    the captured shapes; anything else (eval, no grad, another shape) runs through `fallback`,
    the runner the block had before (None: the layers in order), with the same math."""

    def __init__(self, block, graphed: GraphedLayers, fallback=None):
        self.block, self.graphed, self.fallback = block, graphed, fallback

    def __call__(self, x: torch.Tensor, rotary) -> torch.Tensor:
        args = (x, *rotary) if rotary is not None else (x,)
        if self.block.training and torch.is_grad_enabled() and self.graphed.matches(args):
            return self.graphed(*args)
        return self.block.run(x, rotary) if self.fallback is None else self.fallback(x, rotary)


def _workspace_guard(model):
    """still_valid() for GraphedLayers: with fused SP communication, the TP group's
    symmetric-memory workspace (a torch-internal table; no guard where it is absent) must stay
    the tensor the capture used, since the graphs hold its address."""
    dims = model.dims
    if not (model.parallel.tp_comm_overlap and model.sequence_parallel and dims.tp > 1):
        return lambda: True
    from torch.distributed import _symmetric_memory as symm_mem
    table = getattr(symm_mem, "_group_name_to_workspace_tensor", None)
    if not isinstance(table, dict):
        return lambda: True
    name = dims.tp_group.group_name
    captured = table.get(name)
    return lambda: table.get(name) is captured


def capture_layers(model, micro_batch_size: int, warmup: int = 3, log=print) -> GraphedLayers:
    """Capture `model.decoder`'s layers (forward + backward of one training micro-batch of
    `micro_batch_size` x seq_length) and make them the decoder's runner (GraphedRunner).
    Collective over the tensor-parallel group (warm-up and capture run its collectives): every
    rank calls it at the same point. Gradients the warm-up computed are not kept (autograd.grad,
    no accumulation)."""
    block, config, dims = model.decoder, model.config, model.dims
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ConfigError(f"--enable-cuda-graph needs the model on a CUDA device, got {device}: "
                          "drop the flag on CPU")
    dtype = next(block.parameters()).dtype
    seq = config.seq_length // dims.tp if model.sequence_parallel else config.seq_length
    gen = torch.Generator(device=device).manual_seed(4321)
    x = torch.randn(seq, micro_batch_size, config.hidden_size, device=device, dtype=dtype,
                    generator=gen).requires_grad_()
    rotary = model.rotary(config.seq_length, None, device)
    sample = (x, *rotary) if rotary is not None else (x,)
    stack = layer_stack(block)
    stack.train(block.training)
    states = list(fp8_states(stack).values())
    for state in states:  # the replays run none of the host's checks (tp/fp8.py)
        state.cache_weight = False
    torch.cuda.synchronize(device)
    graphed = capture(stack, sample, warmup, tp_random.tracker_of(dims).generators(),
                      [buffer for state in states for buffer in state.buffers()])
    torch.cuda.synchronize(device)
    layers = GraphedLayers(graphed, sample, _workspace_guard(model))
    block.runner = GraphedRunner(block, layers, block.runner)
    if dims.rank == 0:
        how = "" if stack.runner is None else \
            f" through Domino's schedule ({stack.runner.plan.batch_slices} x " \
            f"{stack.runner.plan.hidden_slices})"
        log(f"cuda graph: captured {len(block.layers)} layers{how}, forward + backward of a "
            f"({seq}, {micro_batch_size}, {config.hidden_size}) micro-batch")
    return layers


def release_layers(model) -> None:
    """Undo capture_layers at the end of a run: the decoder gets back the runner it had before,
    and the graphs and their memory pool are freed now, while the process group whose
    collectives they captured still exists. A graph holding NCCL kernels that outlives its
    communicator (the runner and its block form a reference cycle, so without this the graphs
    were freed at interpreter exit, after destroy_process_group) hung the process at exit.
    No-op when the layers were not captured."""
    block = model.decoder
    if isinstance(block.runner, GraphedRunner):
        torch.cuda.synchronize()
        block.runner = block.runner.fallback
        torch.cuda.synchronize()
