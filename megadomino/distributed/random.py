"""Tensor-parallel-consistent random numbers for dropout and init.

Two streams, as in Megatron-LM:
- the default generator, seeded `seed + 100 * pp_rank`: identical on every TP rank, so dropout on
  activations that every TP rank holds in full (no sequence parallelism) drops the same elements;
- the tracked 'model-parallel' stream, seeded `seed + 2718 + tp_rank`: different per TP rank, used
  inside `dims.rng.fork()` for dropout on sharded activations (attention probabilities of this
  rank's heads; the sequence shard under sequence parallelism).

`checkpoint` recomputes a function with both streams rewound, so that dropout under activation
recompute draws exactly the masks of the first forward.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped into the device's default generator."""

    def __init__(self, device_type: str | None = None):
        self.device_type = device_type or _device_type()
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        original = _get_state(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device_type)
        _set_state(self.device_type, original)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with the default generator swapped for the named stream."""
        if name not in self.states:
            raise RuntimeError(f"RNG stream {name!r} is not seeded: call model_parallel_seed()")
        original = _get_state(self.device_type)
        _set_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(self.device_type, original)


def model_parallel_seed(seed: int, dims) -> RNGStatesTracker:
    """Seed python, numpy, torch and the TP tracker; the tracker is stored as `dims.rng`."""
    default_seed = seed + 100 * dims.pp_rank
    random.seed(default_seed)
    np.random.seed(default_seed)
    torch.manual_seed(default_seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(default_seed)
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + dims.tp_rank)
    dims.rng = tracker
    return tracker


def tracker_of(dims) -> RNGStatesTracker:
    """The dims' tracker; if the user never seeded, one seeded from 1234 (the default generator
    is left alone)."""
    tracker = dims.rng
    if tracker is None:
        tracker = RNGStatesTracker()
        tracker.add(MODEL_PARALLEL_RNG, 1234 + 2718 + dims.tp_rank)
        dims.rng = tracker
    return tracker


def checkpoint(function, dims, *args):
    """Activation recompute that also rewinds the model-parallel RNG stream for the recompute.

    torch's checkpoint restores the default generator; this wrapper restores the tracked streams
    to their state at the first forward, and puts them back afterwards.
    """
    tracker = tracker_of(dims)
    snapshot = tracker.get_states()
    calls = [0]

    def run(*inputs):
        calls[0] += 1
        if calls[0] == 1:
            return function(*inputs)
        current = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            return function(*inputs)
        finally:
            tracker.set_states(current)

    return torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
