"""Sequence-parallel linears with the collective fused into the GEMM (Megatron's
`--tp-comm-overlap`), on torch's symmetric-memory kernels: the all-gather before a
column-parallel GEMM and the reduce-scatter after a row-parallel GEMM are cut into per-rank
chunks that move over NVLink copy engines while the GEMM computes the chunks already there,
forward and backward. Copy engines take no SMs from the GEMMs they overlap, which is where
NCCL-beside-GEMM overlap loses on these GPUs (benchmarks/reports/2026-11-22-domino-slicing-h200.md).

    column:  y = all_gather_s(x_shard) @ W^T     backward: dx_shard = reduce_scatter_s(dy @ W)
    row:     y_shard = reduce_scatter_s(x @ W^T) backward: dx = all_gather_s(dy_shard) @ W

Activations are [s, b, h] with the sequence (dim 0) sharded. The gathered input of a column
linear is kept for its weight gradient (memory for one all-gather per linear, as without
recompute). On NCCL + CUDA the fused kernels run (the TP group registered for symmetric
memory); elsewhere (CPU tests) the same autograd math runs on plain collectives.

The fused ops are torch's (`torch.ops.symm_mem`). Two protocols of our own that took barriers
off the compute stream (a whole input-gradient GEMM whose reduce-scatter copy engines pull
during the weight-gradient GEMM; a local-first all-gather-matmul) measured within noise of
torch's at TP=2 and TP=4, or slower, and were removed (their numbers:
benchmarks/reports/2026-11-22-tp-comm-overlap-h200.md).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from megadomino.distributed.mappings import all_gather_dim0, reduce_scatter_dim0


def _group_name(group) -> str:
    """The group's name for torch's symmetric-memory ops, registered for them (NCCL only).
    Registering is idempotent (torch keeps the registry); newer torch needs no registration
    and warns that it is deprecated."""
    name = group.group_name
    if available(group):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    return name


def _all_gather_matmul(x_shard, weight_t, group):
    """(all_gather_s(x_shard), all_gather_s(x_shard) @ weight_t)."""
    if available(group):
        x_full, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
            x_shard, [weight_t], gather_dim=0, group_name=_group_name(group))
        return x_full, y
    x_full = all_gather_dim0(x_shard.contiguous(), group)[0]
    return x_full, x_full.matmul(weight_t)


def _matmul_reduce_scatter(x, weight_t, group):
    """reduce_scatter_s(x @ weight_t)."""
    if available(group):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            x, weight_t, "sum", scatter_dim=0, group_name=_group_name(group))
    return reduce_scatter_dim0(x.matmul(weight_t), group)[0]


def _weight_grad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        x_full, y = _all_gather_matmul(x_shard, weight.t(), group)
        ctx.save_for_backward(x_full, weight)
        ctx.group = group
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad_out):
        x_full, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = _matmul_reduce_scatter(grad_out, weight, ctx.group)
        grad_weight = _weight_grad(grad_out, x_full)
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.needs_input_grad[2] \
            else None
        return grad_x, grad_weight, grad_bias, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return _matmul_reduce_scatter(x.contiguous(), weight.t(), group)

    @staticmethod
    def backward(ctx, grad_shard):
        x, weight = ctx.saved_tensors
        grad_full, grad_x = _all_gather_matmul(grad_shard.contiguous(), weight, ctx.group)
        return grad_x, _weight_grad(grad_full, x), None


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      group) -> torch.Tensor:
    """(s/tp, b, in) -> (s, b, out/tp): the column-parallel GEMM with its input all-gather."""
    return _AllGatherMatmul.apply(x_shard, weight, bias, group)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """(s, b, in/tp) -> (s/tp, b, out): the row-parallel GEMM with its output reduce-scatter."""
    return _MatmulReduceScatter.apply(x, weight, group)


def available(group) -> bool:
    """Fused kernels need CUDA tensors on an NCCL group."""
    return torch.cuda.is_available() and dist.get_backend(group) == "nccl"
