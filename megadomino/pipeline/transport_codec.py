"""The codec transport (--pipeline-codec): a pipeline `Transport` (transport_protocol.py) that
sends every activation and gradient through its link's codec (codec.py) over the P2P transport
beneath it. As transport_delay.py, a wrapper: the executor and the schedules see activations.

Links: boundary b joins stage b and b + 1 (mod the stage count, so that the interleaved
schedule's last-to-first hop is boundary P - 1); `settings[b]` is its codec, for the activation
going up and its gradient coming back. Both ends hold the same settings (the adaptive rate,
codec_rate.py, decides on rank 0, broadcasts, and calls `apply` at a step boundary on every
rank), so each receiver knows each message's size: a message is a flat uint8 buffer of
codec.message_bytes, received into a buffer of that size.

adatopk's exact backward: the sender of an activation keeps its kept indices by (micro-batch,
chunk) until that micro-batch's gradient arrives, the receiver keeps the decoded indices until
it sends that gradient; the gradient goes as values at those indices and is scattered back
there. A forward without backward (evaluation) leaves its indices behind, replaced by the next
step's of that (micro-batch, chunk).

Error feedback (--pipeline-codec-error-feedback): the sender adds to each message the error the
previous message of the same (pass, micro-batch, chunk) left, x + e -> encoded, e = x + e -
decoded. It compensates an error that repeats; consecutive steps carry other samples through
the same slot, so it is an approximation for samples that do not repeat (AQ-SGD keeps one
buffer per sample instead). The adatopk gradient at the kept indices has none: it is exact
for the masked function. `state_dict` holds the residuals (a resumed run continues exactly).

Evaluation (`evaluation()`: validation, and the forward that checks a checkpoint's weights)
neither reads nor renews the residuals and times no send: the codec state is the training
steps' alone, so that saving a checkpoint or evaluating leaves training as it would have been.

Timing (`timed`, for the adaptive rate): each send is timed from the flush that starts
it to its completion, by a watcher thread (gloo's point-to-point works report completion only
to a wait, and a work waited twice hangs, so the watcher is the one that waits it and the send's
handle waits the watcher; on CUDA the watcher polls the work, every millisecond, and the
executor's wait stays the stream's). `timings()` hands over (boundary, pass, bytes, seconds) of
the sends so far: the transfers' own times, no probe traffic.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch

from megadomino.pipeline.codec import Format, Setting, decode, encode, message_bytes
from megadomino.pipeline.transport_protocol import Handle

POLL = 0.001  # seconds between a CUDA send's completion checks


class _Received:
    """A receive's handle: the inner wait, then the decode into the activation-shaped `out`."""

    def __init__(self, handle: Handle, finish):
        self.handle, self.finish, self.done = handle, finish, False

    def wait(self) -> None:
        self.handle.wait()
        if not self.done:
            self.finish()
            self.done = True


class _Sent:
    """A send's handle, holding its message until waited. `owned`: the watcher waits the
    inner handle (a timed send on CPU) and this handle waits the watcher."""

    def __init__(self, handle: Handle, wire: torch.Tensor, owned: bool):
        self.handle, self.wire = handle, wire
        self.finished = threading.Event()
        self.owned = owned

    def wait(self) -> None:
        if self.owned:
            self.finished.wait()
        else:
            self.handle.wait()


