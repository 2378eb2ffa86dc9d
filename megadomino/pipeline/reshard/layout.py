"""Where the pieces of a tensor live: a mesh of ranks (each on a host) and a layout over it.

A `Mesh` is a set of global ranks arranged row-major into mesh axes (`shape`), each rank on a
named host (ranks of one host share its network uplink). A `Layout` says, per tensor dim, which
mesh axes split it (major axis first); a mesh axis that splits no dim replicates. A rank's tile
is a `Box`: per tensor dim the half-open range [start, stop) it holds. Splits need not divide:
part i of n over a dim of size s starts at i*q + min(i, r) (q, r = divmod(s, n)), so the first r
parts hold one element more (`torch.tensor_split`'s rule) and parts beyond the size are empty.

Examples, a (seq, batch, hidden) activation on a 2-rank mesh: `Layout.replicated(mesh, 3)`; the
sequence-parallel shard `Layout.sharded(mesh, 3, dim=0)`; on a (2, 2) mesh of TP x batch-split DP,
`Layout(mesh, ((), (0,), (1,)))` splits the batch over axis 0 and the hidden dim over axis 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]
"""Per tensor dim the half-open range [start, stop) of a tile or slice."""


def part_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `parts` over `size` elements (first size % parts parts
    one longer; parts beyond `size` are empty)."""
    quotient, remainder = divmod(size, parts)
    start = index * quotient + min(index, remainder)
    return start, start + quotient + (index < remainder)


def box_intersection(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, None when it holds no element."""
    common = tuple((max(lo_a, lo_b), min(hi_a, hi_b)) for (lo_a, hi_a), (lo_b, hi_b) in zip(a, b))
    return common if all(lo < hi for lo, hi in common) else None


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def box_slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Index `box` of a tensor, or of the tile `origin` (box relative to the tile's start)."""
    offsets = [start for start, _ in origin] if origin is not None else [0] * len(box)
    return tuple(slice(start - off, stop - off) for (start, stop), off in zip(box, offsets))


@dataclass(frozen=True)
class Mesh:
    """Global ranks arranged row-major over mesh axes, each on a host.

    ranks: distinct global ranks; hosts: the host of each rank (same length); shape: the mesh
    axes' sizes, product len(ranks) (default: one axis)."""

    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "shape", tuple(self.shape) or (len(self.ranks),))
        if len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(f"mesh ranks {self.ranks} must be distinct and not empty")
        if len(self.hosts) != len(self.ranks):
            raise ValueError(f"mesh of {len(self.ranks)} ranks has {len(self.hosts)} hosts")
        if math.prod(self.shape) != len(self.ranks):
            raise ValueError(f"mesh shape {self.shape} does not hold {len(self.ranks)} ranks")

    def coords(self, rank: int) -> tuple[int, ...]:
        """The rank's index along each mesh axis (row-major: the last axis fastest)."""
        flat, coords = self.ranks.index(rank), []
        for size in reversed(self.shape):
            flat, index = divmod(flat, size)
            coords.append(index)
        return tuple(reversed(coords))


@dataclass(frozen=True)
class Layout:
    """A tensor laid out over `mesh`: dims[d] = the mesh axes splitting tensor dim d, major
    first (() = not split). Each axis splits at most one dim; unused axes replicate."""

    mesh: Mesh
    dims: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(tuple(axes) for axes in self.dims))
        used = [axis for axes in self.dims for axis in axes]
        if len(set(used)) != len(used) or any(not 0 <= a < len(self.mesh.shape) for a in used):
            raise ValueError(f"layout {self.dims}: each of the mesh's {len(self.mesh.shape)} "
                             "axes may split at most one tensor dim")

    @classmethod
    def replicated(cls, mesh: Mesh, ndim: int) -> Layout:
        return cls(mesh, ((),) * ndim)

    @classmethod
    def sharded(cls, mesh: Mesh, ndim: int, dim: int) -> Layout:
        """Tensor dim `dim` split over every rank of a one-axis mesh."""
        return cls(mesh, tuple((0,) if d == dim else () for d in range(ndim)))

    def tile(self, shape: tuple[int, ...], rank: int) -> Box:
        """The box of a `shape` tensor that `rank` holds."""
        if len(shape) != len(self.dims):
            raise ValueError(f"layout of {len(self.dims)} dims for a tensor of shape {shape}")
        coords = self.mesh.coords(rank)
        box = []
        for size, axes in zip(shape, self.dims):
            parts, index = 1, 0
            for axis in axes:  # mixed radix, the first axis most significant
                parts, index = parts * self.mesh.shape[axis], index * self.mesh.shape[axis]
                index += coords[axis]
            box.append(part_range(size, parts, index))
        return tuple(box)

    def tiles(self, shape: tuple[int, ...]) -> dict[Box, tuple[int, ...]]:
        """Every distinct non-empty tile -> the ranks holding it (its replicas, ascending), in
        the order of their first holder in the mesh."""
        holders: dict[Box, list[int]] = {}
        for rank in self.mesh.ranks:
            box = self.tile(shape, rank)
            if box_numel(box):
                holders.setdefault(box, []).append(rank)
        return {box: tuple(sorted(ranks)) for box, ranks in holders.items()}
