"""Domino (arXiv 2409.15241): tensor-parallel communication hidden behind computation."""

from megadomino.domino.plan import DominoPlan, validate_plan

__all__ = ["DominoPlan", "validate_plan"]
