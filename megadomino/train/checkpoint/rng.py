"""Every random generator of a rank, captured and restored: python, numpy, torch CPU, CUDA and
the TP tracker (`dims.rng`), in types that torch.load(weights_only=True) accepts."""

from __future__ import annotations

import random

import numpy as np
import torch

from megadomino.distributed import ParallelDims
from megadomino.distributed.random import tracker_of


def capture_rng_state(dims: ParallelDims) -> dict:
    """Every generator of this rank, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "random": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tracker_of(dims).get_states(),
    }


def restore_rng_state(state: dict, dims: ParallelDims) -> None:
    random.setstate(_as_tuples(state["random"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker_of(dims).set_states(state["tracker"])


def _as_tuples(value):
    """random.setstate wants the tuples getstate gave; a round trip may turn them into lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
