"""The process grid and its collectives: `ParallelDims` (the rank grid, every group), the TP
collectives as autograd Functions (`mappings`), the TP RNG tracker (`random`), gradient-hook
streams (`streams`) and torch version shims (`compat`)."""

from megadomino.distributed.dims import ParallelDims

__all__ = ["ParallelDims"]
