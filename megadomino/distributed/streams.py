"""Gradient hooks that run on several CUDA streams, joined before a collective reads their work.

Autograd runs a parameter's AccumulateGrad node (and so its post-accumulate-grad hook) on the
stream that was current when that node was created, and only syncs those "leaf streams" with
the caller at the very end of backward. Usually that is the one compute stream. It is not when
something keeps an AccumulateGrad node created on another stream alive:
`torch.cuda.make_graphed_callables` (`--enable-cuda-graph`) captures on a side stream and keeps
the captured autograd graph, so the hooks of the graphed layers' parameters run on that side
stream while the embedding's run on the main one. A bucket whose last gradient arrives on the
main stream must then not launch its reduction until the side stream's accumulations into the
same bucket are done: the stream of the last hook knows nothing of the others. (This was the
1e-4 drift of graphed training at TP 2 x DP 2.)

`HookStreams` remembers, per bucket, the streams its hooks ran on; `join(key)` makes the current
stream wait for the others before the collective is enqueued on it.

`weak_grad_hook` is how the gradient reducers register their per-parameter hooks: a
post-accumulate-grad hook is held by the parameter's C++ side, out of the garbage collector's
sight, so a hook holding its reducer strongly kept the reducer, and through it the parameters,
gradient buffers and shards, alive for good after the engine was dropped (1.8 GiB a ZeRO engine of
GPT-3 1.3B on 4 GPUs; all of a plain-DP model and its gradient buffer).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable

import torch


def weak_grad_hook(method: Callable, *leading) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook calling the bound `method(*leading, param)` while its object
    lives, and nothing once it is gone (see the module docstring)."""
    owner, function = weakref.ref(method.__self__), method.__func__

    def hook(param: torch.Tensor) -> None:
        obj = owner()
        if obj is not None:
            function(obj, *leading, param)
    return hook


class HookStreams:
    """Per-key record of the CUDA streams gradient hooks ran on (no-op for CPU tensors)."""

    def __init__(self):
        # key -> {raw cudaStream_t: torch.cuda.Stream}
        self._seen: dict[Hashable, dict[int, torch.cuda.Stream]] = {}

    def note(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Call in a hook, after its work on `tensor`'s device was enqueued. Cheap: it runs in
        every gradient hook (hundreds a step), so it reads the raw stream handle (as Triton's
        launcher does) and makes a Stream object only for a stream not seen under `key` yet."""
        if tensor.is_cuda:
            device = tensor.get_device()
            seen = self._seen.setdefault(key, {})
            raw = torch._C._cuda_getCurrentRawStream(device)
            if raw not in seen:
                seen[raw] = torch.cuda.current_stream(device)

    def join(self, key: Hashable) -> None:
        """Make the current stream wait for every other stream noted under `key`; forget them."""
        streams = self._seen.pop(key, None)
        if not streams:
            return
        device = next(iter(streams.values())).device
        current = torch.cuda.current_stream(device)
        for stream in streams.values():
            if stream.stream_id != current.stream_id:
                current.wait_stream(stream)

    def clear(self) -> None:
        self._seen.clear()
