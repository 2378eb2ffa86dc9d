"""The peers' transformer layers, built on our shapes for benchmarks/bench_domino.py.

- megatron-core 0.16.1: `TransformerBlock` with the local spec (torch norms, Megatron's own
  column/row parallel linears), core attention swapped for torch SDPA so that attention kernels
  equal ours.
- DeepSpeed 0.19.8: `deepspeed.runtime.domino.transformer.DominoTransformer` (2 batch slices,
  inter-layer overlap by default, asynchronous column-parallel backward). GPT shapes only: it has
  LayerNorm, exact-erf GELU and no grouped-query attention built in.

Both are used the way their users use them; neither installs in CI, so each builder returns
(None, reason) when its package does not import. Call them in every rank, after
`torch.distributed` is initialised and `torch.cuda.set_device(local_rank)`. Both peers overlap
their backward all-reduces with weight-gradient GEMMs, which needs `CUDA_DEVICE_MAX_CONNECTIONS=1`
set before CUDA initialises (the bench exports it; GPU.md measured no difference for our own
layer). Neither block ends in a final norm, so a block's time is `num_layers` layers' time.

Build and time one DeepSpeed module before building the next: its column-parallel backward
all-reduces over a module global that each build resets to that build's group.

    module, forward = build_megatron_block(shape, tp=4, num_layers=4)
    out = forward(x)  # x (s, b, h) in `dtype`, on this rank's device; out (s, b, h)
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

Forward = Callable[[torch.Tensor], torch.Tensor]
Built = tuple[torch.nn.Module, Forward] | tuple[None, str]
INIT_STD = 0.02


@dataclass(frozen=True)
class LayerShape:
    """One benchmark row's layer and input shape."""

    name: str
    family: str
    """'gpt' (LayerNorm, biases, tanh GELU) or 'llama' (RMSNorm, no biases, SwiGLU, RoPE)."""
    hidden: int
    heads: int
    query_groups: int
    """Key/value heads; equal to `heads` unless grouped-query attention."""
    ffn: int
    seq: int
    micro_batch: int

    def __post_init__(self) -> None:
        if self.family not in ("gpt", "llama"):
            raise ValueError(f"family must be 'gpt' or 'llama', got {self.family!r}")
        if self.hidden % self.heads or self.heads % self.query_groups:
            raise ValueError(f"{self.name}: hidden {self.hidden}, heads {self.heads} and query "
                             f"groups {self.query_groups} must divide one another")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sdpa_core_attention() -> type[torch.nn.Module]:
    """Megatron's `DotProductAttention` interface over torch SDPA (causal, no dropout)."""
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(torch.nn.Module):
        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                     attention_dropout: float | None = None, softmax_scale: float | None = None,
                     cp_comm_type: str | None = None, pg_collection=None) -> None:
            super().__init__()
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if attn_mask_type != AttnMaskType.causal or dropout or softmax_scale is not None:
                raise ValueError("SDPA core attention is causal, without dropout or a custom "
                                 "softmax scale")

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None) -> torch.Tensor:
            if attention_mask is not None or attention_bias is not None or packed_seq_params:
                raise ValueError("SDPA core attention takes no mask, bias or packed sequences")
            s, b, heads, head_dim = query.shape
            # q (s, b, heads, d), k/v (s, b, groups, d) -> (b, heads|groups, s, d)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     enable_gqa=k.shape[1] != heads)
            # (b, heads, s, d) -> (s, b, heads * d)
            return context.permute(2, 0, 1, 3).reshape(s, b, heads * head_dim)

    return SDPACoreAttention


