"""One rank's pipeline: its plan, chunks, transport, schedule and executor, for a training step.

Every step runs here, at every pipeline degree (as Megatron-core's `get_forward_backward_func`
hands PP 1 its `forward_backward_no_pipelining` with the pipelined schedules' signature). At PP 1
the whole model is the one chunk of a one-stage plan: no transport, the action list
F0 B0 F1 B1 ... (1F1B of one stage), and each backward is the data-parallel engine's
`backward()`, every one but the last under `no_sync()`, so that the DP reduction overlaps the
last backward; the engine applies the fp16 loss scale.

At PP > 1, `PipelineRuntime.train_step(batches, engine)` runs the schedule's action list with
every backward under the data-parallel engine's `no_sync()` (gradients accumulate over the
micro-batches), sums the tied embedding's accumulated gradient over the embedding group, then has
the engine reduce over DP (stages 0 and 1: after the last micro-batch's backward, as Megatron's
finalize step does). The engine's step then clips by the norm over every stage (an all-reduce
over the pipeline group, zero/sharded.py). A schedule that splits its backwards (zb-h1:
schedules.SPLIT_BACKWARD) runs every B and W inside that same `no_sync()`, so both reductions
come after the last W; the executor keeps one WeightGradStore a chunk and refuses a step that
leaves a W pending (tp/wgrad.py's rules).

Losses are Megatron's: the last stage computes each micro-batch's loss, the step's is their
mean, broadcast over the pipeline group so that every rank knows it for logging. With per-token
loss (--calculate-per-token-loss) the caller passes a token's weight, `token_scale` (dp / the
global batch's tokens, which every stage computes from the masks it reads): a micro-batch's loss
is its token losses' sum times it, and the step's loss their sum.

The number of micro-batches may change from step to step (--rampup-batch-size): the schedule's
action list is generated for each count when first needed, and kept.

`--pipeline-schedule auto`: the runtime, as it is built (before the data-parallel engine hooks
the parameters), times its chunks and its transport and takes the schedule the simulator
predicts fastest for the configured micro-batch count (schedule_auto.py); `schedule_name` is
the choice, the same on every rank, and `start_lines()` names it with every prediction.

A step that may launch a kernel for the first time (the first of each micro-batch count, the
first after the codecs change) runs its schedule's computes with no message in flight on the
rank as it computes (schedules.schedule's `loading`): CUDA loads a kernel at its first launch
(lazily, its default) and the load waits for the device's queued work, which a prefetched
receive keeps queued until its peer sends, while the peer may wait on this rank. The kernels are
those of the step itself (the engine's fused gradient accumulation, the codecs), which no pass
at start-up sees alike. The computes and their order are the schedule's, and so are the
numbers, but for ZBV, whose order needs a send in flight: its loading step runs the
micro-batches one after the other (schedules.py's `one_at_a_time`), the same computes in
another order (its gradients summed in another order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from megadomino.config import Config, ModelConfig, ParallelConfig
from megadomino.config.pipeline_plan import PipelinePlan, resolve_plan
from megadomino.distributed import comm
from megadomino.models import StageChunks
from megadomino.models.blocks import DTYPES
from megadomino.pipeline.codec_rate import with_codec
from megadomino.pipeline.executor import COMPUTE, Executor, MicroBatch, PhaseTimers
from megadomino.pipeline.reshard.layout import part_range
from megadomino.pipeline.schedule_auto import (
    AUTO,
    Choice,
    candidates,
    profile_and_pick,
    random_batch,
)
from megadomino.pipeline.schedules import (
    SPLIT_BACKWARD,
    compute_order,
    schedule,
    with_transfers,
)
from megadomino.pipeline.stage import embedding_group, sum_tied, tied_copy, tied_embedding
from megadomino.pipeline.transport_delay import DelayedTransport
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
    micro-batches; schedule_name: one of schedules.SCHEDULES, or 'auto' (schedule_auto.py:
    profiled and picked here, a collective over the world; `schedule_name` is then the
    choice)."""

    def __init__(self, chunks: StageChunks, plan: PipelinePlan, dims, model: ModelConfig,
                 parallel: ParallelConfig, schedule_name: str, micro_batch_size: int,
                 num_micro: int):
        self.stage = stage = chunks.stage
        self.plan, self.dims, self.chunks, self.num_micro = plan, dims, chunks, num_micro
        self.device = next(chunks.parameters()).device
        self.transport, self.codec = None, None
        if plan.size > 1:
            self.transport = _transport(plan, stage, dims, model, parallel, micro_batch_size,
                                        num_micro, self.device)
            if parallel.pipeline_codec != "none":  # the boundary codecs (codec_rate.py)
                if not isinstance(self.transport, P2PTransport):  # the validator refuses it
                    raise ValueError("the pipeline codecs ride the P2P transport")
                self.codec = with_codec(self.transport, stage.index, plan.size, parallel)
                self.transport = self.codec.transport
            if parallel.pipeline_link_delay > 0:  # an emulated latency (transport_delay.py)
                self.transport = DelayedTransport(self.transport, parallel.pipeline_link_delay)
            comm.barrier(group=dims.pp_group)  # NCCL: a group's first operation is a collective
        # one stage has no pipeline schedule: its list is 1F1B's F0 B0 F1 B1 ...
        self.schedule_name = schedule_name if plan.size > 1 else "1f1b"
        self.prefetch = parallel.prefetches_receives(self.device.type == "cuda")
        self.auto = None
        if self.schedule_name == AUTO:  # before the executor, which the choice configures
            self.schedule_name, self.auto = self._pick_schedule(model, parallel,
                                                                micro_batch_size)
        self.executor = Executor(chunks, self.transport, stage.index, plan.size,
                                 split_backward=self.schedule_name in SPLIT_BACKWARD,
                                 slowdown=parallel.slowdown(dims.rank),
                                 placement=plan.placement)
        self._actions: dict[tuple[int, bool], list] = {}
        self._counts_run: set[int] = set()  # the micro-batch counts a step has run with
        tied = plan.size > 1 and not model.untie_embeddings_and_output_weights
        # the V placement holds both ends on stage 0: its two copies are summed on the rank
        self.embedding_group = (embedding_group(plan, dims) if tied and plan.last_stage != 0
                                else None)
        self.tied = tied_embedding(chunks, plan)
        self.tied_copy = tied_copy(chunks, plan)
        last = plan.stages[plan.last_stage].ranks
        self.loss_source = (None if plan.size == 1 else last[stage.ranks.index(dims.rank)]
                            if dims.uniform else last[0])

    def start_lines(self) -> list[str]:
        """What the start-up prints of the pipeline (rank 0's): under a --pipeline-plan, each
        boundary's resharding strategy and its predicted time per direction
        (ReshardTransport.describe); with --pipeline-schedule auto, the schedule chosen and
        every candidate's predicted step (schedule_auto.Choice.line)."""
        lines = []
        transport = getattr(self.transport, "inner", self.transport)  # under a delay
        if isinstance(transport, ReshardTransport):
            lines += [f"pipeline {line}" for line in transport.describe()]
        if self.auto is not None:
            lines.append(self.auto.line())
        if self.codec is not None:
            lines.append(self.codec.describe())
        return lines

    def _pick_schedule(self, model: ModelConfig, parallel: ParallelConfig,
                       micro_batch_size: int) -> tuple[str, Choice | None]:
        """--pipeline-schedule auto: the schedule_auto.py's profiling pass on this rank's
        chunks and transport, with a random micro-batch of this rank's part (its rows of a
        batch-split plan's micro-batch) and an activation of the transport's layout; the
        choice (the same on every rank) and, on rank 0, what it was chosen from."""
        names = candidates(parallel, self.plan.chunks, max(s.tp for s in self.plan.stages))
        return profile_and_pick(self.chunks, self.transport, self.dims, self.stage.index,
                                self.plan.size, names,
                                *self._probe(model, parallel, micro_batch_size),
                                DTYPES[model.params_dtype], self.num_micro, self.prefetch)

    def _probe(self, model: ModelConfig, parallel: ParallelConfig, micro_batch_size: int
               ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        """A random micro-batch of this rank's rows (a batch-split plan's part of the
        micro-batch) and the shape of an activation of the transport's layout, for the
        start-up passes over the chunks (schedule_auto.py)."""
        rows = micro_batch_size
        if self.plan.batch_split:
            start, stop = part_range(micro_batch_size, self.dims.dp, self.dims.dp_rank)
            rows = stop - start
        seq = model.seq_length
        tp = self.dims.tp
        local_seq = seq // tp if parallel.sequence_parallel and tp > 1 else seq
        return (random_batch(rows, seq, model.vocab_size, self.device),
                (local_seq, rows, model.hidden_size))

    def actions(self, num_micro: int, loading: bool = False) -> list:
        """This stage's action list for a step of `num_micro` micro-batches (at most the
        transport's count, whose tags it sizes); `loading`: the list of a step that may launch
        a kernel for the first time (module docstring)."""
        key = (num_micro, loading)
        if key not in self._actions:
            self._actions[key] = schedule(self.schedule_name, self.plan.size, self.stage.index,
                                          num_micro, self.plan.chunks, prefetch=self.prefetch,
                                          loading=loading)
        return self._actions[key]

    def _step_actions(self, num_micro: int, codecs_changed: bool) -> list:
        """The step's action list: the loading one for the first step of `num_micro`
        micro-batches and the first after the codecs changed (module docstring)."""
        loading = codecs_changed or num_micro not in self._counts_run
        self._counts_run.add(num_micro)
        return self.actions(num_micro, loading)

    def train_step(self, batches: Sequence[MicroBatch], engine,
                   token_scale: torch.Tensor | None = None,
                   timers: PhaseTimers | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch, gradients reduced over the embedding
        group and DP (stages 0 and 1). Returns the mean loss (0-dim fp32, every rank), or with
        `token_scale` (per-token loss: a token's weight) the sum of the micro-batches' weighted
        token sums. `timers`: the schedule's forwards, backwards and waits are timed under those
        phases (executor.py); at PP > 1 the reductions and the loss's broadcast after it under
        `wait` (the stage's time in communication). At PP 1 the engine's last backward reduces
        (module docstring)."""
        batches, shard_weights = self.shards(batches, token_scale is not None)
        if self.plan.size == 1:
            losses = self.executor.run(self.actions(len(batches)), batches,
                                       token_scale=token_scale, loss_weights=shard_weights,
                                       timers=timers,
                                       backward=_engine_backward(engine, len(batches)))
            return self.step_loss(losses, mean=token_scale is None)
        scale = engine.loss_scaler.scale if engine.loss_scaler is not None else 1.0
        timeline, changed = self._codec_step()
        actions = self._step_actions(len(batches), changed)
        with engine.no_sync():
            losses = self.executor.run(actions, batches, scale, token_scale=token_scale,
                                       loss_weights=shard_weights, timers=timers,
                                       timeline=timeline)
        self._codec_step_end(timeline)
        with timers("wait") if timers is not None else contextlib.nullcontext():
            sum_tied(self.tied, self.tied_copy, self.embedding_group, engine.accumulated_grad)
            engine.reduce_gradients()
            return self.step_loss(losses, mean=token_scale is None)

    def forward_backward(self, batches: Sequence[MicroBatch]) -> torch.Tensor:
        """Without an engine: gradients accumulate in `.grad` (the tied embedding's summed over
        the embedding group); what tests compare with a model without PP."""
        batches, shard_weights = self.shards(batches)
        timeline, changed = self._codec_step()
        losses = self.executor.run(self._step_actions(len(batches), changed), batches,
                                   loss_weights=shard_weights, timeline=timeline)
        self._codec_step_end(timeline)
        sum_tied(self.tied, self.tied_copy, self.embedding_group, lambda param: param.grad)
        return self.step_loss(losses)

    def _codec_step(self) -> tuple[list | None, bool]:
        """At a training step's start: the codecs' decision when due (codec_rate.py, collective
        over the world); when they adapt, a timeline to time this step's computes in; whether
        the settings changed (the same on every rank)."""
        if self.codec is None:
            return None, False
        changed = self.codec.begin_step()
        return ([] if self.codec.interval else None), changed

    def _codec_step_end(self, timeline: list | None) -> None:
        if self.codec is not None:
            self.codec.end_step(sum(end - start for action, start, end in timeline or ()
                                    if action.op in COMPUTE))

    @torch.no_grad()
    def evaluate(self, batches: Sequence[MicroBatch], per_token: bool = False) -> torch.Tensor:
        """The sum of the micro-batches' losses (`per_token`: of their token losses' sums) of
        forwards only, any number of micro-batches (eval mode is the caller's): every forward
        in the order of the training schedule, no backward (under the V placement chunk 0's
        forwards, then chunk 1's); the codecs' state untouched (transport_codec.py's
        evaluation)."""
        plan, stage = self.plan, self.stage.index
        name = ("interleaved" if plan.chunks > 1 and len(batches) % plan.size == 0
                and plan.placement == "loop" else None)
        if name is None and plan.chunks > 1:
            order = [("F", m, v) for v in range(plan.chunks) for m in range(len(batches))]
        else:
            order = [c for c in compute_order(name or "1f1b", plan.size, stage, len(batches),
                                              plan.chunks) if c[0] == "F"]
        actions = with_transfers([[c] for c in order], plan.size, stage, plan.chunks,
                                 placement=plan.placement)
        batches, shard_weights = self.shards(batches, per_token)
        with (self.codec.transport.evaluation() if self.codec is not None
              else contextlib.nullcontext()):
            losses = self.executor.run(actions, batches, train=False,
                                       token_scale=1.0 if per_token else None,
                                       loss_weights=shard_weights)
        return self.step_loss(losses, mean=False)

    def shards(self, batches: Sequence[MicroBatch], per_token: bool = False
               ) -> tuple[Sequence[MicroBatch], list[float] | None]:
        """Under a batch-split plan, this rank's part of each whole micro-batch (its DP
        position's rows, part_range's rule, as the transport's layouts) and each part's loss
        weight dp x (its loss-mask tokens / the micro-batch's; `per_token`: dp, its token sum
        being its share already): the DP average of the weighted losses (and of the gradients)
        is the whole micro-batch's. Else unchanged, no weights."""
        if not self.plan.batch_split:
            return batches, None
        dp = self.dims.dp
        parts, weights = [], []
        for tokens, labels, loss_mask in batches:
            start, stop = part_range(tokens.shape[0], dp, self.dims.dp_rank)
            parts.append((tokens[start:stop], labels[start:stop], loss_mask[start:stop]))
            if per_token:
                weights.append(float(dp))
                continue
            mine = loss_mask[start:stop].sum().clamp(min=1.0)
            weights.append(dp * (mine / loss_mask.sum().clamp(min=1.0)).item())
        return parts, weights

    def step_loss(self, losses: list[torch.Tensor], mean: bool = True) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses (`mean` False: their sum),
        broadcast over the pipeline group."""
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss
        if losses:
            if mean:
                total /= len(losses)
            if self.plan.batch_split and self.dims.dp > 1:  # the weighted parts' DP mean
                comm.all_reduce(total, group=self.dims.dp_group)
                total /= self.dims.dp
        if self.plan.size > 1:
            comm.broadcast(total, self.loss_source, group=self.dims.pp_group)
        return total


def _engine_backward(engine, num_micro: int):
    """PP 1's backward of micro-batch m's loss: the engine's, under `no_sync()` but for the last
    micro-batch, whose backward the DP reduction overlaps (the engine scales the loss)."""
    def backward(micro: int, loss: torch.Tensor) -> None:
        with engine.no_sync() if micro != num_micro - 1 else contextlib.nullcontext():
            engine.backward(loss)
    return backward


def _transport(plan: PipelinePlan, stage, dims, model: ModelConfig, parallel: ParallelConfig,
               micro_batch_size: int, num_micro: int, device: torch.device):
    """The transport between this stage and its neighbours: the reshard transport under a
    batch-split plan (the whole micro-batch's activation, resharded between stages), else P2P
    of this DP rank's activation [seq (/ tp under SP), micro_batch_size, hidden]."""
    dtype = DTYPES[model.params_dtype]
    if plan.batch_split:
        return ReshardTransport(
            plan, stage, dims.rank, (model.seq_length, micro_batch_size, model.hidden_size),
            dtype, device, num_micro, parallel.sequence_parallel, dims.gpus_per_node,
            parallel.pipeline_reshard, parallel.nics_per_node or 1, dims.timeout)
    seq = model.seq_length
    if parallel.sequence_parallel and dims.tp > 1:
        seq //= dims.tp
    return P2PTransport(plan, stage, dims.rank, dims.pipeline_channels(plan.chunks, plan.placement),
                        (seq, micro_batch_size, model.hidden_size), dtype, device, num_micro)
