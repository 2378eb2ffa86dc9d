"""One rank's pipeline: its plan, chunks, transport, schedule and executor, for a training step.

`PipelineRuntime.train_step(batches, engine)` runs the schedule's action list with every
backward under the data-parallel engine's `no_sync()` (gradients accumulate over the
micro-batches), sums the tied embedding's accumulated gradient over the embedding group, then has
the engine reduce over DP (stages 0 and 1: after the last micro-batch's backward, as Megatron's
finalize step does). The engine's step then clips by the norm over every stage (an all-reduce
over the pipeline group, zero/sharded.py). A schedule that splits its backwards (zb-h1:
schedules.SPLIT_BACKWARD) runs every B and W inside that same `no_sync()`, so both reductions
come after the last W; the executor keeps one WeightGradStore a chunk and refuses a step that
leaves a W pending (tp/wgrad.py's rules).

Losses are Megatron's: the last stage computes each micro-batch's loss, the step's is their
mean, broadcast over the pipeline group so that every rank knows it for logging. With per-token
loss (--calculate-per-token-loss) the caller passes each micro-batch's weight instead of
1 / micro-batches (its token count times dp / the global batch's tokens, which every stage
computes from the masks it reads): the step's loss is the weighted sum, as at PP 1.

The number of micro-batches may change from step to step (--rampup-batch-size): the schedule's
action list is generated for each count when first needed, and kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from megadomino.config import Config, ConfigError, ModelConfig, ParallelConfig
from megadomino.config.pipeline_plan import PipelinePlan, resolve_plan
from megadomino.distributed import comm
from megadomino.models import StageChunks
from megadomino.models.blocks import DTYPES
from megadomino.pipeline.executor import Executor, MicroBatch, PhaseTimers
from megadomino.pipeline.reshard.layout import part_range
from megadomino.pipeline.schedules import (
    SPLIT_BACKWARD,
    compute_order,
    schedule,
    with_transfers,
)
from megadomino.pipeline.stage import embedding_group, tied_embedding
from megadomino.pipeline.transport_p2p import P2PTransport
from megadomino.pipeline.transport_reshard import ReshardTransport


def run_plan(config: Config, dims) -> PipelinePlan:
    """The run's pipeline plan: the one `dims` were built from (the launcher's, resolved once),
    else, for dims built from degrees as tests build them, resolve_plan's of `config`."""
    return dims.plan if dims.plan is not None else resolve_plan(config, dims.world_size)


