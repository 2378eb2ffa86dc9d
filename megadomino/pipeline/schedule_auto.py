"""`--pipeline-schedule auto`: the schedule the simulator predicts fastest, from a profiling pass
at start-up.

The pass (`profile_and_pick`, a collective over the world, run by the runtime as it is built,
before the data-parallel engine hooks the parameters) is not the run being predicted:
- every rank times its stage's chunks alone (`time_chunks`): each chunk's forward and whole
  backward on a random micro-batch of the run's shapes (the received activation a random
  tensor, the output gradient a random one; the last chunk's backward is its loss's), and,
  where a split backward is a candidate, the same forward's B and W (tp/wgrad.py); `warmup`
  runs first, then the median of `runs`;
- every rank times one activation-sized message over its boundaries (`time_link`): half of a
  round trip, an activation up and a gradient back down, through the run's transport (its
  channels, a --pipeline-plan's resharding, an emulated link delay alike);
- the times are all-gathered over the pipeline group; a stage's time is the slowest of its
  ranks', the message time the slowest boundary's.
Rank 0 simulates every candidate with them (`pick`: simulate.run of each stage's action list,
a message moving as the backend moves it) and broadcasts the fastest's index over the world,
so every rank runs the same schedule; its start-up line (`Choice.line`) names the choice and
every predicted step. Ties go to the earlier candidate, which holds less: 1F1B before
eager-1F1B, ZB-H1 before eager-zb.

Candidates (`candidates`): with one chunk a stage 1F1B, eager-1F1B, ZB-H1 and eager-zb (the last
two unless their split backward is refused: tp/wgrad.py's check_split_backward); with virtual
stages the interleaved schedule, the one schedule that runs a stage's V chunks as they are
placed. ZBV is no candidate: its V placement gives a stage other layers (virtual stages s and
2 P - 1 - s instead of s and P + s), fixed when the stages are built, before this profile; it
runs when asked for (--pipeline-schedule zbv, --virtual-pipeline-model-parallel-size 2), and the
simulator predicts it from the same per-virtual-stage times (simulate.run with its lists).

What the pass leaves: the chunks' weights and the RNG streams (the default generators and the
TP tracker's) as they were, the chunks' gradients None, so that the run trains as the chosen
schedule's run does, bit for bit. FP8's delayed scaling is the exception: the pass's forwards
enter its amax history, as any forward does.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megadomino.config import ConfigError, ParallelConfig
from megadomino.distributed import comm
from megadomino.pipeline.executor import micro_batch_loss
from megadomino.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD, schedule
from megadomino.pipeline.simulate import run
from megadomino.pipeline.transport_protocol import Transport
from megadomino.tp.wgrad import (
    WeightGradStore,
    backward_input,
    backward_weight,
    check_split_backward,
)

AUTO = "auto"


def candidates(parallel: ParallelConfig, chunks: int, tp: int) -> tuple[str, ...]:
    """The schedules auto compares for stages of `chunks` chunks whose largest TP degree is
    `tp` (module docstring), in tie-breaking order."""
    if chunks > 1:
        return ("interleaved",)
    try:
        check_split_backward(parallel, tp, "--pipeline-schedule auto")
    except ConfigError:
        return ("1f1b", "eager-1f1b")
    return ("1f1b", "eager-1f1b", "zb-h1", "eager-zb")


@dataclass(frozen=True)
class Profile:
    """Seconds per stage and chunk ([stage][chunk]) of one micro-batch: `forward`, the whole
    `backward`, and a split backward's `input_grad` (B) and `weight_grad` (W), None when no
    candidate splits; `link`: one activation-sized message over the slowest boundary."""

    forward: tuple[tuple[float, ...], ...]
    backward: tuple[tuple[float, ...], ...]
    input_grad: tuple[tuple[float, ...], ...] | None
    weight_grad: tuple[tuple[float, ...], ...] | None
    link: float

    def describe(self) -> str:
        """'F/B ms per micro-batch: stage 0 1.20/2.30, ...; a message 0.40 ms' (a chunk's
        times summed per stage; with a split backward F/B/B-input/W)."""
        stages = []
        for s, forward in enumerate(self.forward):
            parts = [forward, self.backward[s]]
            if self.input_grad is not None:
                parts += [self.input_grad[s], self.weight_grad[s]]
            stages.append(f"stage {s} " + "/".join(f"{sum(p) * 1e3:.2f}" for p in parts))
        what = "F/B/B-input/W" if self.input_grad is not None else "F/B"
        return (f"{what} ms per micro-batch: {', '.join(stages)}; a message "
                f"{self.link * 1e3:.2f} ms")


@dataclass(frozen=True)
class Choice:
    """The candidates, their predicted steps (seconds) and the index of the fastest."""

    names: tuple[str, ...]
    steps: tuple[float, ...]
    index: int
    profile: Profile

    @property
    def name(self) -> str:
        return self.names[self.index]

    def line(self) -> str:
        """The start-up line: the choice, every candidate's predicted step, the times used."""
        rows = ", ".join(f"{name} {step * 1e3:.1f} ms" + (" (chosen)" if i == self.index else "")
                         for i, (name, step) in enumerate(zip(self.names, self.steps)))
        chosen = self.steps[self.index] * 1e3
        return (f"pipeline schedule auto: chose {self.name}, predicted {chosen:.1f} ms a step; "
                f"predicted steps: {rows}; from the start-up profile, {self.profile.describe()}")