class CodecTransport:
    """`inner` (a P2PTransport) with each boundary's codec. stage, stages: this rank's stage and
    the count; fmt: the activation's rows, width, dtype and adatopk's formats (codec.Format);
    settings: one per boundary; error_feedback, timed: the module docstring's."""

    def __init__(self, inner, stage: int, stages: int, shape: tuple[int, ...], fmt: Format,
                 settings: tuple[Setting, ...], error_feedback: bool = False,
                 timed: bool = False):
        self.inner, self.stage, self.stages, self.fmt = inner, stage, stages, fmt
        self.shape, self.error_feedback, self.timed = tuple(shape), error_feedback, timed
        self.settings = tuple(settings)
        self.sent_bytes: dict[tuple[str, int], int] = {}  # (pass, boundary) -> bytes sent
        self.residuals: dict[tuple[str, int, int], torch.Tensor] = {}
        self._sent_kept: dict[tuple[int, int], torch.Tensor] = {}
        self._received_kept: dict[tuple[int, int], torch.Tensor] = {}
        self._unflushed: list[tuple[_Sent, int, str, int]] = []
        self._timings: list[tuple[int, str, int, float]] = []
        self._lock = threading.Lock()
        self._watch: queue.Queue | None = None
        self._evaluating = False

    @contextlib.contextmanager
    def evaluation(self):
        """Inside: messages without error feedback, sends untimed (module docstring)."""
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False

    def apply(self, settings: tuple[Setting, ...]) -> None:
        """Take `settings` from the next message on (every rank at the same step boundary)."""
        self.settings = tuple(settings)

    def _up(self) -> int:
        return self.stage  # the boundary above this stage: its activations go over it

    def _down(self) -> int:
        return (self.stage - 1) % self.stages

    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        setting = self.settings[self._up()]
        if setting.codec == "none":
            return self._send(self.inner.send_activation(tensor, micro, chunk), tensor, "F",
                              self._up())
        wire, kept = self._encode(tensor, setting, "F", micro, chunk)
        if kept is not None and not self.fmt.grad_topk:
            self._sent_kept[(micro, chunk)] = kept
        return self._send(self.inner.send_activation(wire, micro, chunk), wire, "F", self._up())

    def recv_activation(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        setting = self.settings[self._down()]
        if setting.codec == "none":
            return self.inner.recv_activation(micro, chunk)
        handle, wire, out = self._receive(self.inner.recv_activation, setting, "F", micro, chunk)

        def finish() -> None:
            kept = decode(wire, setting, self.fmt, "F", out)
            if kept is not None and not self.fmt.grad_topk:
                self._received_kept[(micro, chunk)] = kept
        return _Received(handle, finish), out

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        setting = self.settings[self._down()]
        if setting.codec == "none":
            return self._send(self.inner.send_grad(tensor, micro, chunk), tensor, "B",
                              self._down())
        kept = None
        if setting.codec == "adatopk" and not self.fmt.grad_topk:
            kept = self._received_kept.pop((micro, chunk))
        wire, _ = self._encode(tensor, setting, "B", micro, chunk, kept)
        return self._send(self.inner.send_grad(wire, micro, chunk), wire, "B", self._down())

    def recv_grad(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        setting = self.settings[self._up()]
        if setting.codec == "none":
            return self.inner.recv_grad(micro, chunk)
        handle, wire, out = self._receive(self.inner.recv_grad, setting, "B", micro, chunk)

        def finish() -> None:  # at the wait: the forward's indices exist by then
            kept = None
            if setting.codec == "adatopk" and not self.fmt.grad_topk:
                kept = self._sent_kept.pop((micro, chunk))
            decode(wire, setting, self.fmt, "B", out, kept)
        return _Received(handle, finish), out

    def _receive(self, receive, setting: Setting, pass_: str, micro: int, chunk: int):
        """(handle, message buffer, decoded output) of a receive of pass `pass_` posted through
        the inner transport's `receive` into a message buffer of the setting's size."""
        wire = torch.empty(message_bytes(setting, self.fmt, pass_), dtype=torch.uint8,
                           device=self.inner.device)
        handle, _ = receive(micro, chunk, buffer=wire)
        return handle, wire, torch.empty(self.shape, dtype=self.fmt.dtype,
                                         device=self.inner.device)

    def _encode(self, tensor: torch.Tensor, setting: Setting, pass_: str, micro: int,
                chunk: int, kept: torch.Tensor | None = None):
        """The message of `tensor`; with error feedback the residual added first and renewed
        (not for the adatopk gradient at the kept indices: module docstring)."""
        feedback = self.error_feedback and kept is None and not self._evaluating
        key = (pass_, micro, chunk)
        if feedback and key in self.residuals:
            tensor = tensor + self.residuals[key]
        wire, kept_now = encode(tensor, setting, self.fmt, pass_, kept)
        if feedback:
            decoded = torch.empty_like(tensor)
            decode(wire, setting, self.fmt, pass_, decoded, kept)
            self.residuals[key] = tensor - decoded
        return wire, kept_now

    def _send(self, handle: Handle, wire: torch.Tensor, pass_: str, boundary: int) -> Handle:
        """`handle` of the send of `wire` (a message, or a `none` link's tensor), counted in
        `sent_bytes` and, `timed`, watched from the next flush."""
        nbytes = wire.numel() * wire.element_size()
        self.sent_bytes[(pass_, boundary)] = self.sent_bytes.get((pass_, boundary), 0) + nbytes
        timed = self.timed and not self._evaluating
        sent = _Sent(handle, wire, timed and not wire.is_cuda)
        if timed:
            self._unflushed.append((sent, boundary, pass_, nbytes))
        return sent

    def flush(self) -> None:
        self.inner.flush()
        if not self._unflushed:
            return
        if self._watch is None:
            self._watch = queue.Queue()
            threading.Thread(target=self._watcher, daemon=True).start()
        start = time.perf_counter()
        for sent, boundary, pass_, nbytes in self._unflushed:
            self._watch.put((sent, boundary, pass_, nbytes, start))
        self._unflushed = []

    def _watcher(self) -> None:
        """Waits (CPU) or polls (CUDA) each flushed send in order and records its time."""
        while True:
            sent, boundary, pass_, nbytes, start = self._watch.get()
            if sent.wire.is_cuda:
                while not sent.handle.done():
                    time.sleep(POLL)
            else:
                sent.handle.wait()
            with self._lock:
                self._timings.append((boundary, pass_, nbytes, time.perf_counter() - start))
            sent.finished.set()

    def timings(self) -> list[tuple[int, str, int, float]]:
        """The (boundary, pass, bytes, seconds) of the sends timed since the last call."""
        with self._lock:
            taken, self._timings = self._timings, []
        return taken

    def state_dict(self) -> dict:
        """The codec state that a resumed run needs beside the settings (codec_rate.py's):
        the error-feedback residuals and the send timings not yet handed over (`timings()`),
        which the next decision reads."""
        with self._lock:
            timings = list(self._timings)
        return {"residuals": {key: value.detach().cpu().clone()
                              for key, value in self.residuals.items()},
                "timings": timings}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {key: value.to(self.inner.device)
                          for key, value in state["residuals"].items()}
        with self._lock:
            self._timings = [tuple(timing) for timing in state["timings"]]
