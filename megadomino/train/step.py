"""One training iteration, or one evaluation pass, over global batches of fixed shape.

Sampling is Megatron's pretraining sampler: the iteration that starts at `consumed` samples reads
samples [consumed, consumed + global batch); micro-batch m of DP rank r reads `micro_batch_size`
consecutive samples starting at consumed + (m * dp + r) * micro_batch_size. The ranks of one TP
group read the same samples; two DP ranks never read the same sample in a step. Those are read
positions: under --dataloader-type cyclic the loop hands the Stepper its datasets in Megatron-LM's
cyclic order (megadomino.data.cyclic), whose position p holds a permuted sample.

A sample is a LongTensor [seq_length + 1] (inputs [:-1], labels [1:], every label counts) or a
dict {"tokens": LongTensor [seq_length + 1], "loss_mask": FloatTensor [seq_length]} whose mask
weighs each label. A micro-batch's loss is the mask-weighted mean over its labels, and the
iteration's the mean of its micro-batches' (then of the DP ranks').

With per-token loss (--calculate-per-token-loss, as Megatron-LM's `loss_func` and
`finalize_model_grads`), the iteration's loss is instead the sum of the token losses of the
whole global batch over its count of weighted tokens N (the masks summed over the micro-batches
and DP ranks, one all-reduce before the forwards): each micro-batch backpropagates its token
sum times dp / N, so that the engine's DP mean of the gradients is the gradient of that loss.
Evaluation weighs tokens alike.

The Stepper reads the micro-batches, then the pipeline runtime (megadomino.pipeline.runtime)
runs them through its schedule at every pipeline degree (at PP 1: the whole model as the one
chunk, F0 B0 F1 B1 ..., each backward the data-parallel engine's `backward(loss / num_micro)`
(fp16 loss scaling inside), under `no_sync()` for all but the last micro-batch, whose DP
reduction overlaps it); the Stepper drives the engine (`megadomino.zero.ZeroPlusPlus`, any
stage) around that: `zero_grad()`, then `step()`. The runtime's executor computes every
micro-batch's loss (executor.micro_batch_loss). Every stage reads the micro-batches (the first
uses the tokens, the last the labels and mask; with per-token loss every stage counts the masks'
tokens, so that the last stage's token weight needs no broadcast).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megadomino.distributed import ParallelDims, comm
from megadomino.pipeline.runtime import PipelineRuntime
from megadomino.train.timers import Timers
from megadomino.zero import ZeroPlusPlus
from megadomino.zero.loss_scaler import StepResult

Sample = torch.Tensor | dict[str, torch.Tensor]
Dataset = Sequence[Sample]


def collate(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, seq + 1], loss_mask [b, seq] float) of a list of samples."""
    if isinstance(samples[0], dict):
        tokens = torch.stack([s["tokens"] for s in samples])
        loss_mask = torch.stack([s["loss_mask"] for s in samples]).float()
    else:
        tokens = torch.stack(samples)
        loss_mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    return tokens, loss_mask


