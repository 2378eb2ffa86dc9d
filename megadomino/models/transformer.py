"""TransformerLayer (one pre-norm block) and TransformerBlock (the stack and the final norm).

A layer's forward is two residual lines; the parallel linears inside hide their collectives.
Nothing here chooses how the layers run beyond one after the other: an execution strategy
(megadomino.overlap) hands the block a runner.
"""

from __future__ import annotations

import torch
from torch import nn

from megadomino.config import FP8Recipe, ModelConfig, ParallelConfig
from megadomino.distributed import random as tp_random
from megadomino.models import elementwise
from megadomino.models.blocks import MLP, Attention, build_norm


class TransformerLayer(nn.Module):
    """Layer `layer_index` (0-based, of the whole model's config.num_layers): its linears run FP8
    as `fp8` selects them (their roles, FP8Recipe.linears), none of them in a bf16 end layer
    (FP8Recipe.bf16_layer)."""

    def __init__(self, config: ModelConfig, dims, parallel: ParallelConfig | None = None,
                 fp8: FP8Recipe | None = None, device=None, *, layer_index: int = 0):
        super().__init__()
        parallel = parallel or ParallelConfig()
        if fp8 is not None and fp8.bf16_layer(layer_index, config.num_layers):
            fp8 = None
        self.config, self.dims = config, dims
        self.sequence_parallel = parallel.sequence_parallel and dims.tp > 1
        sp, self.compile_pieces = parallel.sequence_parallel, parallel.compile_layer_pieces
        self.input_layernorm = build_norm(config, sp, device, self.compile_pieces)
        self.self_attention = Attention(config, dims, parallel, fp8, device)
        self.pre_mlp_layernorm = build_norm(config, sp, device, self.compile_pieces)
        self.mlp = MLP(config, dims, parallel, fp8, device)

    @property
    def attention_bias(self) -> nn.Parameter | None:
        """The attention output projection's bias, added after its reduce."""
        return self.self_attention.linear_proj.bias

    @property
    def mlp_bias(self) -> nn.Parameter | None:
        """fc2's bias, added after its reduce."""
        return self.mlp.linear_fc2.bias

    def residual(self, x: torch.Tensor, y: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x + dropout(y (+ bias)): the residual add of a sub-block's reduced output. Dropout on
        the residual stream replicated over TP ranks draws from the default generator (identical
        on every TP rank); sharded along the sequence, from this rank's own stream."""
        p = self.config.hidden_dropout if self.training else 0.0
        bias_dropout_add = elementwise.pieces(self.compile_pieces).bias_dropout_add
        if p > 0.0 and self.sequence_parallel:
            with tp_random.tracker_of(self.dims).fork():
                return bias_dropout_add(x, y, bias, p)
        return bias_dropout_add(x, y, bias, p)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        # x: (s, b, h), or (s/tp, b, h) under sequence parallelism
        # the output projections' biases are added by the residual pieces (fused with dropout)
        h = self.residual(x, self.self_attention(self.input_layernorm(x), rotary, add_bias=False),
                          self.attention_bias)
        return self.residual(h, self.mlp(self.pre_mlp_layernorm(h), add_bias=False),
                             self.mlp_bias)


class TransformerBlock(nn.Module):
    """The layer stack and the final norm. How the layers run is the block's `runner`, an
    execution strategy handed to it from outside (megadomino.overlap: full recompute, Domino's
    schedule, CUDA graphs): runner(x, rotary) -> the last layer's output over `self.layers`.
    None (the default) runs the layers one after the other (`run`).

    `layer_range` (start, end) keeps only layers [start, end) of the config's num_layers (a
    pipeline stage's share; `layer_offset` = start, and `self.layers[i]` is layer start + i);
    `final_norm` False leaves the final norm out (None). Every layer is still drawn, in order, and
    the others dropped, so a kept layer's initial values do not depend on the range: a model cut
    into ranges starts from the whole model's weights for the same seed."""

    def __init__(self, config: ModelConfig, dims, parallel: ParallelConfig | None = None,
                 fp8: FP8Recipe | None = None, device=None, *,
                 layer_range: tuple[int, int] | None = None, final_norm: bool = True):
        super().__init__()
        parallel = parallel or ParallelConfig()
        self.config, self.dims, self.parallel = config, dims, parallel
        start, end = layer_range if layer_range is not None else (0, config.num_layers)
        if not 0 <= start <= end <= config.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's "
                             f"{config.num_layers} layers")
        self.layer_offset = start
        kept = []
        for index in range(config.num_layers):
            layer = TransformerLayer(config, dims, parallel, fp8, device, layer_index=index)
            if start <= index < end:
                kept.append(layer)
        self.layers = nn.ModuleList(kept)
        self.final_layernorm = (build_norm(config, parallel.sequence_parallel, device,
                                           parallel.compile_layer_pieces)
                                if final_norm else None)
        self.runner = None  # not a submodule: a runner schedules these layers, holds none

    def run(self, x: torch.Tensor, rotary=None, start: int = 0, end: int | None = None):
        """Layers [start, end) one after the other: x (s, b, h), or (s/tp, b, h) under sequence
        parallelism."""
        for layer in self.layers[start:end]:
            x = layer(x, rotary)
        return x

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        if self.runner is None and (self.parallel.domino.enabled
                                    or self.parallel.recompute_granularity == "full"):
            raise RuntimeError("the ParallelConfig asks for Domino or full recompute, which run "
                               "the layers through a runner: build the model with "
                               "megadomino.build.build_model, or call "
                               "megadomino.overlap.apply(model, parallel)")
        x = self.run(x, rotary) if self.runner is None else self.runner(x, rotary)
        return x if self.final_layernorm is None else self.final_layernorm(x)
