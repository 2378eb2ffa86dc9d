"""An emulated link latency for experiments (--pipeline-link-delay): a transport that delays every
received message. The kernels here have no netem, so tc cannot add latency to a link
(shared/NETWORK.md); the harness adds it where the message is used instead.

The rule (`delayed_wait`, which the start-up measurement's latency probes follow too): a
receive's wait returns `delay` seconds after the underlying wait returned. It is an emulation,
and an upper bound on what a real latency costs: a real message that arrived while the stage
was computing would be ready at once, while here its wait still takes `delay`; a send is not
delayed. The transfer itself (bytes over the rate-limited link) is real.
"""

from __future__ import annotations

import time

import torch

from megadomino.pipeline.transport_protocol import Handle, Transport


def delayed_wait(handle: Handle, delay: float) -> object:
    """Wait `handle`, then `delay` seconds more (module docstring)."""
    result = handle.wait()
    if delay > 0:
        time.sleep(delay)
    return result


class _Delayed:
    def __init__(self, handle: Handle, delay: float):
        self.handle, self.delay = handle, delay

    def wait(self) -> object:
        return delayed_wait(self.handle, self.delay)


class DelayedTransport:
    """`inner` with every receive's wait delayed by `delay` seconds (module docstring)."""

    def __init__(self, inner: Transport, delay: float):
        if delay < 0:
            raise ValueError(f"delay {delay}: seconds >= 0")
        self.inner, self.delay = inner, delay

    def send_activation(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        return self.inner.send_activation(tensor, micro, chunk)

    def recv_activation(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        handle, buffer = self.inner.recv_activation(micro, chunk)
        return _Delayed(handle, self.delay), buffer

    def send_grad(self, tensor: torch.Tensor, micro: int, chunk: int) -> Handle:
        return self.inner.send_grad(tensor, micro, chunk)

    def recv_grad(self, micro: int, chunk: int) -> tuple[Handle, torch.Tensor]:
        handle, buffer = self.inner.recv_grad(micro, chunk)
        return _Delayed(handle, self.delay), buffer

    def flush(self) -> None:
        self.inner.flush()
