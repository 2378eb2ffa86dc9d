"""How the layer stack runs: the execution strategies handed to a TransformerBlock as its runner
(full activation recompute, Domino's schedule, CUDA graphs). The models define the layers and run
them one after the other; what runs them otherwise lives here and drives the models, never the
reverse.

    apply(model, parallel)          # the runner ParallelConfig asks for (recompute / Domino)
    capture_layers(model, mbs)      # CUDA graphs over the current runner (overlap.cuda_graph)
"""

from __future__ import annotations

from megadomino.config import ParallelConfig
from megadomino.overlap.domino.schedule import DominoRunner
from megadomino.overlap.recompute import FullRecompute


def apply(model, parallel: ParallelConfig) -> None:
    """Install on `model.decoder` the runner `parallel` asks for: Domino's schedule when its plan
    is enabled (it recomputes by itself), full recompute, or none (layers in order)."""
    block = model.decoder
    if parallel.domino.enabled:
        block.runner = DominoRunner(block, parallel.domino)
    elif parallel.recompute_granularity == "full":
        block.runner = FullRecompute(block, parallel.recompute_method,
                                     parallel.recompute_num_layers)
    else:
        block.runner = None


__all__ = ["apply"]