class Stepper:
    """Forward, backward and optimizer step of one global batch for this rank, timed by phase."""

    def __init__(self, model: nn.Module, engine: ZeroPlusPlus,
                 dims: ParallelDims, micro_batch_size: int, num_micro: int,
                 device: torch.device, timers: Timers, per_token_loss: bool = False,
                 pipeline: PipelineRuntime | None = None):
        """`num_micro`: micro-batches of a full global batch (evaluation's; training's unless
        a batch ramp-up passes fewer to `train`). `pipeline`: the runtime whose schedule runs
        the micro-batches of `model` (this rank's chunks, or at PP 1 the whole model, its one
        chunk); its loss is the last stage's, on every rank. None: a Stepper that only reads
        micro-batches (`_micro_batch`)."""
        self.model, self.engine, self.dims, self.pipeline = model, engine, dims, pipeline
        self.mbs, self.num_micro, self.device, self.timers = (micro_batch_size, num_micro, device,
                                                              timers)
        self.per_token_loss = per_token_loss
        # A batch-split plan's stages split each whole micro-batch themselves (runtime.py).
        split = pipeline is not None and pipeline.plan.batch_split
        self.data_dp, self.data_rank = (1, 0) if split else (dims.dp, dims.dp_rank)

    def _micro_batch(self, dataset: Dataset, consumed: int,
                     micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, labels, loss_mask), each [mbs, seq], of micro-batch `micro` for this DP rank."""
        start = consumed + (micro * self.data_dp + self.data_rank) * self.mbs
        tokens, loss_mask = collate([dataset[i] for i in range(start, start + self.mbs)])
        if self.device.type == "cuda":
            # from pageable memory the copy would first wait for everything queued on the
            # stream (the last step's optimizer pass), and the GPU would then idle while the
            # host enqueued this step's first kernels; from pinned memory it does not wait
            tokens, loss_mask = tokens.pin_memory(), loss_mask.pin_memory()
        tokens = tokens.to(self.device, non_blocking=True)
        loss_mask = loss_mask.to(self.device, non_blocking=True)
        return tokens[:, :-1], tokens[:, 1:], loss_mask

    def _dp_tokens(self, masks: list[torch.Tensor]) -> torch.Tensor:
        """The weighted tokens of `masks` summed over the DP group (at least 1: an all-masked
        batch contributes 0, not 0 / 0)."""
        count = torch.stack([mask.sum() for mask in masks]).sum().double().reshape(1)
        if self.dims.dp > 1:
            comm.all_reduce(count, group=self.dims.dp_group)
        return count.clamp(min=1.0).float().reshape(())

    def train(self, dataset: Dataset, consumed: int, num_micro: int | None = None,
              before_step: Callable[[], None] | None = None) -> tuple[torch.Tensor, StepResult]:
        """Accumulate gradients over `num_micro` micro-batches (default: a full global batch),
        reduce (with the last backward), step. Returns (this rank's share of the loss as a 0-dim
        tensor, whose DP mean is the iteration's loss; StepResult). `before_step` runs once the
        forward and backward passes are enqueued, before the optimizer step (the loop sets the
        LR there: it may read the last step's skip flag without the GPU idling)."""
        num_micro = num_micro or self.num_micro
        self.engine.zero_grad()
        with self.timers("data"):
            batches = [self._micro_batch(dataset, consumed, micro) for micro in range(num_micro)]
            token_scale = None  # per-token loss: a token's weight, dp / the batch's tokens
            if self.per_token_loss:
                token_scale = self.dims.dp / self._dp_tokens([mask for _, _, mask in batches])
        # Forwards and backwards interleave in the schedule: it times each under its phase,
        # and at PP > 1 its waits for transfers and reductions under "wait" (runtime.py).
        loss = self.pipeline.train_step(batches, self.engine, token_scale, self.timers)
        with self.timers("optimizer"):
            if before_step is not None:
                before_step()
            return loss, self.engine.step()

    @torch.no_grad()
    def probe(self, dataset: Dataset, consumed: int) -> float:
        """The loss of the current weights on the first micro-batch of the global batch at sample
        `consumed` (eval mode: no dropout, no generator touched), averaged over DP: the same
        value on every rank."""
        self.model.eval()
        loss = self.pipeline.evaluate([self._micro_batch(dataset, consumed, 0)])
        self.model.train()
        return dp_mean(loss, self.dims).item()

    @torch.no_grad()
    def evaluate(self, dataset: Dataset, consumed: int, iters: int,
                 progress: Callable[[int], None] | None = None) -> float:
        """Mean loss over `iters` global batches starting at sample `consumed`, averaged over DP
        (per-token loss: over every weighted token of them); `progress(done)` after each
        batch."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        masks = []
        global_batch = self.num_micro * self.mbs * self.data_dp
        for batch in range(iters):
            batches = [self._micro_batch(dataset, consumed + batch * global_batch, micro)
                       for micro in range(self.num_micro)]
            total += self.pipeline.evaluate(batches, self.per_token_loss)
            if self.per_token_loss:  # the token losses' sum
                masks += [mask for _, _, mask in batches]
            if progress is not None:
                progress(batch + 1)
        self.model.train()
        if self.per_token_loss:
            return dp_mean(total * self.dims.dp / self._dp_tokens(masks), self.dims).item()
        return dp_mean(total / (iters * self.num_micro), self.dims).item()


def dp_mean(values: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The mean of `values` over the DP group (a copy; identity at DP 1). Each element is summed
    in DP-rank order, whatever the tensor's length: an all-reduce's summation order depends on
    the message size (gloo and NCCL pick algorithms by it), and a resumed run, whose first log
    interval is shorter, then reported its first loss one ulp off the uninterrupted run's."""
    if dims.dp == 1:
        return values
    flat = values.reshape(-1)
    gathered = flat.new_empty(dims.dp * flat.numel())
    comm.all_gather_single(gathered, flat.contiguous(), group=dims.dp_group)
    rows = gathered.view(dims.dp, -1)
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return (total / dims.dp).view_as(values)
