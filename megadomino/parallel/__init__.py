"""Tensor-parallel building blocks: ParallelDims, the f/g collectives, parallel layers."""

from megadomino.parallel.dims import ParallelDims

__all__ = ["ParallelDims"]
