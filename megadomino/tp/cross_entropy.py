"""Vocab-parallel cross-entropy: the loss over logits sharded along the vocabulary, in fp32,
without ever gathering the logits (Megatron-LM's scheme: three small all-reduces of [s, b]).

Padding columns (global ids at or above `vocab_size`, the rows Megatron's vocabulary padding adds
so that the table splits evenly) take no part: they are left out of the max and of the softmax's
sum, so the loss equals the cross-entropy of the unpadded logits at every TP degree, and their
gradient is exactly zero (the padding rows of the output layer are never trained).

With `--compile-layer-pieces` the forward and backward are three compiled element-wise pieces
around the collectives (the shard's max; each label's logit and the sum of exponentials; the
gradient, recomputing the softmax): the loss reads the (tokens, V/tp) logits three times in their
own dtype and writes their gradient once, with no fp32 copy of them kept. Eagerly (the reference)
it keeps an fp32 softmax for the backward, as Megatron-LM's does.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megadomino.distributed import comm
from megadomino.distributed.mappings import all_reduce


def _shard_max(logits: torch.Tensor, real: int) -> torch.Tensor:
    """Max over this shard's real columns, fp32 (..., ); -inf where the shard is all padding."""
    if real == 0:
        return logits.new_full(logits.shape[:-1], float("-inf"), dtype=torch.float32)
    return logits[..., :real].amax(dim=-1).float()


def _target_and_sum_exp(logits: torch.Tensor, logits_max: torch.Tensor,
                        local_labels: torch.Tensor, outside: torch.Tensor,
                        real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this shard's shifted logit of each label, 0 where the label is in another shard; this
    shard's sum of exp(logit - max) over its real columns), both fp32 (..., )."""
    shifted = logits.float() - logits_max.unsqueeze(-1)
    target = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
    target = target.masked_fill(outside, 0.0)
    return target, shifted[..., :real].exp().sum(dim=-1)


def _grad_logits(logits: torch.Tensor, logits_max: torch.Tensor, sum_exp: torch.Tensor,
                 local_labels: torch.Tensor, outside: torch.Tensor, grad_loss: torch.Tensor,
                 real: int) -> torch.Tensor:
    """d loss / d logits = (softmax - one_hot(label)) * grad_loss, computed in fp32 and returned
    in the logits' dtype; 0 in padding columns."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    softmax = (logits.float() - logits_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    softmax = torch.where(columns < real, softmax, 0.0)
    hit = (columns == local_labels.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    grad = (softmax - hit.to(softmax.dtype)) * grad_loss.unsqueeze(-1)
    return grad.to(logits.dtype)


@functools.cache
def compiled() -> SimpleNamespace:
    """The fused pieces, each wrapped by torch.compile (as models/elementwise.py compiles the
    layers'): one or two kernels each, reading the logits in their own dtype. Cached: one
    wrapper per piece for the process."""
    return SimpleNamespace(shard_max=torch.compile(_shard_max, dynamic=False),
                           target_and_sum_exp=torch.compile(_target_and_sum_exp, dynamic=False),
                           grad_logits=torch.compile(_grad_logits, dynamic=False))


def _eager_forward(logits, logits_max, local_labels, outside, real, group):
    """The eager reference: an fp32 softmax of the shard, saved for the backward (recomputing
    it eagerly would read and write the fp32 copy several more times)."""
    shifted = logits.float() - logits_max.unsqueeze(-1)
    if real < shifted.shape[-1]:
        shifted[..., real:] = float("-inf")  # exp gives 0: no probability, no gradient
    target = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    all_reduce(target, group)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    all_reduce(sum_exp, group)
    return target, sum_exp, exp.div_(sum_exp.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Compiled, saves the logits as they came and the two per-token statistics, and the
    backward recomputes the softmax in one fused pass; eagerly, saves the fp32 softmax."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, vocab_size, compile_pieces):
        # logits: (..., V/tp) this rank's vocabulary shard; labels: (...) global ids.
        local_vocab = logits.shape[-1]
        # Columns [real, local_vocab) of this shard are padding (all of it when real is 0).
        real = local_vocab if vocab_size is None else max(0, min(local_vocab,
                                                                 vocab_size - vocab_start))
        pieces = compiled() if compile_pieces else None
        logits_max = (pieces.shard_max if pieces else _shard_max)(logits, real)
        if dist.get_world_size(group) > 1:
            comm.all_reduce(logits_max, op=comm.ReduceOp.MAX, group=group)
        outside = (labels < vocab_start) | (labels >= vocab_start + local_vocab)
        local_labels = (labels - vocab_start).masked_fill(outside, 0)
        ctx.real, ctx.pieces = real, pieces
        if pieces is None:
            target, sum_exp, softmax = _eager_forward(logits, logits_max, local_labels, outside,
                                                      real, group)
            ctx.save_for_backward(softmax, local_labels, outside)
            return sum_exp.log() - target
        target, sum_exp = pieces.target_and_sum_exp(logits, logits_max, local_labels, outside,
                                                    real)
        all_reduce(target, group)
        all_reduce(sum_exp, group)
        ctx.save_for_backward(logits, logits_max, sum_exp, local_labels, outside)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.pieces is None:
            grad, local_labels, outside = ctx.saved_tensors
            inside = (~outside).to(grad.dtype)
            grad.scatter_add_(-1, local_labels.unsqueeze(-1), -inside.unsqueeze(-1))
            grad.mul_(grad_loss.unsqueeze(-1))  # fp32: autograd casts it to the logits' dtype
            return grad, None, None, None, None, None
        logits, logits_max, sum_exp, local_labels, outside = ctx.saved_tensors
        grad = ctx.pieces.grad_logits(logits, logits_max, sum_exp, local_labels, outside,
                                      grad_loss, ctx.real)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group,
                                 vocab_start: int, vocab_size: int | None = None,
                                 compile_pieces: bool = False) -> torch.Tensor:
    """Per-token loss (fp32, shape of labels) from vocab-sharded logits (..., V/tp).

    `vocab_start` is the first global vocabulary id of this rank's shard; `vocab_size` the
    unpadded vocabulary (columns at or past it are padding, excluded; None: every column is a
    token). Labels must be below `vocab_size` (a padding label's loss is inf). The gradient is
    computed in fp32 and returned in the logits' dtype; it is 0 in padding columns.
    compile_pieces: run the element-wise pieces compiled (`--compile-layer-pieces`).
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_size,
                                            compile_pieces)
