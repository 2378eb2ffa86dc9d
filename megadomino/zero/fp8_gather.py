"""--fp8-param-gather: the weights of the FP8 linears all-gathered as 1-byte e4m3 codes instead of
bf16 (Megatron-LM's flag of the same name), at ZeRO stages 1 (after each step) and 3 (each
gather), and used as gathered by the linears' FP8 GEMMs.

Scales. A weight W [N, K] of an FP8 linear is cast with one scale, s = 448 / amax(W), the amax
of the whole (TP-local) weight: each DP rank takes the amax of its part, and one max all-reduce
over DP per step (`Scales.get`, every unit's FP8 weights in one vector) gives every rank the same
s. Each rank casts its part of W with s (tp.fp8.quantize, the linear's own rounding) from the
exact shard the optimizer wrote. The codes and s are what the linear's GEMMs take
(FP8State.gathered_weight): the weight is rounded to FP8 once, with the scale the linear's
current scaling of the whole weight would give it, bit for bit (the linear's own cast, without a
gather, under --fp8-recipe tensorwise gives the same codes and scale), and the linear's per-step
amax and cast of W are skipped. Under the delayed recipe the weights are scaled so, from their
current amax; inputs and gradients keep the recipe.

Payload. A rank's shard [S] (of the flat layout, partition.FlatUnit) goes as two all-gathers:
its codes, uint8 [S] (element i's e4m3 code where element i belongs to an FP8 weight, 0
elsewhere), gathered straight into the unit's codes in flat order, [dp * S]; and its elements of
every other parameter (biases, norms), unrounded, back to back, padded to the largest such count
over the ranks, [n_other], decoded into the unit's flat buffer in the parameters' dtype. The
flat buffer's FP8-weight elements are not written by these gathers (stage 3: left as allocated;
stage 1: the values of the last exact gather): the weights' readers besides the linears gather
exactly first (checkpoints: `materialize`). A unit without FP8 weights is gathered in its dtype
as usual (`FP8Layout.of` returns None).
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


@dataclass(frozen=True)
class _Slice:
    """Elements [flat_lo, flat_hi) of the unit's flat buffer, held by rank `rank` at `offset` of
    its shard (FP8 weights) or of its `other` payload (other parameters)."""

    param: int
    rank: int
    flat_lo: int
    flat_hi: int
    offset: int


class FP8Layout:
    """One unit's payloads over `dp` ranks (module docstring), seen from `dp_rank`, and the
    FP8States its gathered codes are handed to."""

    def __init__(self, unit: FlatUnit, fp8_states: dict[int, FP8State], dp: int, dp_rank: int,
                 dtype: torch.dtype):
        """`fp8_states`: unit parameter index -> the FP8State of the linear that weight is."""
        self.unit, self.dp, self.dp_rank, self.dtype = unit, dp, dp_rank, dtype
        self.fp8_params = sorted(fp8_states)
        """Indices into unit.params of the FP8 weights, in flat order."""
        self.states = [fp8_states[index] for index in self.fp8_params]
        self.codes: torch.Tensor | None = None
        """The unit's gathered codes while handed to the linears (`publish`)."""
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
                if index in fp8_states:
                    self.fp8_slices.append(_Slice(index, rank, lo, hi, lo - rank * size))
                else:
                    self.other_slices.append(_Slice(index, rank, lo, hi, other_counts[rank]))
                    other_counts[rank] += hi - lo
        self.n_other = max(other_counts)
        self.slot = {index: slot for slot, index in enumerate(self.fp8_params)}
        self.own_fp8 = [piece for piece in self.fp8_slices if piece.rank == dp_rank]
        self.own_other = [piece for piece in self.other_slices if piece.rank == dp_rank]

    @classmethod
    def of(cls, unit: FlatUnit, fp8_states: dict[int, FP8State], dp: int, dp_rank: int,
           dtype: torch.dtype) -> FP8Layout | None:
        """The layout of `unit`, or None when it holds none of `fp8_states`' weights (keyed by
        parameter id)."""
        mine = {i: fp8_states[id(p)] for i, p in enumerate(unit.params) if id(p) in fp8_states}
        return cls(unit, mine, dp, dp_rank, dtype) if mine else None

    def own_amaxes(self, shard: torch.Tensor) -> torch.Tensor:
        """fp32 [len(fp8_params)]: the amax of this rank's part of each FP8 weight (0 where it
        holds none)."""
        amaxes = torch.zeros(len(self.fp8_params), dtype=torch.float32, device=shard.device)
        for piece in self.own_fp8:
            part = shard[piece.offset:piece.offset + piece.flat_hi - piece.flat_lo]
            slot = self.slot[piece.param]
            amaxes[slot] = torch.maximum(amaxes[slot], part.abs().amax().float())
        return amaxes

    def encode(self, shard: torch.Tensor,
               scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's payloads from its shard [S] and the FP8 weights' scales: (codes, uint8
        [S]; other parameters' elements, [n_other] in the parameters' dtype)."""
        codes = torch.zeros(self.unit.shard_numel, dtype=torch.uint8, device=shard.device)
        other = torch.zeros(self.n_other, dtype=self.dtype, device=shard.device)
        for piece in self.own_fp8:
            span = slice(piece.offset, piece.offset + piece.flat_hi - piece.flat_lo)
            scale = scales[self.slot[piece.param]]
            codes[span] = quantize(shard[span], scale, E4M3).view(torch.uint8)
        start = self.dp_rank * self.unit.shard_numel
        for piece in self.own_other:
            n = piece.flat_hi - piece.flat_lo
            other[piece.offset:piece.offset + n] = shard[piece.flat_lo - start:
                                                         piece.flat_hi - start]
        return codes, other

    def decode_other(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's other-parameter payload, [dp, n_other], into `out` [padded_numel]."""
        for piece in self.other_slices:
            n = piece.flat_hi - piece.flat_lo
            out[piece.flat_lo:piece.flat_hi] = rows[piece.rank, piece.offset:piece.offset + n]

    def publish(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Hand each FP8 weight's codes (views of the unit's gathered codes, [dp * S] uint8) and
        the inverse of its scale to its linear."""
        self.codes = codes
        inverse = scales.reciprocal()
        for slot, (index, state) in enumerate(zip(self.fp8_params, self.states)):
            start = self.unit.offsets[index]
            shape = self.unit.shapes[index]
            weight = codes[start:start + shape.numel()].view(E4M3).view(shape)
            # cuBLASLt refuses (CUBLAS_STATUS_NOT_SUPPORTED) FP8 operands and scales whose
            # pointers are not 16-byte aligned: the scale gets storage of its own, and a weight
            # at an unaligned offset of the codes an aligned copy.
            if start % 16:
                weight = weight.clone()
            state.gathered_weight = (weight, inverse[slot].clone())

    def unpublish(self) -> None:
        """The linears cast their weights themselves again (the codes are freed)."""
        self.codes = None
        for state in self.states:
            state.gathered_weight = None


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


def all_gather_fp8(counter: CommCounter, layout: FP8Layout,
                   payload: tuple[torch.Tensor, torch.Tensor], scales: torch.Tensor, group,
                   tag: str, out: torch.Tensor | None = None,
                   codes: torch.Tensor | None = None) -> Pending:
    """Launch the all-gathers of this rank's payloads (layout.encode); wait() -> the unit's flat
    buffer [padded_numel] with the other parameters decoded into it (`out`, or a new buffer),
    the codes ([dp * S] uint8: `codes`, or a new buffer) handed to the linears."""
    own_codes, own_other = payload
    codes = codes if codes is not None else own_codes.new_empty(layout.dp * own_codes.numel())
    rows = own_other.new_empty(layout.dp, layout.n_other)
    works = [counter.all_gather(codes, own_codes, group, tag, async_op=True)]
    if layout.n_other:
        works.append(counter.all_gather(rows.view(-1), own_other, group, tag, async_op=True))

    def finish() -> torch.Tensor:
        for work in works:
            work.wait()
        full = out if out is not None else torch.empty(layout.unit.padded_numel,
                                                       dtype=layout.dtype, device=rows.device)
        layout.decode_other(rows, full)
        layout.publish(codes, scales)
        return full
    return Pending(finish)


def adopt_fp8_weights(model: nn.Module) -> dict[int, FP8State]:
    """The weights of `model`'s FP8 linears (by parameter id) and their FP8States, which this
    switches to current scaling for the weight: the scaling the gathered codes carry, so that a
    forward without them (before the first gather) casts the weight the same way."""
    states = {}
    for module in model.modules():
        state = getattr(module, "fp8_state", None)
        if isinstance(state, FP8State):
            state.weight_current_scaling = True
            states[id(module.weight)] = state
    return states