def _megatron_parallel_state(tp: int, seed: int, device: torch.device) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() != tp):
        # Only clears its globals: blocks built before keep their groups.
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 create_gloo_process_groups=False)
    # Its GPU weight init draws from the tensor-parallel RNG tracker this seeds.
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_megatron_block(shape: LayerShape, tp: int, num_layers: int,
                         dtype: torch.dtype = torch.bfloat16, seed: int = 1234,
                         device: torch.device | None = None, fused: bool = False) -> Built:
    """megatron-core's `TransformerBlock` of `num_layers` layers at tensor parallelism `tp`
    (data parallel over the rest of the world), without sequence parallelism (its local spec
    refuses it without apex or transformer-engine) or dropout. Norms are torch's LayerNorm or
    RMSNorm whether or not apex is installed. Returns (block, forward) with forward(x (s, b, h))
    -> (s, b, h), or (None, reason) if megatron-core does not import. device: where it is built
    (default: the current GPU where there is one, else the CPU); its CUDA RNG is seeded only
    for a GPU build, so a CPU build works on a machine with GPUs too. fused: megatron-core's
    own element-wise fusions that need neither apex nor transformer-engine, as Megatron-LM's
    command line turns them on by default (bias + GELU, bias + SwiGLU, bias + dropout + add);
    GPT then names its activation F.gelu, which megatron's fused bias-GELU computes with the
    tanh approximation."""
    try:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import (
            RotaryEmbedding,
        )
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as error:
        return None, f"megatron-core not importable: {error}"
    device = device or _device()
    _megatron_parallel_state(tp, seed, device)
    llama = shape.family == "llama"
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups, ffn_hidden_size=shape.ffn,
        kv_channels=shape.head_dim, add_bias_linear=not llama, gated_linear_unit=llama,
        activation_func=F.silu if llama else (F.gelu if fused else _gelu_tanh),
        normalization="RMSNorm" if llama else "LayerNorm", init_method_std=INIT_STD,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, tensor_model_parallel_size=tp, sequence_parallel=False,
        use_cpu_initialization=device.type == "cpu", bias_activation_fusion=fused,
        bias_dropout_fusion=fused, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = WrappedTorchNorm
    layer.self_attention.submodules.core_attention = _sdpa_core_attention()
    # The block builds its torch norms in fp32 on the CPU; the linears are already in place.
    block = TransformerBlock(config, spec, post_layer_norm=False).to(device=device, dtype=dtype)
    rotary = None
    if llama:
        rope = RotaryEmbedding(shape.head_dim, rotary_percent=1.0, rotary_base=10000,
                               use_cpu_initialization=device.type == "cpu")
        rotary = rope(shape.seq).to(device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return block(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary)

    return block, forward


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass
class DominoConfig:
    """The Megatron-style fields `DominoTransformer` reads, and no others."""

    hidden_size: int
    num_attention_heads: int
    kv_channels: int
    ffn_hidden_size: int
    num_layers: int
    params_dtype: torch.dtype
    init_method: Callable[[torch.Tensor], torch.Tensor]
    output_layer_init_method: Callable[[torch.Tensor], torch.Tensor]
    domino_intra_layer_overlap: bool = False
    layernorm_epsilon: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    perform_initialization: bool = True
    add_bias_linear: bool = True
    apply_residual_connection_post_layernorm: bool = False
    gated_linear_unit: bool = False


class TensorParallelMPU:
    """The three tensor-parallel getters DeepSpeed's Domino layer asks its `mpu` for."""

    def __init__(self, tp_group: dist.ProcessGroup) -> None:
        self.tp_group = tp_group

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.tp_group)

    def get_tensor_model_parallel_rank(self) -> int:
        return dist.get_rank(self.tp_group)


def contiguous_tp_group(tp: int) -> dist.ProcessGroup:
    """This rank's group of `tp` consecutive ranks (every rank must call this, in step)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of tp {tp}")
    mine = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            mine = group
    return mine


def build_deepspeed_domino(shape: LayerShape, tp: int, num_layers: int,
                           dtype: torch.dtype = torch.bfloat16,
                           tp_group: dist.ProcessGroup | None = None,
                           intra_layer_overlap: bool = False) -> Built:
    """DeepSpeed's `DominoTransformer` of `num_layers` layers over `tp_group` (default: groups of
    `tp` consecutive ranks). It splits the batch dim of x (s, b, h) into 2 slices itself, so b
    must be even. Returns (module, forward) with forward(x) -> (s, b, h), or (None, reason) if
    DeepSpeed does not import or the shape is not one it supports."""
    if shape.family != "gpt" or shape.query_groups != shape.heads:
        return None, "DeepSpeed's Domino layer has only LayerNorm, GELU and no grouped queries"
    if shape.micro_batch % 2:
        return None, f"DeepSpeed's Domino layer halves the batch; micro-batch {shape.micro_batch}"
    try:
        import deepspeed.comm
        from deepspeed.runtime.domino import async_linear
        from deepspeed.runtime.domino.transformer import DominoTransformer, ModelType
    except ImportError as error:
        return None, f"DeepSpeed not importable: {error}"
    if torch.cuda.is_available() and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        warnings.warn("CUDA_DEVICE_MAX_CONNECTIONS is not 1: DeepSpeed's asynchronous backward "
                      "all-reduce may not overlap the weight-gradient GEMM", stacklevel=2)
    tp_group = tp_group if tp_group is not None else contiguous_tp_group(tp)
    if dist.get_world_size(tp_group) != tp:
        raise ValueError(f"tp_group has {dist.get_world_size(tp_group)} ranks, not tp {tp}")
    # Wraps the torch process group that already exists; DeepSpeed's collectives go through it.
    deepspeed.comm.init_distributed(dist_backend=dist.get_backend())
    # Its column-parallel backward all-reduces over a module global that only the first layer
    # ever built sets: clear it so that this build's group is the one used.
    async_linear.TP_group = None
    output_std = INIT_STD / math.sqrt(2 * num_layers)
    config = DominoConfig(
        hidden_size=shape.hidden, num_attention_heads=shape.heads, kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn, num_layers=num_layers, params_dtype=dtype,
        init_method=lambda w: torch.nn.init.normal_(w, std=INIT_STD),
        output_layer_init_method=lambda w: torch.nn.init.normal_(w, std=output_std),
        domino_intra_layer_overlap=intra_layer_overlap)
    module = DominoTransformer(config, TensorParallelMPU(tp_group), apply_rotary_pos_emb=None,
                               model_type=ModelType.encoder_or_decoder, post_layer_norm=False)
    # Its linears are made on the accelerator in `dtype`, its LayerNorms in fp32 on the CPU.
    module = module.to(device=_device(), dtype=dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return module(x, None)

    return module, forward
