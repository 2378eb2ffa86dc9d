"""Vocab-parallel cross-entropy: the loss over logits sharded along the vocabulary, in fp32,
without ever gathering the logits (Megatron-LM's scheme: three small all-reduces of [s, b]).

Padding columns (global ids at or above `vocab_size`, the rows Megatron's vocabulary padding adds
so that the table splits evenly) take no part: they are left out of the max and of the softmax's
sum, so the loss equals the cross-entropy of the unpadded logits at every TP degree, and their
gradient is exactly zero (the padding rows of the output layer are never trained).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadomino.distributed.mappings import all_reduce


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, vocab_size):
        # logits: (..., V/tp) this rank's vocabulary shard; labels: (...) global ids.
        logits = logits.float()
        local_vocab = logits.shape[-1]
        # Columns [real, local_vocab) of this shard are padding (all of it when real is 0).
        real = local_vocab if vocab_size is None else max(0, min(local_vocab,
                                                                 vocab_size - vocab_start))
        if real > 0:
            logits_max = logits[..., :real].max(dim=-1).values
        else:
            logits_max = logits.new_full(logits.shape[:-1], float("-inf"))
        if dist.get_world_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        if real < local_vocab:
            shifted[..., real:] = float("-inf")  # exp gives 0: no probability, no gradient
        outside = (labels < vocab_start) | (labels >= vocab_start + local_vocab)
        local_labels = (labels - vocab_start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        all_reduce(predicted, group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        loss = sum_exp.log() - predicted
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_labels, outside = ctx.saved_tensors
        grad = softmax
        inside = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -inside.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group,
                                 vocab_start: int, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss (fp32, shape of labels) from vocab-sharded logits (..., V/tp).

    `vocab_start` is the first global vocabulary id of this rank's shard; `vocab_size` the
    unpadded vocabulary (columns at or past it are padding, excluded; None: every column is a
    token). Labels must be below `vocab_size` (a padding label's loss is inf). The gradient is
    returned in fp32 and cast by autograd to the logits' dtype; it is 0 in padding columns.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_size)
