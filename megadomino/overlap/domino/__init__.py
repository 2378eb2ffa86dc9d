"""Domino (arXiv 2409.15241): tensor-parallel communication hidden behind computation. Its plan
(DominoPlan) is a section of the configuration (megadomino.config.ParallelConfig.domino)."""

from megadomino.config import DominoPlan

__all__ = ["DominoPlan"]
