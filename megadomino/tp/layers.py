"""Tensor-parallel layers with Megatron-LM semantics: ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding.

Activations are `[s, b, h]`. Weights are `[out, in]` (torch's layout). Every sharded parameter
carries its sharding so that full (unsharded) state dicts can be built and loaded at any TP:
`tensor_model_parallel=True`, `tp_partition_dim` (0: output rows, 1: input columns),
`tp_stripes` (a weight made of several stacked matrices each sharded on its own, e.g. SwiGLU's
[gate; up]), and for vocabulary tables `vocab_size` (the unpadded row count).

FP8 (`fp8`, a config.FP8Recipe): the layer's GEMMs run in FP8 (fp8_linear), with its
scaling state in the `fp8_state` submodule. The column-parallel input's collective is then the
plain mapping (f, or the sequence all-gather) around fp8_linear, without the async overlap of the
input-gradient all-reduce that the high-precision path has; --tp-comm-overlap is not combined
with it.

Init: the full weight is drawn from the default generator (identical on every TP rank, see
`distributed.random`) and then sharded, so a model's initial weights do not depend on the TP degree.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megadomino.config import FP8Recipe
from megadomino.distributed import fused_matmul, mappings
from megadomino.distributed.mappings import all_gather_dim0, all_reduce, reduce_scatter_dim0
from megadomino.tp.fp8 import FP8State, fp8_linear
from megadomino.tp.wgrad import defer_or_compute, deferring_store


def shard_rows(full: torch.Tensor, dim: int, stripes: int, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's shard of `full` along `dim`, each of `stripes` stacked blocks sharded alone."""
    blocks = full.chunk(stripes, dim=dim)
    return torch.cat([block.chunk(tp, dim=dim)[tp_rank] for block in blocks], dim=dim)


def unshard_rows(shards: list[torch.Tensor], dim: int, stripes: int) -> torch.Tensor:
    """Inverse of shard_rows: shards of every rank, in rank order, to the full tensor."""
    striped = [shard.chunk(stripes, dim=dim) for shard in shards]
    return torch.cat([torch.cat([s[j] for s in striped], dim=dim) for j in range(stripes)],
                     dim=dim)


def _mark(param: nn.Parameter, dim: int, stripes: int = 1) -> None:
    param.tensor_model_parallel = True
    param.tp_partition_dim = dim
    param.tp_stripes = stripes


@torch.no_grad()
def init_sharded_(param: nn.Parameter, full_shape: tuple[int, ...], std: float, dims) -> None:
    """Draw the full weight N(0, std) and keep this rank's shard (TP-degree independent)."""
    full = torch.empty(full_shape, dtype=torch.float32, device=param.device).normal_(0.0, std)
    rows = getattr(param, "vocab_size", None)
    if rows is not None:
        padded = torch.zeros((param.shape[0] * dims.tp, *full_shape[1:]), device=param.device)
        padded[:rows] = full[:rows]
        full = padded
    dim = getattr(param, "tp_partition_dim", 0)
    param.copy_(shard_rows(full, dim, getattr(param, "tp_stripes", 1), dims.tp, dims.tp_rank))


def weight_grad(weight: torch.Tensor, grad_2d: torch.Tensor,
                input_2d: torch.Tensor) -> torch.Tensor:
    """dW = grad^T input, (out, in), for a linear's backward. Megatron's gradient-accumulation
    fusion: where the engine gave `weight` its fp32 gradient buffer view (`main_grad_ref`, a
    weak reference, ZeRO stages 0 and 1) and the layer owns the weight's whole backward
    (`weight.fused_wgrad`, set by the linear modules when their every backward comes here),
    the GEMM accumulates into that buffer in fp32 (on CUDA in its epilogue: no bf16 rounding
    of each micro-batch's gradient, no separate add) and a placeholder of the weight's shape
    goes to autograd, which the engine's hook does not add (grads.py). Where the engine runs
    one backward a step (`ref.overwrite`, grads.py MainGradRef), the GEMM writes the buffer
    instead (beta 0: the buffer is neither zeroed nor read). Otherwise the gradient itself is
    returned."""
    ref = getattr(weight, "main_grad_ref", None)
    main_grad = ref() if ref is not None else None
    if main_grad is None or not getattr(weight, "fused_wgrad", False):
        return grad_2d.t().matmul(input_2d)
    beta = 0.0 if ref.overwrite else 1.0
    if not grad_2d.is_cuda:  # the same arithmetic as unfused (mixed-dtype addmm is CUDA-only)
        product = grad_2d.t().matmul(input_2d)
        if beta == 0.0:
            main_grad.copy_(product)
        else:
            main_grad.add_(product)
    elif main_grad.dtype == grad_2d.dtype:
        main_grad.addmm_(grad_2d.t(), input_2d, beta=beta)
    else:
        torch.addmm(main_grad, grad_2d.t(), input_2d, beta=beta, out_dtype=main_grad.dtype,
                    out=main_grad)
    ref.written()
    return torch.empty_like(weight)