class PipelineRuntime:
    """Built alike on every rank (it creates the embedding groups: collective over the world).
    chunks: this rank's, with its Stage of `plan` (megadomino.build.build_stage), which the
    transport and the executor are handed; micro_batch_size, num_micro: the step's
    micro-batches; schedule_name: one of schedules.SCHEDULES."""

    def __init__(self, chunks: StageChunks, plan: PipelinePlan, dims, model: ModelConfig,
                 parallel: ParallelConfig, schedule_name: str, micro_batch_size: int,
                 num_micro: int):
        self.stage = stage = chunks.stage
        self.plan, self.dims, self.chunks, self.num_micro = plan, dims, chunks, num_micro
        device, dtype = next(chunks.parameters()).device, DTYPES[model.params_dtype]
        if plan.batch_split:  # the whole micro-batch's activation, resharded between stages
            transport = ReshardTransport(
                plan, stage, dims.rank, (model.seq_length, micro_batch_size, model.hidden_size),
                dtype, device, num_micro, parallel.sequence_parallel, dims.gpus_per_node)
        else:
            seq = model.seq_length
            if parallel.sequence_parallel and dims.tp > 1:
                seq //= dims.tp
            transport = P2PTransport(plan, stage, dims.pp_group,
                                     (seq, micro_batch_size, model.hidden_size), dtype,
                                     device, num_micro)
        if plan.size > 1:  # NCCL: the group's first operation must be a collective of it all
            comm.barrier(group=dims.pp_group)
        self.executor = Executor(chunks, transport, stage.index, plan.size,
                                 split_backward=schedule_name in SPLIT_BACKWARD)
        self.schedule_name = schedule_name
        self.prefetch = parallel.overlap_p2p_communication
        self._actions: dict[int, list] = {}
        tied = plan.size > 1 and not model.untie_embeddings_and_output_weights
        self.embedding_group = embedding_group(plan, dims) if tied else None
        self.tied = tied_embedding(chunks, plan)
        last = plan.stages[-1].ranks
        self.loss_source = last[stage.ranks.index(dims.rank)] if dims.uniform else last[0]

    def actions(self, num_micro: int) -> list:
        """This stage's action list for a step of `num_micro` micro-batches (at most the
        transport's count, whose tags it sizes)."""
        if num_micro not in self._actions:
            self._actions[num_micro] = schedule(self.schedule_name, self.plan.size,
                                                self.stage.index, num_micro, self.plan.chunks,
                                                prefetch=self.prefetch)
        return self._actions[num_micro]

    def train_step(self, batches: Sequence[MicroBatch], engine,
                   weights: Sequence[torch.Tensor] | None = None,
                   timers: PhaseTimers | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch, gradients reduced over the embedding
        group and DP (stages 0 and 1). Returns the mean loss (0-dim fp32, every rank), or with
        `weights` (one per micro-batch) the weighted sum. `timers`: the schedule's forwards,
        backwards and waits are timed under those phases (executor.py), and the reductions and
        the loss's broadcast after it under `wait` (the stage's time in communication)."""
        if engine.config.stage == 3:
            raise ConfigError("--zero-stage 3 with pipeline parallelism is not supported: "
                              "its per-layer gathers run in forward hooks that the pipeline's "
                              "interleaved micro-batches would repeat; use --zero-stage 0 or 1")
        scale = engine.loss_scaler.scale if engine.loss_scaler is not None else 1.0
        batches, shard_weights = self.shards(batches)
        with engine.no_sync():
            losses = self.executor.run(self.actions(len(batches)), batches, scale,
                                       weights=weights, loss_weights=shard_weights,
                                       timers=timers)
        with timers("wait") if timers is not None else contextlib.nullcontext():
            if self.tied is not None:
                comm.all_reduce(engine.accumulated_grad(self.tied), group=self.embedding_group)
            engine.reduce_gradients()
            return self.mean_loss(losses, weights)

    def forward_backward(self, batches: Sequence[MicroBatch]) -> torch.Tensor:
        """Without an engine: gradients accumulate in `.grad` (the tied embedding's summed over
        the embedding group); what tests compare with a model without PP."""
        batches, shard_weights = self.shards(batches)
        losses = self.executor.run(self.actions(len(batches)), batches,
                                   loss_weights=shard_weights)
        if self.tied is not None and self.tied.grad is not None:
            comm.all_reduce(self.tied.grad, group=self.embedding_group)
        return self.mean_loss(losses)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[MicroBatch],
                 weights: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The mean loss (or `weights`' sum) of forwards only, any number of micro-batches
        (eval mode is the caller's): every forward in the order of the training schedule, no
        backward."""
        plan, stage = self.plan, self.stage.index
        name = "interleaved" if plan.chunks > 1 and len(batches) % plan.size == 0 else None
        if name is None and plan.chunks > 1:
            order = [("F", m, v) for v in range(plan.chunks) for m in range(len(batches))]
        else:
            order = [c for c in compute_order(name or "1f1b", plan.size, stage, len(batches),
                                              plan.chunks) if c[0] == "F"]
        actions = with_transfers([[c] for c in order], plan.size, stage, plan.chunks)
        batches, shard_weights = self.shards(batches)
        return self.mean_loss(self.executor.run(actions, batches, train=False,
                                                loss_weights=shard_weights), weights)

    def shards(self, batches: Sequence[MicroBatch]
               ) -> tuple[Sequence[MicroBatch], list[float] | None]:
        """Under a batch-split plan, this rank's part of each whole micro-batch (its DP
        position's rows, part_range's rule, as the transport's layouts) and each part's loss
        weight dp x (its loss-mask tokens / the micro-batch's): the DP average of the weighted
        losses (and of the gradients) is the whole micro-batch's. Else unchanged, no weights."""
        if not self.plan.batch_split:
            return batches, None
        dp = self.dims.dp
        parts, weights = [], []
        for tokens, labels, loss_mask in batches:
            start, stop = part_range(tokens.shape[0], dp, self.dims.dp_rank)
            parts.append((tokens[start:stop], labels[start:stop], loss_mask[start:stop]))
            mine = loss_mask[start:stop].sum().clamp(min=1.0)
            weights.append(dp * (mine / loss_mask.sum().clamp(min=1.0)).item())
        return parts, weights

    def mean_loss(self, losses: list[torch.Tensor],
                  weights: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses (or their sum weighted by
        `weights`), broadcast over the pipeline group."""
        device = next(self.chunks.parameters()).device
        total = torch.zeros((), device=device)
        for micro, loss in enumerate(losses):
            total += loss if weights is None else loss * weights[micro]
        if losses:
            if weights is None:
                total /= len(losses)
            if self.plan.batch_split and self.dims.dp > 1:  # the weighted parts' DP mean
                comm.all_reduce(total, group=self.dims.dp_group)
                total /= self.dims.dp
        if self.plan.size > 1:
            comm.broadcast(total, self.loss_source, group=self.dims.pp_group)
        return total
