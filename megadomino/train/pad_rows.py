"""The padding rows of vocabulary-sharded weights, kept at zero across checkpoint loads.

A vocabulary-parallel weight (the embedding, an untied output layer: parameters with a
`vocab_size` attribute) has `padded_vocab_size / tp` rows per TP rank; global rows at or past
`vocab_size` are padding. The loss gives them no gradient (`tp.cross_entropy`), so they stay
at the zero they start from. Checkpoints written while the padding columns still took part in
the softmax hold trained, non-zero padding rows (and AdamW moments, which would keep moving them):
a load zeroes those, in the weights, the fp32 masters and the optimizer state, and says so.
"""

from __future__ import annotations

import torch
from torch import nn


def first_pad_row(param: torch.Tensor, local_rows: int, tp_rank: int) -> int | None:
    """The first local row of this TP rank's shard (of `local_rows` rows) that is padding
    (`local_rows` when none is), or None when `param` is not vocabulary-sharded."""
    vocab = getattr(param, "vocab_size", None)
    if vocab is None:
        return None
    return max(0, min(local_rows, vocab - tp_rank * local_rows))


def without_pad_rows(local: torch.Tensor, param: torch.Tensor,
                     tp_rank: int) -> tuple[torch.Tensor, bool]:
    """(`local` with its padding rows zero, whether some were not), `local` being this rank's
    shard of `param` or a tensor of its shape (a master, an AdamW moment). `local` itself is
    never written (it may map a checkpoint file): a copy is returned when rows change."""
    first = first_pad_row(param, local.shape[0], tp_rank) if local.ndim else None
    if first is None or first == local.shape[0] or not local[first:].count_nonzero():
        return local, False
    local = local.clone()
    local[first:] = 0
    return local, True


@torch.no_grad()
def zero_pad_rows_in_zero_state_(engine, state: dict, tp_rank: int) -> bool:
    """Zero the padding rows inside a ZeRO engine's saved `state` (`engine.state_dict()`'s
    layout, before `engine.load_state_dict`): the flat fp32 master chunks and the AdamW moments of
    every optimizer piece that overlaps them. True when some were not zero."""
    live = [piece for group in engine.optimizer.optimizer.param_groups
            for piece in group["params"]]
    saved_state = state["optimizer"]["state"]
    nonzero = False
    for unit, master, saved_master in zip(engine.units, engine.optimizer.masters,
                                          state["masters"]):
        for span in _pad_spans(unit, tp_rank):
            region = saved_master[span]
            nonzero |= bool(region.count_nonzero())
            region.zero_()
            for index, piece in enumerate(live):
                if piece.untyped_storage().data_ptr() != master.untyped_storage().data_ptr():
                    continue
                begin = piece.storage_offset() - master.storage_offset()
                lo, hi = max(span.start, begin), min(span.stop, begin + piece.numel())
                for key, value in saved_state.get(index, {}).items():
                    if lo < hi and key != "step" and value.numel() == piece.numel():
                        moment = value.view(-1)[lo - begin:hi - begin]
                        nonzero |= bool(moment.count_nonzero())
                        moment.zero_()
    return nonzero


def _pad_spans(unit, tp_rank: int) -> list[slice]:
    """The padding elements of vocabulary-sharded parameters in `unit`, as slices of this DP
    rank's flat chunk."""
    spans = []
    for piece in unit.pieces:
        param: nn.Parameter = unit.params[piece.index]
        shape = unit.shapes[piece.index]
        first = first_pad_row(param, shape[0], tp_rank) if len(shape) else None
        if first is None or first == shape[0]:
            continue
        row = shape[1:].numel()
        pad_start = unit.offsets[piece.index] + first * row
        lo = max(pad_start, piece.start) - unit.shard_start
        hi = piece.end - unit.shard_start
        if lo < hi:
            spans.append(slice(lo, hi))
    return spans
