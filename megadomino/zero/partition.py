"""Units and their flat layout: what is gathered, reduced and sharded together.

A unit is consecutive layers (children of an `nn.ModuleList`, e.g. `decoder.layers[i]`): as many
as hold `ZeroConfig.unit_params` parameters by default, or `ZeroConfig.layers_per_unit`. Or it is
the root: every parameter that is not used by exactly one layer (embeddings, the tied output
weight, final norm).
Stage 3 gathers a unit just before it runs; both stages reduce-scatter a unit's gradients as one
flat buffer once all of them have arrived.

A unit's parameters (this rank's TP shards, in registration order) are laid out back to back in
one flat buffer of `numel` elements, padded with zeros to `padded_numel`, the next multiple of
dp; DP rank r owns the contiguous chunk [r * shard_numel, (r + 1) * shard_numel).
Layouts are identical on every DP rank and, the local shapes being equal, on every TP rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch._utils import _unflatten_dense_tensors


@dataclass(frozen=True)
class Piece:
    """The part [start, end) (flat coordinates) of parameter `index` that lies in this rank's
    shard; `shard_start` is `start` relative to the shard."""

    index: int
    start: int
    end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatUnit:
    """The flat layout of `params` over a DP group of `dp` ranks, seen from DP rank `dp_rank`."""

    def __init__(self, name: str, params: list[nn.Parameter], dp: int, dp_rank: int):
        self.name = name
        self.params = params
        self.shapes = [p.shape for p in params]
        self._templates = [torch.empty(shape, device="meta") for shape in self.shapes]
        self._empty = [index for index, shape in enumerate(self.shapes) if shape.numel() == 0]
        self.offsets: list[int] = []
        offset = 0
        for param in params:
            self.offsets.append(offset)
            offset += param.numel()
        self.numel = offset
        self.padded_numel = -(-offset // dp) * dp
        self.shard_numel = self.padded_numel // dp
        self.shard_start = dp_rank * self.shard_numel
        shard_end = self.shard_start + self.shard_numel
        self.pieces = []
        for index, (param, start) in enumerate(zip(params, self.offsets)):
            lo, hi = max(start, self.shard_start), min(start + param.numel(), shard_end)
            if lo < hi:
                self.pieces.append(Piece(index, lo, hi, lo - self.shard_start))

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """[padded_numel] of `dtype`: the tensors (one per parameter) back to back, zero padded."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=tensors[0].device)
        for tensor, start in zip(tensors, self.offsets):
            flat[start:start + tensor.numel()].copy_(tensor.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per parameter, its view (in its shape) into a [padded_numel] flat buffer."""
        # One C++ call instead of a slice and a view per parameter (called per gather and per
        # gradient buffer: per-parameter Python work is what a small-batch step waits on).
        views = list(_unflatten_dense_tensors(flat, self._templates))
        for index in self._empty:  # unflatten gives those a fresh [0] tensor, not a view
            views[index] = flat[:0].view(self.shapes[index])
        return views

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a [padded_numel] flat buffer (a view)."""
        return flat[self.shard_start:self.shard_start + self.shard_numel]


def idle_dp_rank(numels: list[int], dp: int) -> int | None:
    """The first DP rank that would hold no parameter, its chunk of every unit (of `numels`
    elements) being padding, or None when every rank holds some: rank r holds a piece of a unit
    of n elements iff r * ceil(n / dp) < n, so the ranks past an idle one are idle too."""
    for rank in range(dp):
        if not any(rank * -(-numel // dp) < numel for numel in numels):
            return rank
    return None


def find_buckets(model: nn.Module, bucket_numel: int) -> list[tuple[str, list[nn.Parameter]]]:
    """Stage 0's units: [(name, trainable params)] in registration order, cut into buckets of
    about `bucket_numel` elements (Megatron's DDP buckets). Cuts are made walking the parameters
    backwards, the order backward produces their gradients: a bucket closes once it holds
    `bucket_numel` elements, so the last parameters' bucket (reduced first) is full and the
    first parameters' may be smaller. Inside a bucket the parameters keep registration order."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    buckets, members, count = [], [], 0
    for param in reversed(params):
        members.append(param)
        count += param.numel()
        if count >= bucket_numel:
            buckets.append(members[::-1])
            members, count = [], 0
    if members:
        buckets.append(members[::-1])
    return [(f"bucket{index}", bucket) for index, bucket in enumerate(buckets[::-1])]


def find_units(model: nn.Module, layers_per_unit: int | None = 1, unit_params: int = 0,
               min_units: int = 1) -> list[tuple[str, tuple[nn.Module, ...], list[nn.Parameter]]]:
    """[(name, modules, trainable params)]: the root first, (model,), then every layer (a child of
    an outermost nn.ModuleList) in registration order, which is the order the models run them.
    A parameter belongs to a layer only if every use of it registered in the model is inside
    that layer; shared ones go to the root, which stays gathered through forward and backward.
    `layers_per_unit` > 1 makes each unit that many consecutive layers of one ModuleList (the
    last one of a list may have fewer), named 'list.first-last': their modules in run order, their
    parameters back to back (ZeroConfig.layers_per_unit). `layers_per_unit` None: each unit takes
    consecutive layers of one list until it holds at least `unit_params` parameters or 1 /
    `min_units` of the list's layers (at least one), whichever comes first; the last one of a
    list may hold fewer (ZeroConfig.unit_params, ZeroConfig.min_units)."""
    layers: list[tuple[str, nn.Module]] = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(p + ".") for p in inside):
            inside.add(name)
            layers += [(f"{name}.{child}", layer) for child, layer in module.named_children()]
    owner: dict[int, str | None] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        layer = next((prefix for prefix, _ in layers if name.startswith(prefix + ".")), None)
        if id(param) in owner and owner[id(param)] != layer:
            layer = None
        owner[id(param)] = layer
    root, units = [], []
    for prefix, module in [("", model)] + layers:
        seen: set[int] = set()
        params = []
        for param in model.parameters() if prefix == "" else module.parameters():
            if param.requires_grad and owner[id(param)] == (prefix or None) \
                    and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        if params:
            (units if prefix else root).append((prefix or "<root>", (module,), params))
    return root + _group_layers(units, layers_per_unit, unit_params, min_units)


def _group_layers(units: list, layers_per_unit: int | None, unit_params: int,
                  min_units: int) -> list:
    """Consecutive layer units of one ModuleList merged `layers_per_unit` at a time, or (None)
    until a run holds `unit_params` parameters or 1 / `min_units` of the list's layers."""
    if layers_per_unit == 1:
        return units
    grouped = []
    for _, same_list in itertools.groupby(units, key=lambda unit: unit[0].rsplit(".", 1)[0]):
        same_list = list(same_list)
        most = layers_per_unit or max(1, len(same_list) // min_units)
        runs, run, count = [], [], 0
        for unit in same_list:
            run.append(unit)
            count += sum(p.numel() for p in unit[2])
            if len(run) == most or (layers_per_unit is None and count >= unit_params):
                runs.append(run)
                run, count = [], 0
        runs += [run] if run else []
        for run in runs:
            name = run[0][0] if len(run) == 1 else f"{run[0][0]}-{run[-1][0].rsplit('.', 1)[-1]}"
            grouped.append((name, tuple(m for _, modules, _ in run for m in modules),
                            [p for _, _, params in run for p in params]))
    return grouped
