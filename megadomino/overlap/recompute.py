"""Full activation recompute as a runner of the layer stack (--recompute-granularity full), with
Megatron-LM's methods: 'uniform' checkpoints chunks of `num_layers` consecutive layers, 'block'
checkpoints each of the first `num_layers` layers and runs the rest as they are. A checkpointed
chunk keeps only its input and replays its forward (and its dropout masks: tp_random.checkpoint
restores both RNG streams) inside backward. Off in eval and without grad."""

from __future__ import annotations

import torch

from megadomino.distributed import random as tp_random


class FullRecompute:
    def __init__(self, block, method: str, num_layers: int):
        self.block, self.method, self.num_layers = block, method, num_layers

    def __call__(self, x: torch.Tensor, rotary) -> torch.Tensor:
        block = self.block
        if not (block.training and torch.is_grad_enabled()):
            return block.run(x, rotary)
        n, count = self.num_layers, len(block.layers)
        chunks = ([(start, min(start + n, count)) for start in range(0, count, n)]
                  if self.method == "uniform" else [(i, i + 1) for i in range(count)])
        rotary_args = tuple(rotary) if rotary is not None else ()
        for start, end in chunks:
            if self.method == "uniform" or start < n:
                x = tp_random.checkpoint(self._chunk(start, end), block.dims, x, *rotary_args)
            else:
                x = block.run(x, rotary, start, end)
        return x

    def _chunk(self, start: int, end: int):
        def run(x, *rotary):
            return self.block.run(x, rotary or None, start, end)
        return run
