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


def _default_generator(stream: torch.Generator) -> torch.Generator:
    """The default generator of `stream`'s device (the one its fork swaps)."""
    if stream.device.type == "cuda":
        index = stream.device.index
        return torch.cuda.default_generators[torch.cuda.current_device() if index is None
                                             else index]
    return torch.default_generator


class RNGStatesTracker:
    """Named generator streams that `fork` swaps into the device's default generator.

    Each stream is a generator object of its own. On CUDA the swap is graph-safe: `fork` points
    the default generator at the stream's state (`Generator.graphsafe_set_state`) instead of
    copying seed and offset in and out through host tensors, so the draws inside a fork can be
    captured in a CUDA graph whose capture registered the streams (`generators()`), and each
    replay advances them as an eager call would. On CPU (whose generators have no graph-safe
    states) the state is copied in and out. Either way a stream draws exactly the numbers the
    same seed gives the default generator."""

    def __init__(self, device_type: str | None = None):
        self.device_type = device_type or _device_type()
        self.states: dict[str, torch.Generator] = {}

    def _generator(self, seed: int) -> torch.Generator:
        device = (torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda"
                  else torch.device("cpu"))
        return torch.Generator(device=device).manual_seed(seed)

    def add(self, name: str, seed: int) -> None:
        self.states[name] = self._generator(seed)

    def generators(self) -> list[torch.Generator]:
        """The streams' generators, for a CUDA graph capture to register."""
        return list(self.states.values())

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: generator.get_state() for name, generator in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Sets each named stream's state in place (a captured graph keeps drawing from the same
        generator objects); streams not named are dropped."""
        for name in list(self.states):
            if name not in states:
                del self.states[name]
        for name, state in states.items():
            if name not in self.states:
                self.states[name] = self._generator(0)
            self.states[name].set_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with the default generator drawing from the named stream."""
        if name not in self.states:
            raise RuntimeError(f"RNG stream {name!r} is not seeded: call model_parallel_seed()")
        stream = self.states[name]
        default = _default_generator(stream)
        if self.device_type == "cuda":
            original = default.graphsafe_get_state()
            default.graphsafe_set_state(stream)
            try:
                yield
            finally:
                default.graphsafe_set_state(original)
            return
        original = default.get_state()
        default.set_state(stream.get_state())
        try:
            yield
        finally:
            stream.set_state(default.get_state())
            default.set_state(original)


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