class _LocalLinear(torch.autograd.Function):
    """y = x W^T without collectives (a row-parallel linear's partial product), its weight
    gradient through `weight_grad`, deferred to W under a split backward (tp/wgrad.py)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_input = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = defer_or_compute(ctx, weight, lambda: weight_grad(
                weight, grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])))
        return grad_input, grad_weight


class _LinearWithAsyncGradReduce(torch.autograd.Function):
    """y = x W^T + b for a column-parallel weight, with the input's collective fused in.

    Forward: without sequence parallelism x is replicated (f: identity); with it, x is this rank's
    sequence chunk and is all-gathered first. Backward: the input gradient's all-reduce (or, with
    sequence parallelism, reduce-scatter) is launched async and overlaps the weight-gradient GEMM;
    under sequence parallelism the input is re-gathered async during the input-gradient GEMM
    instead of being kept from the forward. Every collective is enqueued on the current stream
    order: the handle's wait() makes the current stream wait for it before the result is used.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        total = all_gather_dim0(x, group)[0] if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        store = deferring_store(weight)
        if store is not None:
            return _column_input_grad(ctx, store, x, weight, grad_out)
        group, sequence_parallel = ctx.group, ctx.sequence_parallel
        gather_handle = None
        total = x
        if sequence_parallel:
            total, gather_handle = all_gather_dim0(x, group, async_op=True)
        grad_input = grad_out.matmul(weight)
        if gather_handle is not None:
            gather_handle.wait()
        reduce_handle = None
        if ctx.needs_input_grad[0]:
            grad_input, reduce_handle = _reduce_input_grad(grad_input, group, sequence_parallel,
                                                           async_op=True)
        grad_weight, grad_bias = _weight_and_bias_grads(weight, grad_out, total,
                                                        ctx.needs_input_grad[2])
        if reduce_handle is not None:
            reduce_handle.wait()
        return (grad_input if ctx.needs_input_grad[0] else None), grad_weight, grad_bias, None, None


def _column_input_grad(ctx, store, x, weight, grad_out) -> tuple:
    """B of a split backward (tp/wgrad.py): the input gradient and its collective now (waited
    for: no weight-gradient GEMM is left to overlap it); the weight and bias gradients recorded
    in `store` for W, which re-gathers the input under sequence parallelism."""
    group, sequence_parallel = ctx.group, ctx.sequence_parallel
    needs_bias = ctx.needs_input_grad[2]

    def weight_and_bias() -> tuple[torch.Tensor, torch.Tensor | None]:
        total = all_gather_dim0(x, group)[0] if sequence_parallel else x
        return _weight_and_bias_grads(weight, grad_out, total, needs_bias)

    store.record(ctx, weight_and_bias, (1, 2))
    grad_input = None
    if ctx.needs_input_grad[0]:
        grad_input, _ = _reduce_input_grad(grad_out.matmul(weight), group, sequence_parallel,
                                           async_op=False)
    return grad_input, None, None, None, None


def _reduce_input_grad(grad_input: torch.Tensor, group, sequence_parallel: bool,
                       async_op: bool) -> tuple[torch.Tensor, object]:
    """A column-parallel input gradient's collective: reduce-scatter over the sequence under
    sequence parallelism, else an in-place all-reduce. (result, handle: None unless async)."""
    if sequence_parallel:
        return reduce_scatter_dim0(grad_input, group, async_op=async_op)
    grad_input = grad_input.contiguous()
    return grad_input, all_reduce(grad_input, group, async_op=async_op)


