"""The process grid and its collectives: `ParallelDims` (the rank grid, every group), the TP
collectives as autograd Functions (`mappings`), the TP RNG tracker (`random`), gradient-hook
streams (`streams`) and `comm`, through which every collective and point-to-point call of the
package goes (tensors placed on the group's device, one work a P2P batch on every backend)."""

from megadomino.distributed.dims import ParallelDims

__all__ = ["ParallelDims"]