def predict(name: str, profile: Profile, micro: int, prefetch: bool, sends: str) -> float:
    """The simulator's step of schedule `name` over `micro` micro-batches with `profile`'s
    times (a split backward's B and W for a schedule of SPLIT_BACKWARD, else the whole
    backward); `sends`: simulate.run's (how the backend moves a message)."""
    stages, chunks = len(profile.forward), len(profile.forward[0])
    lists = [schedule(name, stages, s, micro, chunks, prefetch) for s in range(stages)]
    if name in SPLIT_BACKWARD:
        return run(lists, stages, profile.forward, profile.input_grad, profile.link,
                   sends=sends, weight=profile.weight_grad).step
    return run(lists, stages, profile.forward, profile.backward, profile.link, sends=sends).step


def pick(names: Sequence[str], profile: Profile, micro: int, prefetch: bool,
         sends: str) -> Choice:
    """The fastest of `names` by `predict` (ties: the earlier name)."""
    steps = tuple(predict(name, profile, micro, prefetch, sends) for name in names)
    return Choice(tuple(names), steps, steps.index(min(steps)), profile)


def random_batch(rows: int, seq: int, vocab: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch of `rows` sequences of random tokens: tokens, labels, loss mask [b, s]."""
    generator = torch.Generator(device=device).manual_seed(1234)
    tokens, labels = (torch.randint(0, vocab, (rows, seq), device=device, generator=generator)
                      for _ in range(2))
    return tokens, labels, torch.ones(rows, seq, device=device)


def _elapsed(device: torch.device, fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of fn(), the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def _time_chunk(chunk: nn.Module, batch: tuple[torch.Tensor, ...], x: torch.Tensor | None,
                grad: torch.Tensor | None, store: WeightGradStore | None) -> list[float]:
    """One sample of [forward, whole backward] (with `store`: then B, W) of `chunk`."""
    tokens, labels, loss_mask = batch
    device = tokens.device

    def forward() -> torch.Tensor:
        inputs = None if x is None else x.detach().requires_grad_()
        out = chunk(tokens, labels, loss_mask, decoder_input=inputs)
        return micro_batch_loss(out, loss_mask) if chunk.post_process else out

    forward_s, out = _elapsed(device, forward)
    sample = [forward_s, _elapsed(device, lambda: torch.autograd.backward(out, grad))[0]]
    if store is not None:
        split_out = forward()
        sample.append(_elapsed(device, lambda: backward_input(split_out, grad, store, 0))[0])
        sample.append(_elapsed(device, lambda: backward_weight(store, 0))[0])
    return sample


def time_chunks(chunks: nn.ModuleList, batch: tuple[torch.Tensor, ...],
                shape: tuple[int, ...], dtype: torch.dtype, split: bool,
                warmup: int = 1, runs: int = 3) -> list[list[float]]:
    """Per chunk, the median seconds of [forward, whole backward] (`split`: then B, W) of
    micro-batch `batch` (tokens, labels, loss mask) through each chunk alone; `shape`: a
    received activation's (module docstring). Leaves the chunks' gradients None."""
    device = batch[0].device
    generator = torch.Generator(device=device).manual_seed(1234)
    times = []
    with torch.enable_grad():
        for chunk in chunks:
            x, grad = (torch.randn(shape, dtype=dtype, device=device, generator=generator)
                       if needed else None
                       for needed in (not chunk.pre_process, not chunk.post_process))
            store = WeightGradStore.of(chunk) if split else None
            samples = [_time_chunk(chunk, batch, x, grad, store)
                       for _ in range(warmup + runs)][warmup:]
            times.append([statistics.median(sample[k] for sample in samples)
                          for k in range(len(samples[0]))])
    chunks.zero_grad(set_to_none=True)
    return times


def time_link(transport: Transport | None, stage: int, stages: int, shape: tuple[int, ...],
              dtype: torch.dtype, device: torch.device, group, warmup: int = 1,
              runs: int = 3) -> float:
    """The median seconds of half a round trip over this stage's boundaries: an activation to
    the next stage (micro-batch 0, chunk 0) while one comes from the previous, then a gradient
    back while one comes from the next, every operation posted before any is waited. A
    collective over `group` (the pipeline group: its barrier starts every round together)."""
    if transport is None:
        return 0.0
    payload = torch.zeros(shape, dtype=dtype, device=device)

    def exchange(up: bool, down: bool, send, receive) -> None:
        handles = [send(payload, 0, 0)] if up else []
        handles += [receive(0, 0)[0]] if down else []
        transport.flush()
        for handle in handles:
            handle.wait()

    def round_trip() -> None:
        exchange(stage < stages - 1, stage > 0, transport.send_activation,
                 transport.recv_activation)
        exchange(stage > 0, stage < stages - 1, transport.send_grad, transport.recv_grad)

    samples = []
    for _ in range(warmup + runs):
        comm.barrier(group=group)
        samples.append(_elapsed(device, round_trip)[0] / 2)
    return statistics.median(samples[warmup:])


def stage_profile(rows: Sequence[Sequence[float]], stages: int, chunks: int,
                  split: bool) -> Profile:
    """The Profile of the gathered rows ([stage, link, then per chunk F, B (, B-input, W)]):
    per stage its slowest rank's times, the slowest link."""
    width = 4 if split else 2
    slowest = [[0.0] * (chunks * width) for _ in range(stages)]
    for row in rows:
        stage = int(row[0])
        slowest[stage] = [max(a, b) for a, b in zip(slowest[stage], row[2:], strict=True)]

    def column(k: int) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(times[v * width + k] for v in range(chunks)) for times in slowest)

    return Profile(column(0), column(1), column(2) if split else None,
                   column(3) if split else None, max(row[1] for row in rows))


