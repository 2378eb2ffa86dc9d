"""`--load` of a Megatron-LM checkpoint: the iteration directory's files say which format it is
(ours, Megatron-LM's `torch_dist` or its legacy `torch`), as Megatron-LM's
--auto-detect-ckpt-format reads them; `megadomino.interop.megatron_load` reads the weights.

A Megatron-LM checkpoint resumes the weights, the iteration (the LR schedule's position) and
the consumed samples; its optimizer and RNG states are not read (one notice says so): the
optimizer starts fresh and the RNG streams come from --seed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from megadomino.distributed import ParallelDims, comm
from megadomino.interop.megatron import MegatronCheckpointError, megatron_format
from megadomino.interop.megatron_load import MegatronCounters, load_megatron, unused_error
from megadomino.train.checkpoint.files import CheckpointError, agree


def detect_megatron(source: Path) -> str | None:
    """'torch_dist' or 'torch' for a Megatron-LM checkpoint, None for ours. Collective over the
    world: every rank raises the same CheckpointError for a format that is not read."""
    kind, error = None, None
    try:
        kind = megatron_format(source)
    except MegatronCheckpointError as err:
        error = str(err)
    agree(error)
    return kind


def load_megatron_checkpoint(source: Path, model: nn.Module, dims: ParallelDims, *,
                             only_weights: bool,
                             log: Callable[[str], None]) -> MegatronCounters:
    """Load the Megatron-LM checkpoint `source` into `model` and return its counters.
    Collective over the world: every rank raises the same CheckpointError when any rank could
    not load it."""
    counters, error = None, None
    try:
        counters = load_megatron(source, model, dims, part=dims.pp > 1)
    except MegatronCheckpointError as err:
        error = str(err)
    agree(error)
    if dims.pp > 1:  # each stage took its own tensors: together they must take every one
        unused = frozenset.intersection(*comm.all_gather_object(counters.unused))
        if unused:
            raise CheckpointError(str(unused_error(source, unused)))
    if dims.rank == 0:
        log(f" loaded Megatron-LM {counters.format} checkpoint {source} (iteration "
            f"{counters.iteration})" + (" as weights only" if only_weights else "")
            + "; notice: its optimizer and RNG states are not read (the optimizer starts "
            "fresh, the RNG streams come from --seed)")
    return counters
