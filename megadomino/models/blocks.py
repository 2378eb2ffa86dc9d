"""The parts of a transformer block: norms, rotary embedding, attention (torch SDPA), MLP.

No module here calls a collective directly: the parallel linears hide theirs. Activations are
`[s, b, h]` (sequence first, as in Megatron-LM), `[s/tp, b, h]` between blocks under sequence
parallelism.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megadomino.config import FP8Recipe, ModelConfig, ParallelConfig
from megadomino.distributed import random as tp_random
from megadomino.models import elementwise
from megadomino.tp.layers import ColumnParallelLinear, RowParallelLinear, scaled_init_std

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fp8_of(fp8: FP8Recipe | None, role: str) -> FP8Recipe | None:
    """The recipe the linear of `role` (config.train.FP8_ROLES) is built with: `fp8` where that
    role runs FP8 (FP8Recipe.linears), else None (the model's dtype)."""
    return fp8 if fp8 is not None and fp8.runs_fp8(role) else None


class LocalLinear(Protocol):
    """How a runner multiplies by a parallel linear's local weight inside a layer piece:
    x @ W^T (+ b), W the rows (dim 0, with the bias) or columns (dim 1) [start, start + length)
    of `linear`'s weight when `dim` is given, no collective."""

    def __call__(self, x: torch.Tensor, linear: nn.Module, dim: int | None = None,
                 start: int = 0, length: int | None = None,
                 bias: bool = True) -> torch.Tensor: ...


class _PieceNorm:
    """What the norms share: torch's module (same parameters and state dict) running the
    element-wise piece, compiled when `compile_pieces`. `zero_centered` (--apply-layernorm-1p,
    Megatron's LayerNorm1P): the weight holds gamma - 1 (zeros at init) and the norm scales by
    weight + 1, so weight decay pulls gamma towards 1, not 0."""

    def __init__(self, hidden_size: int, eps: float, compile_pieces: bool = False,
                 zero_centered: bool = False, **kwargs):
        super().__init__(hidden_size, eps=eps, **kwargs)
        self.compile_pieces, self.zero_centered = compile_pieces, zero_centered
        if zero_centered:
            nn.init.zeros_(self.weight)

    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered else self.weight


class LayerNorm(_PieceNorm, nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = elementwise.pieces(self.compile_pieces)
        return ops.layer_norm(x, self.gamma(), self.bias, self.eps)


class RMSNorm(_PieceNorm, nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise.pieces(self.compile_pieces).rms_norm(x, self.gamma(), self.eps)


def build_norm(config: ModelConfig, sequence_parallel: bool = False, device=None,
               compile_pieces: bool = False) -> nn.Module:
    """LayerNorm (weight and bias) or RMSNorm (weight), zero-centred with apply_layernorm_1p;
    under sequence parallelism the params are marked `sequence_parallel` (each rank sees part of
    the sequence: its gradient is partial)."""
    dtype = DTYPES[config.params_dtype]
    norm_class = LayerNorm if config.normalization == "LayerNorm" else RMSNorm
    norm = norm_class(config.hidden_size, eps=config.norm_epsilon, compile_pieces=compile_pieces,
                      zero_centered=config.apply_layernorm_1p, device=device, dtype=dtype)
    for param in norm.parameters():
        param.sequence_parallel = sequence_parallel
    return norm


def rotary_tables(seq_len: int, dim: int, base: float, device=None) -> tuple[torch.Tensor, ...]:
    """cos, sin of shape (seq_len, dim) for rotate-half RoPE (the layout HF Llama weights use)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads, tensor-parallel over heads.

    The fused QKV weight follows Megatron's layout: per query group, its q heads then one k and
    one v head, so a contiguous split of the output rows gives each TP rank whole groups.
    """

    def __init__(self, config: ModelConfig, dims, parallel: ParallelConfig,
                 fp8: FP8Recipe | None = None, device=None):
        super().__init__()
        dtype = DTYPES[config.params_dtype]
        self.config, self.dims = config, dims
        self.compile_pieces = parallel.compile_layer_pieces
        self.selective_recompute = parallel.recompute_granularity == "selective"
        self.head_dim = config.kv_channels
        self.heads_local = config.num_attention_heads // dims.tp
        self.groups_local = config.num_query_groups // dims.tp
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        sp, overlap = parallel.sequence_parallel and dims.tp > 1, parallel.tp_comm_overlap
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, dims, bias=config.add_bias_linear,
            sequence_parallel=sp, comm_overlap=overlap,
            init_std=config.init_method_std, fp8=fp8_of(fp8, "qkv"),
            compile_fp8_casts=self.compile_pieces, fuse_wgrad=parallel.fused_weight_gradients,
            device=device, dtype=dtype)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, dims,
            bias=config.add_bias_linear, sequence_parallel=sp, comm_overlap=overlap,
            init_std=scaled_init_std(config.init_method_std, config.num_layers),
            fp8=fp8_of(fp8, "proj"),
            compile_fp8_casts=self.compile_pieces,
            fuse_wgrad=parallel.fused_weight_gradients, device=device, dtype=dtype)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """SDPA over (b, heads, s, d) tensors; attention dropout uses this rank's RNG stream."""
        dropout = self.config.attention_dropout if self.training else 0.0
        gqa = self.heads_per_group > 1
        if dropout > 0.0:
            with tp_random.tracker_of(self.dims).fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                      enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def partial(self, u: torch.Tensor, rotary, linear: LocalLinear) -> torch.Tensor:
        """The attention piece before its reduce: u (s, b, h), the whole sequence -> this rank's
        un-reduced output of the output projection, without its bias. `linear` runs the two
        projections with this rank's weights (a runner's own GEMMs)."""
        return linear(self.attend(linear(u, self.linear_qkv), rotary), self.linear_proj,
                      bias=False)

    def attend(self, qkv: torch.Tensor, rotary, bias: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's fused QKV projection (s, b, groups*(hpg+2)*d) -> context (s, b, heads*d).
        `bias`: the projection's bias, already in qkv but without its gradient there (the
        linear's "detached" mode): the split's backward returns it."""
        s, b = qkv.shape[:2]
        # (s, b, groups*(hpg+2)*d) -> (s, b, groups, hpg+2, d)
        qkv = qkv.view(s, b, self.groups_local, self.heads_per_group + 2, self.head_dim)
        q, k, v = _SplitQKV.apply(qkv, bias, self.heads_per_group,
                                  elementwise.pieces(self.compile_pieces).qkv_grad)
        q = q.reshape(s, b, self.heads_local, self.head_dim)
        k = k.reshape(s, b, self.groups_local, self.head_dim)
        v = v.reshape(s, b, self.groups_local, self.head_dim)
        if rotary is not None:
            cos, sin = rotary
            rope = elementwise.pieces(self.compile_pieces).rotary
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        # (s, b, heads, d) -> (b, heads, s, d)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if self.selective_recompute and self.training:
            context = tp_random.checkpoint(self.core, self.dims, q, k, v)
        else:
            context = self.core(q, k, v)
        # (b, heads, s, d) -> (s, b, heads*d)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.heads_local * self.head_dim)

    def forward(self, x: torch.Tensor, rotary=None, add_bias: bool = True) -> torch.Tensor:
        """`add_bias` False leaves the output projection's bias to the caller's residual piece.
        The QKV bias is added in its GEMM, its gradient summed by the split's backward."""
        # linear_proj's forward fuses the GEMM with its reduce-scatter under --tp-comm-overlap
        qkv_bias = self.linear_qkv.bias
        qkv = self.linear_qkv(x, bias="add" if qkv_bias is None else "detached")
        return self.linear_proj(self.attend(qkv, rotary, qkv_bias), add_bias)


class _SplitQKV(torch.autograd.Function):
    """qkv (s, b, groups, hpg+2, d) -> q, k, v: views of it, split along dim 3 as [hpg, 1, 1].
    Its backward is `grad_fn` (a layer piece, elementwise.qkv_grad, compiled with the others): the
    interleaved gradient, and `bias`'s gradient (its column sums) when the bias rode in qkv's GEMM
    without one."""

    @staticmethod
    def forward(ctx, qkv, bias, heads_per_group: int, grad_fn):
        ctx.grad_fn = grad_fn
        return qkv.split([heads_per_group, 1, 1], dim=3)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        dqkv, dbias = ctx.grad_fn(dq, dk, dv, ctx.needs_input_grad[1])
        return dqkv, dbias, None, None


class MLP(nn.Module):
    """fc1 (column-parallel) -> GELU(tanh) or SwiGLU -> fc2 (row-parallel).

    With SwiGLU, fc1 holds [gate; up] stacked, each sharded separately (stripes=2), so a rank's
    local fc1 output is [gate_local, up_local].
    """

    def __init__(self, config: ModelConfig, dims, parallel: ParallelConfig,
                 fp8: FP8Recipe | None = None, device=None):
        super().__init__()
        dtype = DTYPES[config.params_dtype]
        self.config = config
        self.compile_pieces = parallel.compile_layer_pieces
        sp, overlap = parallel.sequence_parallel and dims.tp > 1, parallel.tp_comm_overlap
        stripes = 2 if config.swiglu else 1
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, stripes * config.ffn_hidden_size, dims,
            bias=config.add_bias_linear, sequence_parallel=sp,
            comm_overlap=overlap, init_std=config.init_method_std,
            stripes=stripes, fp8=fp8_of(fp8, "fc1"), compile_fp8_casts=self.compile_pieces,
            fuse_wgrad=parallel.fused_weight_gradients,
            device=device, dtype=dtype)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, dims, bias=config.add_bias_linear,
            sequence_parallel=sp, comm_overlap=overlap,
            init_std=scaled_init_std(config.init_method_std, config.num_layers),
            fp8=fp8_of(fp8, "fc2"), compile_fp8_casts=self.compile_pieces,
            fuse_wgrad=parallel.fused_weight_gradients, device=device, dtype=dtype)

    def activation(self, h: torch.Tensor, up: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """GELU(tanh) of fc1's output, or SwiGLU: silu(gate) * up, of [gate, up] stacked (h) or
        given apart (h the gate). `bias`: fc1's bias when its GEMM left it out (stacked like h),
        added by the piece."""
        ops = elementwise.pieces(self.compile_pieces)
        if self.config.swiglu:
            gate, up = h.chunk(2, dim=-1) if up is None else (h, up)
            if bias is None:
                return ops.swiglu(gate, up)
            return ops.swiglu(gate, up, *bias.chunk(2))
        return ops.gelu(h, bias)

    def partial(self, v: torch.Tensor, linear: LocalLinear, start: int = 0,
                length: int | None = None) -> torch.Tensor:
        """The MLP piece before its reduce, over this rank's ffn columns [start, start + length)
        (default: all): v (s, b, h), the whole sequence -> its un-reduced contribution to fc2's
        output, without fc2's bias. `linear` runs fc1 and fc2 with this rank's weights."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        ffn_local = fc2.weight.shape[1]
        length = ffn_local if length is None else length
        if self.config.swiglu:  # fc1 holds [gate; up]: a chunk is rows of each
            act = self.activation(linear(v, fc1, 0, start, length),
                                  linear(v, fc1, 0, ffn_local + start, length))
        elif length == ffn_local:
            act = self.activation(linear(v, fc1))
        else:
            act = self.activation(linear(v, fc1, 0, start, length))
        return linear(act, fc2, 1, start, length, bias=False)

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """`add_bias` False leaves fc2's bias to the caller's residual piece. With compiled
        pieces, fc1's bias is added by the activation piece (its add and gradient sum fused
        there); eagerly, by fc1's GEMM epilogue (no extra pass)."""
        fc1 = self.linear_fc1
        in_piece = self.compile_pieces and fc1.bias is not None
        h = fc1(x, bias="skip" if in_piece else "add")
        # linear_fc2's forward fuses the GEMM with its reduce-scatter under --tp-comm-overlap
        return self.linear_fc2(self.activation(h, bias=fc1.bias if in_piece else None), add_bias)
