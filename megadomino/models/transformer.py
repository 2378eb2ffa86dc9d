"""TransformerLayer (one pre-norm block) and TransformerBlock (the stack, final norm, recompute).

A layer's forward is two residual lines; the parallel linears inside hide their collectives. With
Domino on (ParallelConfig.domino, a DominoPlan) the block hands its layers to the
Domino schedule (megadomino/domino/schedule.py), which runs the same weights and math in slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megadomino.config import FP8Recipe, ModelConfig, ParallelConfig
from megadomino.distributed import random as tp_random
from megadomino.domino.schedule import DominoRunner
from megadomino.models.blocks import MLP, Attention, build_norm


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, dims, parallel: ParallelConfig | None = None,
                 fp8: FP8Recipe | None = None, device=None):
        super().__init__()
        parallel = parallel or ParallelConfig()
        self.config, self.dims = config, dims
        self.sequence_parallel = parallel.sequence_parallel and dims.tp > 1
        sp = parallel.sequence_parallel
        self.input_layernorm = build_norm(config, sp, device)
        self.self_attention = Attention(config, dims, parallel, fp8, device)
        self.pre_mlp_layernorm = build_norm(config, sp, device)
        self.mlp = MLP(config, dims, parallel, fp8, device)

    def hidden_dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the residual stream. Replicated over TP ranks it uses the default generator
        (identical on every TP rank); sharded along the sequence, this rank's own stream."""
        p = self.config.hidden_dropout
        if not self.training or p == 0.0:
            return x
        if self.sequence_parallel:
            with tp_random.tracker_of(self.dims).fork():
                return F.dropout(x, p, training=True)
        return F.dropout(x, p, training=True)

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        # x: (s, b, h), or (s/tp, b, h) under sequence parallelism
        h = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), rotary))
        return h + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(h)))


class TransformerBlock(nn.Module):
    """The layer stack and the final norm, with Megatron's full-recompute methods:
    'uniform' checkpoints chunks of `recompute_num_layers` layers, 'block' checkpoints each of the
    first `recompute_num_layers` layers."""

    def __init__(self, config: ModelConfig, dims, parallel: ParallelConfig | None = None,
                 fp8: FP8Recipe | None = None, device=None):
        super().__init__()
        parallel = parallel or ParallelConfig()
        self.config, self.dims, self.parallel = config, dims, parallel
        self.layers = nn.ModuleList(
            TransformerLayer(config, dims, parallel, fp8, device)
            for _ in range(config.num_layers))
        self.final_layernorm = build_norm(config, parallel.sequence_parallel, device)
        # Not a submodule: the runner only schedules these layers.
        self.domino = DominoRunner(self, parallel.domino) if parallel.domino.enabled else None

    def _run(self, start: int, end: int):
        def run(x, *rotary):
            for layer in self.layers[start:end]:
                x = layer(x, rotary or None)
            return x
        return run

    @property
    def graphed_layers(self):
        """The CUDA-graphed layer stack (megadomino.models.cuda_graph), or None."""
        return self.__dict__.get("_graphed_layers")

    @graphed_layers.setter
    def graphed_layers(self, graphed) -> None:
        # a plain attribute, not a submodule: the layers are already registered here
        self.__dict__["_graphed_layers"] = graphed

    def forward(self, x: torch.Tensor, rotary=None) -> torch.Tensor:
        config = self.parallel
        if self.domino is not None:
            return self.final_layernorm(self.domino(x, rotary))
        rotary_args = tuple(rotary) if rotary is not None else ()
        graphed = self.graphed_layers
        if graphed is not None and self.training and torch.is_grad_enabled() \
                and graphed.matches((x, *rotary_args)):
            return self.final_layernorm(graphed(x, *rotary_args))
        if config.recompute_granularity == "full" and self.training:
            n, count = config.recompute_num_layers, len(self.layers)
            if config.recompute_method == "uniform":
                for start in range(0, count, n):
                    end = min(start + n, count)
                    x = tp_random.checkpoint(self._run(start, end), self.dims, x, *rotary_args)
            else:
                for i in range(count):
                    if i < n:
                        x = tp_random.checkpoint(self._run(i, i + 1), self.dims, x, *rotary_args)
                    else:
                        x = self._run(i, i + 1)(x, *rotary_args)
        else:
            x = self._run(0, len(self.layers))(x, *rotary_args)
        return self.final_layernorm(x)