def _weight_and_bias_grads(weight: torch.Tensor, grad_out: torch.Tensor, total: torch.Tensor,
                           needs_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The column-parallel weight gradient (weight_grad: fused into main_grad where the engine
    set it up) of the whole (gathered) input `total`, and the bias gradient if needed."""
    grad_out_2d = grad_out.reshape(-1, grad_out.shape[-1])
    return (weight_grad(weight, grad_out_2d, total.reshape(-1, total.shape[-1])),
            grad_out_2d.sum(dim=0) if needs_bias else None)


def column_parallel_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group, sequence_parallel: bool,
                           comm_overlap: bool = False) -> torch.Tensor:
    """Functional column-parallel linear (also used by the tied output layer). With sequence
    parallelism and comm_overlap, the all-gather is fused into the GEMM
    (distributed.fused_matmul)."""
    if sequence_parallel and comm_overlap and mappings.group_size(group) > 1:
        return fused_matmul.all_gather_matmul(x, weight, bias, group)
    return _LinearWithAsyncGradReduce.apply(x, weight, bias, group, sequence_parallel)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) over the TP group.

    Input `[s, b, in]` replicated (or `[s/tp, b, in]` with sequence_parallel); output
    `[s, b, out/tp]`, or `[s, b, out]` with gather_output. `stripes` > 1 shards each of that many
    stacked output blocks separately (SwiGLU's [gate; up]).
    """

    def __init__(self, input_size: int, output_size: int, dims, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 comm_overlap: bool = False, init_std: float = 0.02, stripes: int = 1,
                 fp8: FP8Recipe | None = None, compile_fp8_casts: bool = False,
                 fuse_wgrad: bool = False, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if output_size % (dims.tp * stripes) != 0:
            raise ValueError(f"output size {output_size} not divisible by tp {dims.tp} "
                             f"x stripes {stripes}")
        if gather_output and sequence_parallel:
            raise ValueError("gather_output is not supported with sequence parallelism")
        _check_fp8(fp8, comm_overlap)
        self.dims, self.gather_output, self.sequence_parallel = dims, gather_output, \
            sequence_parallel
        self.comm_overlap = comm_overlap
        self.input_size, self.output_size = input_size, output_size
        local = output_size // dims.tp
        self.weight = nn.Parameter(torch.empty(local, input_size, device=device, dtype=dtype))
        _mark(self.weight, 0, stripes)
        init_sharded_(self.weight, (output_size, input_size), init_std, dims)
        self.weight.fused_wgrad = fuse_wgrad and fp8 is None and not (
            comm_overlap and sequence_parallel and dims.tp > 1)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype))
            _mark(self.bias, 0, stripes)
        self.fp8_state = None if fp8 is None else FP8State(fp8, device, _amax_group(dims),
                                                            compile_fp8_casts)

    def forward(self, x: torch.Tensor, bias: str = "add") -> torch.Tensor:
        """`bias`: "add" adds it in the GEMM's epilogue with its gradient here; "skip" leaves it
        out (Megatron's skip_bias_add: the consuming piece adds it, and its gradient fuses with
        that piece's backward); "detached" adds it with no gradient here (the consumer returns
        the bias's gradient: Attention's QKV split sums it in the pass that assembles dqkv)."""
        if bias not in _BIAS_MODES:
            raise ValueError(f"bias mode {bias!r}: expected one of {_BIAS_MODES}")
        group = self.dims.tp_group
        b = None if self.bias is None or bias == "skip" else self.bias
        if b is not None and bias == "detached":
            b = b.detach()
        if self.fp8_state is not None:
            if self.sequence_parallel:
                total = mappings.gather_from_sequence_parallel_region(x, group)
            else:
                total = mappings.copy_to_tensor_parallel_region(x, group)
            out = fp8_linear(total, self.weight, b, self.fp8_state)
        else:
            out = column_parallel_matmul(x, self.weight, b, group, self.sequence_parallel,
                                         self.comm_overlap)
        if self.gather_output:
            out = mappings.gather_from_tensor_parallel_region(out, group)
        return out


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features) over the TP group.

    Input `[s, b, in/tp]` (input_is_parallel) or `[s, b, in]`; output `[s, b, out]` all-reduced,
    or `[s/tp, b, out]` reduce-scattered along the sequence with sequence_parallel. The bias is
    added after the reduction (so once); under sequence parallelism its gradient is partial per
    rank and the bias is marked `sequence_parallel` for the TP gradient all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, dims, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 comm_overlap: bool = False, init_std: float = 0.02,
                 fp8: FP8Recipe | None = None, compile_fp8_casts: bool = False,
                 fuse_wgrad: bool = False, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if input_size % dims.tp != 0:
            raise ValueError(f"input size {input_size} not divisible by tp {dims.tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")
        _check_fp8(fp8, comm_overlap)
        self.dims, self.input_is_parallel = dims, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.comm_overlap = comm_overlap and sequence_parallel and dims.tp > 1
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size // dims.tp, device=device, dtype=dtype))
        _mark(self.weight, 1)
        init_sharded_(self.weight, (output_size, input_size), init_std, dims)
        self.weight.fused_wgrad = fuse_wgrad and fp8 is None and not self.comm_overlap
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, device=device, dtype=dtype))
            self.bias.sequence_parallel = sequence_parallel
        self.fp8_state = None if fp8 is None else FP8State(fp8, device, _amax_group(dims),
                                                            compile_fp8_casts)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's un-reduced contribution X_r A_r (no bias): the Domino schedule reduces it."""
        if not self.input_is_parallel:
            x = mappings.scatter_to_tensor_parallel_region(x, self.dims.tp_group)
        if self.fp8_state is not None:
            return fp8_linear(x, self.weight, None, self.fp8_state)
        return _LocalLinear.apply(x, self.weight)  # ours, not F.linear's: a split defers it

    def reduce(self, partial: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        group = self.dims.tp_group
        if self.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(partial, group)
        else:
            out = mappings.reduce_from_tensor_parallel_region(partial, group)
        return out if self.bias is None or not add_bias else out + self.bias

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """`add_bias` False leaves the bias out (Megatron's skip_bias_add): the caller adds it in
        its residual piece, where the add and its gradient's sum fuse with the dropout."""
        if self.comm_overlap:
            out = fused_matmul.matmul_reduce_scatter(x, self.weight, self.dims.tp_group)
            return out if self.bias is None or not add_bias else out + self.bias
        return self.reduce(self.partial(x), add_bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows over the TP group.

    The table has `padded_vocab_size` rows (a multiple of tp); rows past `vocab_size` are padding.
    Tokens `[b, s]` -> `[s, b, h]`: each rank looks up the tokens in its row range, the rest are
    zero, then the partial results are all-reduced, or reduce-scattered along the sequence when
    `reduce_scatter` (sequence parallelism).
    """

    def __init__(self, padded_vocab_size: int, vocab_size: int, hidden_size: int, dims, *,
                 reduce_scatter: bool = False, init_std: float = 0.02, device=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if padded_vocab_size % dims.tp != 0:
            raise ValueError(f"padded vocab {padded_vocab_size} not divisible by tp {dims.tp}")
        self.dims, self.reduce_scatter = dims, reduce_scatter
        local = padded_vocab_size // dims.tp
        self.vocab_start = dims.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = nn.Parameter(torch.empty(local, hidden_size, device=device, dtype=dtype))
        _mark(self.weight, 0)
        self.weight.vocab_size = vocab_size
        init_sharded_(self.weight, (vocab_size, hidden_size), init_std, dims)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.t()  # (b, s) -> (s, b)
        if self.dims.tp == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        group = self.dims.tp_group
        if self.reduce_scatter:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, group)
        return mappings.reduce_from_tensor_parallel_region(partial, group)


_BIAS_MODES = ("add", "skip", "detached")


def _check_fp8(fp8: FP8Recipe | None, comm_overlap: bool) -> None:
    if fp8 is not None and comm_overlap:
        raise ValueError("FP8 GEMMs are not fused with the sequence-parallel collectives "
                         "(comm_overlap): use one of them")


def _amax_group(dims):
    """The group a delayed-scaling FP8State max-reduces its amaxes over: TP, when it has peers."""
    return dims.tp_group if dims.tp > 1 else None


def scaled_init_std(std: float, num_layers: int) -> float:
    """Megatron's init for output layers (attention projection, fc2): std / sqrt(2 L)."""
    return std / math.sqrt(2.0 * num_layers)
