"""The Domino slicing plan: N batch slices x K hidden (ffn) slices, its validation, and the
start-up auto-tuner.

Batch slices may be uneven: b=5, N=2 gives sizes [3, 2] (the first b % N slices get one more).
Hidden slices cut this rank's ffn columns into K equal chunks (K must divide ffn / tp).
"""

from __future__ import annotations

from dataclasses import dataclass

from megadomino.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class DominoPlan:
    batch_slices: int = 1
    hidden_slices: int = 1
    explicit_backward: bool = False
    """Run Domino's schedule even unsliced (ModelConfig.domino_explicit_backward)."""

    @classmethod
    def from_config(cls, config: ModelConfig) -> DominoPlan:
        return cls(config.domino_batch_slices, config.domino_hidden_slices,
                   config.domino_explicit_backward)

    @property
    def enabled(self) -> bool:
        return self.explicit_backward or self.batch_slices > 1 or self.hidden_slices > 1

    def slice_sizes(self, batch: int) -> list[int]:
        """Sizes of the batch slices for a micro-batch of `batch` sequences."""
        if self.batch_slices > batch:
            raise ConfigError(
                f"--domino-batch-slices={self.batch_slices} is invalid: it must be at most the "
                f"micro-batch size ({batch})")
        base, extra = divmod(batch, self.batch_slices)
        return [base + (1 if i < extra else 0) for i in range(self.batch_slices)]


def validate_plan(config: ModelConfig, tp: int, micro_batch_size: int) -> None:
    """Refuse a plan that cannot run, naming the flag (call before any collective)."""
    plan = DominoPlan.from_config(config)
    if plan.batch_slices < 1:
        raise ConfigError(f"--domino-batch-slices={plan.batch_slices} is invalid: it must be >= 1")
    plan.slice_sizes(micro_batch_size)
    ffn_local = config.ffn_hidden_size // tp
    if plan.hidden_slices < 1 or ffn_local % plan.hidden_slices != 0:
        raise ConfigError(
            f"--domino-hidden-slices={plan.hidden_slices} is invalid: it must divide the per-rank "
            f"ffn size ({config.ffn_hidden_size} / tp {tp} = {ffn_local})")
