"""--fp8-param-gather: the weights of the FP8 linears all-gathered as 1-byte e4m3 codes instead of
bf16 (Megatron-LM's flag of the same name), at ZeRO stages 1 (after each step) and 3 (each
gather from the primary shards).

Scales. A weight W [N, K] of an FP8 linear is cast with one scale, s = 448 / amax(W), the amax
of the whole (TP-local) weight: each DP rank takes the amax of its part, and one max all-reduce
over DP per step (`Scales.compute`, every unit's FP8 weights in one vector) gives every rank the
same s. Each rank casts its part of W with s (tp.fp8.quantize: the linear's own rounding), and
the receivers dequantize, q / s, into the unit's flat buffer in the parameters' dtype. The linear
then casts W with current scaling (FP8State.weight_current_scaling) and gets the gathered codes
back exactly (tp/fp8.py says why), so W is rounded to FP8 once, as without the gather.

Payload. A rank's shard [S] (of the flat layout, partition.FlatUnit) goes as one uint8 row:

    [ codes: S bytes | other: n_other elements of the parameters' dtype ]     (each 16-aligned)

codes[i] is element i's e4m3 code where element i belongs to an FP8 weight (0 elsewhere); `other`
holds, back to back, the shard's elements of every other parameter (biases, norms, embeddings),
unrounded; n_other is the largest such count over the ranks, so every row has one size. A unit
without FP8 weights is gathered in its dtype as usual (`FP8Layout.of` returns None). The rows of
all ranks concatenated, codes first, are the unit's codes in flat order, so decoding is one
copy of the codes and, per parameter, one dequantizing (FP8) or copying (other) slice.

What moves: a layer unit's row is S bytes plus its biases and norms, against 2 S bytes in bf16.
The engine's exact gathers (checkpoints, `materialize`) stay in the parameters' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megadomino.config.train import E4M3
from megadomino.distributed import comm as dist_comm
from megadomino.tp.fp8 import FP8_MAX, FP8State, quantize
from megadomino.zero.collectives import CommCounter, Pending
from megadomino.zero.partition import FlatUnit

_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Slice:
    """Elements [flat_lo, flat_hi) of the unit's flat buffer, held by rank `rank` at `offset` of
    its shard (FP8 weights) or of its `other` section (other parameters)."""

    param: int
    rank: int
    flat_lo: int
    flat_hi: int
    offset: int


class FP8Layout:
    """One unit's payload layout over `dp` ranks (module docstring), seen from `dp_rank`."""

    def __init__(self, unit: FlatUnit, fp8_params: list[int], dp: int, dp_rank: int,
                 dtype: torch.dtype):
        self.unit, self.dp, self.dp_rank, self.dtype = unit, dp, dp_rank, dtype
        self.fp8_params = fp8_params
        """Indices into unit.params of the FP8 weights, in flat order."""
        size = unit.shard_numel
        self.fp8_slices: list[_Slice] = []
        self.other_slices: list[_Slice] = []
        other_counts = [0] * dp
        for index, (shape, start) in enumerate(zip(unit.shapes, unit.offsets)):
            end = start + shape.numel()  # not the parameter's: empty outside use at stage 3
            for rank in range(start // size if size else 0, dp):
                lo, hi = max(start, rank * size), min(end, (rank + 1) * size)
                if lo >= hi:
                    break
                if index in fp8_params:
                    self.fp8_slices.append(_Slice(index, rank, lo, hi, lo - rank * size))
                else:
                    self.other_slices.append(_Slice(index, rank, lo, hi, other_counts[rank]))
                    other_counts[rank] += hi - lo
        self.n_other = max(other_counts)
        self.codes_bytes = _aligned(size)
        self.other_bytes = _aligned(self.n_other * torch.empty(0, dtype=dtype).element_size())
        self.row_bytes = self.codes_bytes + self.other_bytes

    @classmethod
    def of(cls, unit: FlatUnit, fp8_weights: set[int], dp: int, dp_rank: int,
           dtype: torch.dtype) -> FP8Layout | None:
        """The layout of `unit`, or None when it holds none of `fp8_weights` (parameter ids)."""
        fp8_params = [i for i, p in enumerate(unit.params) if id(p) in fp8_weights]
        return cls(unit, fp8_params, dp, dp_rank, dtype) if fp8_params else None

    def own_amaxes(self, shard: torch.Tensor) -> torch.Tensor:
        """fp32 [len(fp8_params)]: the amax of this rank's part of each FP8 weight (0 where it
        holds none)."""
        amaxes = torch.zeros(len(self.fp8_params), dtype=torch.float32, device=shard.device)
        for piece in self.fp8_slices:
            if piece.rank == self.dp_rank:
                part = shard[piece.offset:piece.offset + piece.flat_hi - piece.flat_lo]
                slot = self.fp8_params.index(piece.param)
                amaxes[slot] = torch.maximum(amaxes[slot], part.abs().amax().float())
        return amaxes

    def encode(self, shard: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """This rank's payload row, uint8 [row_bytes], from its shard [S] and the FP8 weights'
        scales [len(fp8_params)]."""
        row = torch.zeros(self.row_bytes, dtype=torch.uint8, device=shard.device)
        codes = row[:self.codes_bytes].view(E4M3)
        other = row[self.codes_bytes:].view(self.dtype)
        for piece in self.fp8_slices:
            if piece.rank == self.dp_rank:
                span = slice(piece.offset, piece.offset + piece.flat_hi - piece.flat_lo)
                scale = scales[self.fp8_params.index(piece.param)]
                codes[span] = quantize(shard[span], scale, E4M3)
        start = self.dp_rank * self.unit.shard_numel
        for piece in self.other_slices:
            if piece.rank == self.dp_rank:
                n = piece.flat_hi - piece.flat_lo
                other[piece.offset:piece.offset + n] = shard[piece.flat_lo - start:
                                                             piece.flat_hi - start]
        return row

    def decode(self, rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's row, uint8 [dp, row_bytes], into `out` [padded_numel] of the parameters'
        dtype (padding left as it is)."""
        codes = rows[:, :self.unit.shard_numel].reshape(-1).view(E4M3)  # flat order
        for slot, index in enumerate(self.fp8_params):
            start = self.unit.offsets[index]
            end = start + self.unit.shapes[index].numel()
            out[start:end].copy_(codes[start:end]).mul_(scales[slot].reciprocal())
        other = rows[:, self.codes_bytes:].view(self.dtype)
        for piece in self.other_slices:
            n = piece.flat_hi - piece.flat_lo
            out[piece.flat_lo:piece.flat_hi] = other[piece.rank, piece.offset:piece.offset + n]


class Scales:
    """The FP8 weights' scales for the current weights, made once after each step (one max
    all-reduce over DP for every unit) and dropped by `clear()` when the weights change."""

    def __init__(self, layouts: list[FP8Layout | None], group, counter: CommCounter):
        self.layouts, self.group, self.counter = layouts, group, counter
        self.per_unit: list[torch.Tensor | None] | None = None

    def clear(self) -> None:
        self.per_unit = None

    def get(self, shards: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Per unit, fp32 [len(fp8_params)] (None for a unit without FP8 weights); collective
        over DP the first time after a clear()."""
        if self.per_unit is None:
            present = [(i, layout) for i, layout in enumerate(self.layouts) if layout is not None]
            amaxes = torch.cat([layout.own_amaxes(shards[i]) for i, layout in present])
            self.counter.all_reduce(amaxes, self.group, "scalars", op=dist_comm.ReduceOp.MAX)
            scales = torch.where(amaxes > 0, FP8_MAX[E4M3] / amaxes, torch.ones_like(amaxes))
            self.per_unit = [None] * len(self.layouts)
            sizes = [len(layout.fp8_params) for _, layout in present]
            for (i, _), part in zip(present, scales.split(sizes)):
                self.per_unit[i] = part
        return self.per_unit


def all_gather_fp8(counter: CommCounter, layout: FP8Layout, payload: torch.Tensor,
                   scales: torch.Tensor, group, tag: str,
                   out: torch.Tensor | None = None) -> Pending:
    """Launch the all-gather of this rank's `payload` row (layout.encode); wait() -> the unit's
    flat buffer [padded_numel] decoded into `out` (a new buffer if None)."""
    rows = payload.new_empty(layout.dp, layout.row_bytes)
    work = counter.all_gather(rows.view(-1), payload, group, tag, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        full = out if out is not None else torch.zeros(layout.unit.padded_numel,
                                                       dtype=layout.dtype, device=rows.device)
        layout.decode(rows, scales, full)
        return full
    return Pending(finish)


def adopt_fp8_weights(model: nn.Module) -> set[int]:
    """The ids of the weights of `model`'s FP8 linears, whose FP8State this switches to current
    scaling for the weight (the role the gather rounds, see tp/fp8.py)."""
    ids = set()
    for module in model.modules():
        state = getattr(module, "fp8_state", None)
        if isinstance(state, FP8State):
            state.weight_current_scaling = True
            ids.add(id(module.weight))
    return ids
