"""ZeRO stage 1 / 3 over the data-parallel group, with ZeRO++'s quantized weights (qwZ),
hierarchical partitioning (hpZ) and quantized gradients (qgZ): `ZeroPlusPlus(model, dims,
optimizer_factory, ZeroConfig(...))`. See optimizer.py for how a training loop drives it, and
diloco.py for DiLoCo's outer optimizer across sites of data-parallel ranks."""

from megadomino.config import ZeroConfig
from megadomino.zero.collectives import CommCounter
from megadomino.zero.optimizer import ZeroPlusPlus

__all__ = ["CommCounter", "ZeroConfig", "ZeroPlusPlus"]
