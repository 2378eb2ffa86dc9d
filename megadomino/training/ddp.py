"""Data-parallel gradients: fp32 `main_grad` buckets, accumulation hooks, overlapped all-reduce.

Every parameter that requires a gradient gets `param.main_grad`, an fp32 view into one contiguous
buffer. Parameters are laid out in reverse registration order (roughly the order backward produces
their gradients) and cut into buckets of about `bucket_numel` elements, Megatron-style.

A post-accumulate-grad hook adds `param.grad` (any dtype) into `main_grad` in fp32 and frees
`param.grad`, so micro-batch gradients accumulate in fp32 and the low-precision `.grad` lives only
briefly. Outside `no_sync()` (the last micro-batch of a step) a bucket whose parameters have all
reported is divided by the DP size and all-reduced over `dims.dp_group` with `async_op=True`,
while backward goes on with the layers below. `finish_grad_sync()` launches what is left (buckets
holding parameters that got no gradient), waits for every handle, then sums the gradients of
sequence-parallel parameters (`param.sequence_parallel = True`) over `dims.tp_group` (one
coalesced all-reduce; sum over TP and mean over DP commute, so doing it last is exact).

Ordering assumptions:
  * Buckets are launched strictly in bucket order (a bucket that completes early waits for its
    predecessors), so every DP rank issues the same collectives in the same order whatever order
    autograd fires the hooks in.
  * A parameter reports at most once per backward (one AccumulateGrad per leaf per graph); a
    second report after its bucket was launched would race the in-flight all-reduce and is refused.
  * Streams (CUDA): the hooks run on the stream of the parameter's AccumulateGrad node (usually
    the one compute stream; under --enable-cuda-graph the graphed layers' nodes are on the
    capture's side stream). Before a bucket's all-reduce is enqueued on the current stream, that
    stream waits for every other stream the bucket's hooks ran on (`parallel.streams`); NCCL
    orders the all-reduce after the work queued there. `finish_grad_sync()` waits on the
    handles, which makes the calling (current) stream wait for NCCL; the optimizer must run on
    that stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megadomino.parallel import ParallelDims
from megadomino.parallel.streams import HookStreams, weak_grad_hook

DEFAULT_BUCKET_NUMEL = 25_000_000


class _Bucket:
    """A contiguous fp32 slice of the buffer and the parameters whose main_grads live in it."""

    def __init__(self, data: torch.Tensor, params: list[nn.Parameter]):
        self.data = data
        self.params = params
        self.reported: set[int] = set()
        self.handle: dist.Work | None = None
        self.launched = False


class GradBuffer:
    """fp32 gradient accumulation and the overlapped DP all-reduce (average) for `params`."""

    def __init__(self, params: Iterable[nn.Parameter], dims: ParallelDims,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel={bucket_numel} must be >= 1")
        unique: dict[int, nn.Parameter] = {}
        for param in params:
            if param.requires_grad:
                unique.setdefault(id(param), param)
        self.params = list(unique.values())
        self.dims = dims
        ordered = self.params[::-1]
        device = ordered[0].device if ordered else torch.device("cpu")
        self.data = torch.zeros(sum(p.numel() for p in ordered), dtype=torch.float32,
                                device=device)

        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        offset, start, members = 0, 0, []
        for param in ordered:
            param.main_grad = self.data[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()
            members.append(param)
            if offset - start >= bucket_numel or param is ordered[-1]:
                bucket = _Bucket(self.data[start:offset], members)
                self.buckets.append(bucket)
                for member in members:
                    self._bucket_of[id(member)] = bucket
                start, members = offset, []
        self._sequence_parallel = [p for p in self.params if getattr(p, "sequence_parallel", False)]
        self._sync = True
        self._next_launch = 0
        self._streams = HookStreams()
        for param in self.params:
            param.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad))

    def zero_grad(self) -> None:
        """Zero every main_grad and drop `.grad`; call before the first micro-batch of a step."""
        if any(b.handle is not None for b in self.buckets):
            raise RuntimeError("zero_grad() while an all-reduce is in flight: "
                               "call finish_grad_sync() first")
        self.data.zero_()
        for param in self.params:
            param.grad = None
        for bucket in self.buckets:
            bucket.reported.clear()
            bucket.launched = False
        self._next_launch = 0
        self._streams.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside only accumulates into main_grad: use for all but the last micro-batch."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish_grad_sync(self) -> None:
        """After the last micro-batch's backward: every main_grad holds the DP mean (and, for
        sequence-parallel parameters, the TP sum) of the accumulated gradients."""
        self._launch_ready(force=True)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
        if self._sequence_parallel and self.dims.tp > 1:
            grads = [p.main_grad for p in self._sequence_parallel]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dims.tp_group)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if bucket.launched:
            raise RuntimeError(
                f"a gradient of shape {tuple(param.shape)} arrived after its bucket's DP "
                "all-reduce was launched: a parameter must receive its gradient once per "
                "backward (reentrant checkpointing or several backward calls per micro-batch "
                "need no_sync() for all but the last), and zero_grad() must start each step")
        param.main_grad.add_(param.grad)
        param.grad = None
        self._streams.note(id(bucket), param.main_grad)
        if self._sync:
            bucket.reported.add(id(param))
            self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        """Launch buckets in order while the next one is complete (any of them if `force`)."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not force and len(bucket.reported) < len(bucket.params):
                return
            bucket.launched = True
            self._streams.join(id(bucket))
            if self.dims.dp > 1:
                bucket.data.div_(self.dims.dp)
                bucket.handle = dist.all_reduce(bucket.data, group=self.dims.dp_group,
                                                async_op=True)
            self._next_launch += 1
