"""megadomino: Megatron-style tensor-parallel LLM training with Domino overlap and ZeRO++."""

__version__ = "0.1.0"
