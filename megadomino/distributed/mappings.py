"""The tensor-parallel collectives as small autograd Functions (Megatron's f and g, and the
sequence-parallel all-gather / reduce-scatter).

Activations are laid out `[s, b, h]`; sequence parallelism shards dim 0 (the sequence), the
vocabulary / hidden shards are on the last dim. All collectives run on the caller's current
stream and are synchronous unless a function says otherwise.

A `NoCommunication` in place of the group turns every collective here into a local stand-in of
the same shape (the benchmarks' "no-communication limit": the same math with the collectives
skipped; `no_tp_communication(dims)` puts one in a ParallelDims for a while). Results are then
wrong by design; never use it for training.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megadomino.distributed import comm


class NoCommunication:
    """Stands in for a process group: the collectives here skip their communication and do a
    local operation of the same shape (size and rank are the group's)."""

    def __init__(self, group):
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)


@contextlib.contextmanager
def no_tp_communication(dims):
    """Inside, `dims.tp_group` is a NoCommunication (benchmarks only: the physical limit of any
    overlap, for models built on `dims`, which read the group when they run)."""
    group, dims.tp_group = dims.tp_group, NoCommunication(dims.tp_group)
    try:
        yield
    finally:
        dims.tp_group = group


def group_size(group) -> int:
    return group.size() if isinstance(group, NoCommunication) else dist.get_world_size(group)


def group_rank(group) -> int:
    return group.rank() if isinstance(group, NoCommunication) else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group, async_op: bool = False):
    """Sum over the group, in place. Returns the work handle when async_op (None if skipped)."""
    if isinstance(group, NoCommunication) or group_size(group) == 1:
        return None
    return comm.all_reduce(x, group=group, async_op=async_op)


def all_gather_dim0(x: torch.Tensor, group, async_op: bool = False):
    """Concatenate the ranks' tensors along dim 0. Returns (output, handle)."""
    world = group_size(group)
    if world == 1:
        return x, None
    if isinstance(group, NoCommunication):
        return x.repeat(world, *([1] * (x.dim() - 1))), None
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = comm.all_gather_single(out, x, group=group, async_op=async_op)
    return out, handle


def reduce_scatter_dim0(x: torch.Tensor, group, async_op: bool = False):
    """Sum over the group and keep this rank's dim-0 chunk. Returns (output, handle)."""
    world = group_size(group)
    if world == 1:
        return x, None
    if x.shape[0] % world != 0:
        raise ValueError(f"reduce-scatter along dim 0: size {x.shape[0]} not divisible by {world}")
    if isinstance(group, NoCommunication):
        return x.narrow(0, 0, x.shape[0] // world).contiguous(), None
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = comm.reduce_scatter_single(out, x, group=group, async_op=async_op)
    return out, handle


def split_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of dim 0 (no communication)."""
    world = group_size(group)
    if world == 1:
        return x
    rank = group_rank(group)
    return x.chunk(world, dim=0)[rank].contiguous()


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    gathered, _ = all_gather_dim0(x.movedim(-1, 0), group)
    return gathered.movedim(0, -1).contiguous()


def split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    return x.chunk(world, dim=-1)[group_rank(group)].contiguous()


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's sequence chunk forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group)[0], None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence forward; reduce-scatter the gradient backward (the consumer is a
    tensor-parallel region whose ranks each hold a partial gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.group)[0], None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group)[0], None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's chunk of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group), None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's chunk of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToTensorParallelRegion.apply(x, group)


def allreduce_sequence_parallel_grads(module: torch.nn.Module, group) -> None:
    """Sum `.grad` over the TP group for parameters marked `sequence_parallel` (their gradient is
    partial per rank: each saw only its sequence chunk). The data-parallel engine does the same
    on its fp32 gradients; this is for plain `.grad` users."""
    for param in module.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            all_reduce(param.grad, group)
