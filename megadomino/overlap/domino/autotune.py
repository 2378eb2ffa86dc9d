"""`--domino` (or `--domino-batch-slices auto`): time a few Domino plans on the model's real
shapes at start-up and keep the fastest; plain tensor parallelism and Domino's unsliced explicit
backward are always candidates, so auto is never slower than plain TP (up to timing noise).

Every rank times every candidate (forward + backward of the decoder on a random micro-batch, eager:
`--enable-cuda-graph` refuses auto). The candidates are timed in `rounds` interleaved passes, each
pass timing every candidate for `iters` steps after `warmup`, so that a drift of the device's
speed during start-up (clocks, a neighbour's work) falls on every candidate alike; a candidate's
time is the median of its passes, then the MAX over the world (the slowest rank is the step
time). Rank 0 picks and broadcasts its choice, so ranks cannot disagree, and prints the start-up
line (PlanTimes.line): the plan chosen and every candidate with its time.

The timing loop (`time_step`, `interleaved_medians`) is the package's one start-up timer:
--fp8-linears auto (train/fp8_linears.py) times its linears with it too.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from megadomino import overlap
from megadomino.config import DominoPlan
from megadomino.distributed import comm

# (N, K); (1, 1) is the plain TP path, "1x1-runner" Domino's explicit backward without slicing.
CANDIDATES = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]
PLAIN_TP = (1, 1, False)
"""A candidate is (batch slices N, hidden slices K, under Domino's runner); this one is plain TP."""


def candidates(config, tp: int, micro_batch: int) -> list[tuple[int, int, bool]]:
    """The plans auto compares for this layer shape: plain TP, Domino unsliced, and the sliced
    plans of CANDIDATES that fit (N <= micro-batch, K divides this rank's ffn columns)."""
    ffn_local = config.ffn_hidden_size // tp
    plans = [PLAIN_TP, (1, 1, True)]
    plans += [(n, k, True) for n, k in CANDIDATES[1:] if n <= micro_batch and ffn_local % k == 0]
    return plans


def plan_name(n: int, k: int, runner: bool) -> str:
    if not runner:
        return "plain TP"
    return "Domino unsliced (explicit backward)" if n == k == 1 else f"Domino N={n} K={k}"


@dataclasses.dataclass(frozen=True)
class PlanTimes:
    """The candidates auto timed and its choice, the same on every rank."""

    plans: tuple[tuple[int, int, bool], ...]
    ms: tuple[float, ...]
    """Per candidate: ms per micro-batch (decoder forward + backward), median of the passes, MAX
    over ranks."""
    choice: int
    """Index into plans: the fastest (rank 0's pick, broadcast)."""
    passes: int

    @property
    def plan(self) -> DominoPlan:
        """The chosen plan; DominoPlan() (not enabled) is plain TP."""
        return DominoPlan(*self.plans[self.choice])

    def line(self) -> str:
        """'domino auto: chose <plan> at <ms> ms (<x> plain TP's time); ...: <every candidate
        and its ms>'."""
        chosen = self.ms[self.choice]
        against = ""
        if self.plans[self.choice] != PLAIN_TP and PLAIN_TP in self.plans:
            against = f" ({chosen / self.ms[self.plans.index(PLAIN_TP)]:.3f}x plain TP's time)"
        rows = ", ".join(f"{plan_name(*plan)} {ms:.2f} ms" + (" (chosen)" if i == self.choice
                                                             else "")
                         for i, (plan, ms) in enumerate(zip(self.plans, self.ms)))
        return (f"domino auto: chose {plan_name(*self.plans[self.choice])} at {chosen:.2f} ms"
                f"{against}; timed the decoder's forward+backward per micro-batch, median of "
                f"{self.passes} passes, slowest rank: {rows}")


def time_step(block, x, grad, rotary, warmup: int, iters: int) -> float:
    """ms per call of `block(x, rotary)` and its backward from `grad` (x.grad reset each call):
    the mean of `iters` calls after `warmup`, the device synchronized around them."""
    def step():
        x.grad = None
        out = block(x, rotary)
        out.backward(grad)
    for _ in range(warmup):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - begin) / iters * 1e3


def interleaved_medians(timers: Sequence[Callable[[], float]], rounds: int,
                        device: torch.device, world_size: int) -> torch.Tensor:
    """fp32 [len(timers)] on `device`: each timer's ms (one call of it times one pass), timed
    in `rounds` interleaved passes (every timer once a pass, in order, so a drift of the
    device's speed falls on all alike), the median of its passes, then the MAX over the world
    (the slowest rank is the step time). A collective when world_size > 1: every rank calls
    it with as many timers."""
    passes: list[list[float]] = [[] for _ in timers]
    for _ in range(rounds):
        for times, timer in zip(passes, timers):
            times.append(timer())
    measured = torch.tensor([statistics.median(times) for times in passes], device=device)
    if world_size > 1:
        comm.all_reduce(measured, op=comm.ReduceOp.MAX)
    return measured


def time_plans(model, micro_batch_size: int, warmup: int = 1, iters: int = 2,
               rounds: int = 3) -> PlanTimes:
    """Time every candidate on `model.decoder` (module docstring) and pick the fastest. The model
    is left with the runner its own config asks for and no gradients. A collective: every rank
    calls it."""
    block, config, dims = model.decoder, model.config, model.dims
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    seq = config.seq_length // dims.tp if model.sequence_parallel else config.seq_length
    gen = torch.Generator(device=device).manual_seed(1234)
    x = torch.randn(seq, micro_batch_size, config.hidden_size, device=device, dtype=dtype,
                    generator=gen).requires_grad_()
    grad = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    rotary = model.rotary(config.seq_length, None, device)
    plans = candidates(config, dims.tp, micro_batch_size)

    def timer(plan: tuple[int, int, bool]) -> Callable[[], float]:
        def one_pass() -> float:
            overlap.apply(model, dataclasses.replace(model.parallel, domino=DominoPlan(*plan)))
            return time_step(block, x, grad, rotary, warmup, iters)
        return one_pass

    measured = interleaved_medians([timer(plan) for plan in plans], rounds, device,
                                   dims.world_size)
    overlap.apply(model, model.parallel)
    model.zero_grad(set_to_none=True)
    choice = torch.tensor([int(measured.argmin())], device=device)
    if dims.world_size > 1:
        comm.broadcast(choice, src=0)
    return PlanTimes(tuple(plans), tuple(measured.tolist()), int(choice), rounds)


def autotune_domino(model, micro_batch_size: int, log=print, **timing) -> DominoPlan:
    """Time the candidate plans on `model.decoder` (time_plans; `timing`: its warmup, iters,
    rounds), install the fastest and, on rank 0, log the start-up line naming it and every time
    compared. Returns its DominoPlan: DominoPlan() (not enabled) is plain TP."""
    timed = time_plans(model, micro_batch_size, **timing)
    overlap.apply(model, dataclasses.replace(model.parallel, domino=timed.plan))
    if model.dims.rank == 0:
        log(timed.line())
    return timed.plan