def _gather(values: list[float], stage: int, group) -> list[list[float]]:
    """Every member's [stage, *values] over `group`, in group order."""
    device = comm.group_device(group)
    row = torch.tensor([float(stage), *values], dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size(group) * row.numel(), dtype=torch.float64,
                        device=device)
    comm.all_gather_single(every, row, group=group)
    return every.view(-1, row.numel()).tolist()


def profile_and_pick(chunks: nn.ModuleList, transport: Transport | None, dims, stage: int,
                     stages: int, names: Sequence[str], batch: tuple[torch.Tensor, ...],
                     shape: tuple[int, ...], dtype: torch.dtype, micro: int,
                     prefetch: bool) -> tuple[str, Choice | None]:
    """The profiling pass and the pick (module docstring) for stage `stage` of `stages`:
    returns the chosen schedule's name, the same on every rank, and on rank 0 its Choice (None
    elsewhere). A collective over the world; `batch`: a micro-batch of this rank's rows
    (random_batch), `shape`: a received activation's."""
    split = any(name in SPLIT_BACKWARD for name in names)
    device = batch[0].device
    with _rng_untouched(dims, device):
        times = time_chunks(chunks, batch, shape, dtype, split)
    link = time_link(transport, stage, stages, shape, dtype, device, dims.pp_group)
    rows = _gather([link, *(t for chunk in times for t in chunk)], stage, dims.pp_group)
    choice = None
    index = torch.zeros(1, dtype=torch.int64, device=comm.group_device())
    if dims.rank == 0:
        sends = "rendezvous" if device.type == "cuda" else "handed"  # NCCL; gloo over TCP
        choice = pick(names, stage_profile(rows, stages, len(chunks), split), micro, prefetch,
                      sends)
        index[0] = SCHEDULES.index(choice.name)
    comm.broadcast(index, src=0)
    return SCHEDULES[int(index[0])], choice


@contextlib.contextmanager
def _rng_untouched(dims, device: torch.device) -> Iterator[None]:
    """Inside, the default generators (the CPU's, this CUDA device's) and the TP tracker's
    streams may draw: they are put back on exit (a tracker made inside is dropped)."""
    tracker = dims.rng
    states = None if tracker is None else tracker.get_states()
    cuda = [device.index if device.index is not None else torch.cuda.current_device()
            ] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            if tracker is None:
                dims.rng = None
            else:
                tracker.set_states(states)
