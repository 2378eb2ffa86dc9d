"""The executor: runs one stage's action list (schedules.py) for one global batch.

For each action, in order and nothing else:
  recv / send      post the transport's asynchronous receive / send (transport_protocol.py;
                   a one-stage list has none, and its executor no transport)
  wait             block on the posted operation; a received activation becomes a leaf that
                   requires grad (its .grad is what the backward sends back); once an output's
                   send is waited, its storage is freed (`free_outputs`, Megatron's
                   deallocate_output_tensor): backward needs its autograd node, not its values
  forward          run chunk v's forward on micro-batch m (the received activation its
                   `decoder_input`); the activation input and the output are kept until that
                   micro-batch's backward (a sent output only as its autograd node: above).
                   On the last virtual stage the output is the micro-batch's loss
                   (`micro_batch_loss` of the chunk's per-token loss: the mask-weighted mean,
                   or with `token_scale` (per-token loss) the token sum times it); what is
                   kept for backward is loss / num_micro (per-token loss: the loss as is),
                   times the fp16 loss scale: gradients accumulate over the
                   micro-batches as Megatron's do, to the gradient of the step's loss. With the
                   caller's `backward` (PP 1: the data-parallel engine's, which applies the
                   loss scale itself) the scale is left to it
  backward         autograd's backward of the kept output with the received output gradient
                   (the engine called directly, as Megatron's custom_backward does: a freed
                   output's data no longer has the gradient's shape, its node's recorded shape
                   does); on the last virtual stage of the scaled loss (there, with the caller's
                   `backward`, that call instead); the input's gradient is kept for its send.
                   Where the list has the micro-batch's `weight` (a split backward,
                   schedules.SPLIT_BACKWARD), tp/wgrad.py's B: the linears' weight gradients
                   are deferred into the chunk's WeightGradStore
  weight           tp/wgrad.py's W: the weight gradients the micro-batch's B deferred

Local hand-off (the V placement, ZBV's: the last stage holds virtual stages P - 1 and P): where
the next virtual stage is this rank's other chunk, a forward's output becomes that chunk's input
at once (a leaf that requires grad, on the output's storage, which no send frees), and a
backward's input gradient that chunk's output gradient; the lists have no transfer there.

Parameter gradients accumulate wherever autograd puts them (`.grad`, or the data-parallel
engine's hooks); reducing them is the caller's (pipeline/runtime.py). Every kept tensor is
released once its last use has run, so an executor holds exactly the activations in flight.

Timeline (`run(..., timeline=[])`): each action is appended as (action, start, end), seconds of
`time.perf_counter()` around its handling (a compute's includes the flush of the posts before it,
a wait's the time blocked); what benchmarks/bench_pipeline.py derives each stage's idle time
from. Nothing is recorded without a list.

Emulated slowdown (`slowdown`, --emulate-slow-rank's factor on its rank): after each forward,
backward and weight action the executor waits (slowdown - 1) times as long as the action took
(on a GPU the stream is synchronized first, so the action's own time is what is stretched): a
slower device, deterministic, for experiments on uneven devices (benchmarks/
bench_placement_netns.sh).

Phase timers (`run(..., timers=...)`, train/timers.py's Timers): each forward action runs under the
phase `forward`, each backward and weight under `backward` and each wait under `wait`, the time
the stage is blocked on a transfer; the flush of posted transfers before an action is in none. On
a GPU the timers read CUDA events on the current stream, so a phase is the stream's time: a wait
on an NCCL transfer makes the stream wait (the host does not block), and the stream's stall is
what `wait` measures; no synchronization is added.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from megadomino.config.pipeline_split import holder, virtual_stage
from megadomino.pipeline.schedules import Action
from megadomino.pipeline.transport_protocol import Transport
from megadomino.tp.wgrad import WeightGradStore, backward_weight

MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # tokens, labels, loss_mask [b, s]
PhaseTimers = Callable[[str], contextlib.AbstractContextManager]
"""`timers(phase)` times what runs inside it under `phase` (train/timers.py's Timers)."""
COMPUTE = ("forward", "backward", "weight")
PHASES = {"forward": "forward", "backward": "backward", "weight": "backward", "wait": "wait"}
"""The actions timed, by the phase they are timed under (module docstring)."""


def micro_batch_loss(per_token: torch.Tensor, loss_mask: torch.Tensor,
                     token_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """A micro-batch's loss from the last chunk's per-token loss (b, s) (already times the
    mask): the mask-weighted mean, fp32 scalar; with `token_scale` (per-token loss: a token's
    weight in the step's loss) the token losses' sum times it."""
    if token_scale is not None:
        return per_token.sum() * token_scale
    # An all-zero mask (an SFT prompt filling the sequence) contributes 0, not 0 / 0.
    return per_token.sum() / loss_mask.sum().clamp(min=1.0)


class Executor:
    """Runs action lists on this rank's chunks (stage `stage` of `stages`) through
    `transport` (None: one stage, whose lists move nothing). `split_backward`: the lists may
    split backwards (a `weight` action), for which each chunk gets a WeightGradStore (its
    parameters point to it while it lives). `free_outputs` (the default): a sent output's
    storage is freed once its send was waited (module docstring); off, it is kept until its
    backward (what tests compare the freeing with). `placement`: where the chunks sit in the
    model (config/pipeline_split.py)."""

    def __init__(self, chunks: nn.ModuleList, transport: Transport | None, stage: int,
                 stages: int, split_backward: bool = False, slowdown: float = 1.0,
                 free_outputs: bool = True, placement: str = "loop"):
        self.chunks, self.transport, self.free_outputs = chunks, transport, free_outputs
        self.stage, self.stages, self.slowdown = stage, stages, slowdown
        self.placement = placement
        self.stores = [WeightGradStore.of(chunk) for chunk in chunks] if split_backward else None

    def _is_last(self, chunk: int) -> bool:
        last = self.stages * len(self.chunks) - 1
        return virtual_stage(self.stage, chunk, self.stages, self.placement) == last

    def _on_rank(self, chunk: int, step: int) -> int | None:
        """This rank's chunk holding the virtual stage `step` (+1 or -1) from `chunk`'s, or
        None where another stage holds it or the model ends (module docstring's hand-off)."""
        virtual = virtual_stage(self.stage, chunk, self.stages, self.placement) + step
        if not 0 <= virtual < self.stages * len(self.chunks):
            return None
        stage, local = holder(virtual, self.stages, self.placement)
        return local if stage == self.stage else None

    def run(self, actions: Sequence[Action], batches: Sequence[MicroBatch],
            loss_scale: float = 1.0, train: bool = True,
            token_scale: torch.Tensor | float | None = None,
            loss_weights: Sequence[float] | None = None,
            timeline: list[tuple[Action, float, float]] | None = None,
            timers: PhaseTimers | None = None,
            backward: Callable[[int, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Run `actions` on `batches` (one per micro-batch). Returns the losses of the
        micro-batches (detached fp32 scalars) on the last stage, [] elsewhere. `train` False:
        forwards only, without autograd (evaluation). `token_scale`: per-token loss, a token's
        weight (micro_batch_loss). `loss_weights`: each micro-batch's loss is multiplied by its
        weight (a batch-split stage's share of the micro-batch, runtime.py). `timeline`: a list
        to append each action's (action, start, end) to; `timers`: the phase timers of the
        forwards, backwards and waits (module docstring). `backward(micro, loss)`: runs the
        last chunk's backward of micro-batch `micro`'s kept loss, the loss scale its own."""
        state = _State(len(batches), loss_scale, train, token_scale, loss_weights, backward)
        state.split = {(a.micro, a.chunk or 0) for a in actions if a.op == "weight"}
        if state.split and self.stores is None:
            raise ValueError("this action list splits backwards (weight actions): build the "
                             "Executor with split_backward=True")
        with torch.enable_grad() if train else torch.no_grad():
            for action in actions:
                start = time.perf_counter() if timeline is not None else 0.0
                if self.transport is not None and action.op not in ("send", "recv"):
                    self.transport.flush()  # a step's posts go out together, before the rest
                timed = timers is not None and action.op in PHASES
                with timers(PHASES[action.op]) if timed else contextlib.nullcontext():
                    self._do_slowed(action, batches, state)
                if timeline is not None:
                    timeline.append((action, start, time.perf_counter()))
        if self.transport is not None:
            self.transport.flush()
        deferred = [store.pending() for store in self.stores or []]
        if state.pending or state.kept or any(deferred):
            raise RuntimeError(f"the action list left operations, tensors or weight gradients "
                               f"behind: {sorted(state.pending)} {sorted(state.kept)} "
                               f"{deferred}")
        return [state.losses[m] for m in sorted(state.losses)]

    def _do_slowed(self, action: Action, batches: Sequence[MicroBatch], state: _State) -> None:
        """`_do`, a compute action stretched by the emulated slowdown (module docstring)."""
        if self.slowdown <= 1 or action.op not in COMPUTE:
            self._do(action, batches, state)
            return
        start = time.perf_counter()
        self._do(action, batches, state)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        time.sleep((self.slowdown - 1) * (time.perf_counter() - start))

    def _do(self, action: Action, batches: Sequence[MicroBatch], state: _State) -> None:
        micro, chunk = action.micro, action.chunk or 0
        key = (action.pass_, micro, chunk)
        if action.op == "forward":
            x = state.kept.pop(("in", micro, chunk), None)
            tokens, labels, loss_mask = batches[micro]
            out = self.chunks[chunk](tokens, labels, loss_mask, decoder_input=x)
            if self._is_last(chunk):
                out = micro_batch_loss(out, loss_mask, state.token_scale)
                if state.loss_weights is not None:
                    out = out * state.loss_weights[micro]
                state.losses[micro] = out.detach().float()
                if state.train:
                    out = state.for_backward(out)
            following = self._on_rank(chunk, 1)
            if following is not None:  # the V's turn: the next chunk's input, on this rank
                state.kept[("in", micro, following)] = out.detach().requires_grad_(state.train)
            if state.train:
                state.kept[("x", micro, chunk)] = x
                state.kept[("out", micro, chunk)] = out
            elif not self._is_last(chunk) and following is None:
                state.kept[("out", micro, chunk)] = out
        elif action.op == "backward":
            self._backward(micro, chunk, state)
        elif action.op == "weight":
            backward_weight(self.stores[chunk], micro)
        elif action.op == "send":
            self._send(action, micro, chunk, state)
        elif action.op == "recv":
            receive = (self.transport.recv_activation if action.pass_ == "F"
                       else self.transport.recv_grad)
            state.pending[key + ("recv",)] = receive(micro, chunk)
        elif action.op == "wait":
            handle, tensor = state.pending.pop(key + (action.waits,))
            handle.wait()
            # (a send waited late, ZBV's, may find its output's backward run and the output gone)
            if action.waits == "send" and action.pass_ == "F" and state.train \
                    and self.free_outputs and ("out", micro, chunk) in state.kept:
                free_storage(state.kept[("out", micro, chunk)])
            if action.waits == "recv" and action.pass_ == "F":
                state.kept[("in", micro, chunk)] = tensor.requires_grad_(state.train)
            elif action.waits == "recv":
                state.kept[("dy", micro, chunk)] = tensor
        else:
            raise ValueError(f"unknown pipeline action {action}")

    def _backward(self, micro: int, chunk: int, state: _State) -> None:
        out = state.kept.pop(("out", micro, chunk))
        x = state.kept.pop(("x", micro, chunk))
        last = self._is_last(chunk)
        grad = None if last else state.kept.pop(("dy", micro, chunk))
        if last and state.backward is not None:
            state.backward(micro, out)
        elif (micro, chunk) in state.split:
            with self.stores[chunk].defer(micro):  # tp/wgrad.py's B (backward_input)
                backward_of(out, grad)
        else:
            backward_of(out, grad)
        if x is not None:
            before = self._on_rank(chunk, -1)
            key = ("dx", micro, chunk) if before is None else ("dy", micro, before)
            state.kept[key] = x.grad

    def _send(self, action: Action, micro: int, chunk: int, state: _State) -> None:
        if action.pass_ == "F":
            out = state.kept[("out", micro, chunk)] if state.train else state.kept.pop(
                ("out", micro, chunk))
            tensor = out.detach()
            handle = self.transport.send_activation(tensor, micro, chunk)
        else:
            tensor = state.kept.pop(("dx", micro, chunk))
            handle = self.transport.send_grad(tensor, micro, chunk)
        # The tensor stays referenced until its send is waited.
        state.pending[(action.pass_, micro, chunk, "send")] = (handle, tensor)


def free_storage(output: torch.Tensor) -> None:
    """Free a sent output's values, keeping its autograd node (Megatron's
    deallocate_output_tensor): its data becomes one element. A view is left alone (its base's
    storage is not its own to free); an output its own node saved for backward keeps the values
    there, so the backward is exact either way."""
    if output._base is None:
        output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def backward_of(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """`torch.autograd.backward(output, grad)` (None: of a scalar loss); with a gradient,
    through autograd's engine directly, as Megatron's custom_backward: the engine checks `grad`
    against the shape the output's node recorded, not against the output's data, which
    free_storage may have shrunk."""
    if grad is None:
        torch.autograd.backward(output)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True)


class _State:
    """One run's bookkeeping: posted operations, kept tensors, the losses (each micro-batch's
    times its weight)."""

    def __init__(self, num_micro: int, loss_scale: float, train: bool,
                 token_scale: torch.Tensor | float | None,
                 loss_weights: Sequence[float] | None,
                 backward: Callable[[int, torch.Tensor], None] | None):
        self.num_micro, self.loss_scale, self.train = num_micro, loss_scale, train
        self.token_scale, self.loss_weights, self.backward = token_scale, loss_weights, backward
        self.pending: dict[tuple, tuple] = {}
        self.kept: dict[tuple, torch.Tensor | None] = {}
        self.split: set[tuple[int, int]] = set()  # (micro, chunk) whose backward is split
        self.losses: dict[int, torch.Tensor] = {}

    def for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """What the last chunk backpropagates of a micro-batch's `loss`: its share of the
        step's loss (the mean's 1 / micro-batches; per-token loss: the loss as is), times the
        fp16 loss scale unless the caller's `backward` applies it."""
        if self.backward is not None:
            return loss if self.token_scale is not None else loss / self.num_micro
        return loss * (self.loss_scale if self.token_scale is not None
                       else self.loss_scale / self.num_micro)
