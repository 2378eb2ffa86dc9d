"""Vocab-parallel cross-entropy: the loss over logits sharded along the vocabulary, in fp32,
without ever gathering the logits (Megatron-LM's scheme: three small all-reduces of [s, b])."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megadomino.parallel.mappings import all_reduce


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start):
        # logits: (..., V/tp) this rank's vocabulary shard; labels: (...) global ids.
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        if dist.get_world_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        local_vocab = logits.shape[-1]
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
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group,
                                 vocab_start: int) -> torch.Tensor:
    """Per-token loss (fp32, shape of labels) from vocab-sharded logits (..., V/tp).

    `vocab_start` is the first global vocabulary id of this rank's shard. The gradient is returned
    in fp32 and cast by autograd to the logits' dtype.
    """
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start)
