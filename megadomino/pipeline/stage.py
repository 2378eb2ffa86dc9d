"""What a pipeline stage shares with the others: the tied embedding's group, and its full state.

A stage's chunks (megadomino.models.StageChunks, built by megadomino.build.build_stage) are
GPTModel parts; each runs its own forward (models/gpt.py: the embedding with `pre_process`, the
loss with `post_process`).

Tied embedding (GPT, `untie_embeddings_and_output_weights` off): the first and last stage both
hold `word_embeddings.weight` (equal at start); the runtime sums their gradients over the
embedding group (those two stages' ranks at the same (dp, tp) position), as Megatron's embedding
group does, so both copies take the same optimizer steps. The last stage's copy is marked
`pipeline_duplicate` (by the builder) so the grad norm counts it once. Under ZBV's V placement
stage 0 holds both ends, in two chunks: the two copies are summed on the rank (`sum_tied`), the
second (chunk 1's) the duplicate. Two copies rather than one shared parameter: a parameter
belongs to one chunk's WeightGradStore (tp/wgrad.py), and each chunk defers its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megadomino.config.pipeline_plan import PipelinePlan
from megadomino.distributed import comm
from megadomino.models.gpt import gather_full


def embedding_group(plan: PipelinePlan, dims):
    """The group of the first and last stage's ranks at this rank's (dp, tp) position, or None
    (PP 1, or an untied output layer). Collective over the world: every rank calls it."""
    first, last = plan.stages[0], plan.stages[-1]
    mine = None
    for position in range(len(first.ranks)):
        ranks = [first.ranks[position], last.ranks[position]]
        group = dist.new_group(ranks, pg_options=dims.options("embd"), timeout=dims.timeout)
        if dims.rank in ranks:
            mine = group
    return mine


def tied_embedding(chunks: nn.ModuleList, plan: PipelinePlan) -> nn.Parameter | None:
    """The word embedding this rank shares with the other end of the pipeline, if any."""
    if plan.size == 1 or chunks[0].config.untie_embeddings_and_output_weights:
        return None
    for model in (chunks[0], chunks[-1]):
        if model.word_embeddings is not None:
            return model.word_embeddings.weight
    return None


def tied_copy(chunks: nn.ModuleList, plan: PipelinePlan) -> nn.Parameter | None:
    """The second copy of the tied word embedding on this rank (the V placement's stage 0:
    chunk 1's, beside tied_embedding's chunk 0), or None."""
    if tied_embedding(chunks, plan) is None or len(chunks) < 2:
        return None
    last = chunks[-1].word_embeddings
    return last.weight if last is not None and chunks[0].word_embeddings is not None else None


def sum_tied(tied: nn.Parameter | None, copy: nn.Parameter | None, group,
             grad_of: Callable[[nn.Parameter], torch.Tensor | None]) -> None:
    """Sum the tied embedding's gradient (`grad_of(param)`: where it accumulated) over its
    copies: over `group` (the embedding group), or with the rank's second `copy`, which then
    holds the sum too. Nothing where this rank holds no copy or no gradient."""
    grad = grad_of(tied) if tied is not None else None
    if grad is None:
        return
    if group is not None:
        comm.all_reduce(grad, group=group)
    if copy is not None:
        other = grad_of(copy)
        if other is not None:
            grad += other
            other.copy_(grad)


def stage_full_state(chunks: nn.ModuleList, grads: bool = False) -> dict[str, torch.Tensor]:
    """This stage's unsharded parameters (or gradients) under the whole model's names.
    Collective over the TP group."""
    out = {}
    for model in chunks:
        for name, param in model.checkpoint_parameters():
            tensor = param.grad if grads else param.detach()
            if tensor is not None:
                out[name] = gather_full(tensor, param, model.dims).cpu()
    return out


def load_stage_full_state(chunks: nn.ModuleList, full: dict[str, torch.Tensor]) -> None:
    """Load this stage's part of a whole model's unsharded state dict (e.g. full_state_dict()
    of the same model without PP)."""
    for model in chunks:
        local = (name for name, _ in model.named_parameters())
        model.load_full_state_dict({name: full[whole] for name, (whole, _) in
                                    zip(local, model.checkpoint_parameters())})
