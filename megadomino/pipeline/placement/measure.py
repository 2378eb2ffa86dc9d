"""The start-up measurement `--pipeline-plan auto` plans from: bandwidth and latency from every
rank to every other, both directions, and each rank's GEMM speed.

Links. One pair at a time (a barrier between pairs), so that no two probes share a link: ranks
of one host share its uplink, and two probes at once would each see part of it. For a pair
(i, j), lower rank first:
- latency: PINGS round trips of a one-element message from each side, the least of all;
  latency(i, j) = latency(j, i) = half of it. Each received ping follows transport_delay.py's
  rule, so an emulated --pipeline-link-delay is in the latency the planner sees.
- bandwidth, each direction on its own (a rate limit shapes one direction only): the sender
  posts two messages of N bytes back to back; the receiver times the arrival of the second
  after the first, bw = N / (t2 - t1). The first message drains a token bucket's burst (tc's
  tbf: its burst passes at line rate, which would make a message smaller than it look fast) and
  the latency cancels out. N starts at PROBE_MIN_BYTES, four times the 256 kB burst of
  scripts/lib/netns.sh's tbf, and grows 4x while the timed message takes less than
  SLOPE_TARGET seconds, up to PROBE_MAX_BYTES, and while the pair's share of the budget lasts.
Budget: `budget` seconds (default 30) for the links, shared evenly by the pairs still to
measure. A pair over a slow link may take longer than its share, since N never goes below
PROBE_MIN_BYTES: on the 3-site testbed of benchmarks/bench_placement_netns.sh (4 ranks) the
links take about 10 s, most of it the three pairs over the 10 Mbit/s link.

Speed. Every rank at once, as in training (ranks that share a host share its cores and memory
bandwidth): a GEMM of the model's MLP shape, (seq, hidden) x (hidden, ffn), in the training
dtype, repeated for GEMM_SECONDS; speed = FLOPs / seconds.

The measurement is a world collective: every rank calls it and returns the `Machine` all
gathered, the same value everywhere, so that every rank plans the
same plan.
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

from megadomino.distributed import comm
from megadomino.pipeline.placement.cost import Machine
from megadomino.pipeline.transport_delay import delayed_wait

PINGS = 5
PROBE_MIN_BYTES = 1 << 20
PROBE_MAX_BYTES = 16 << 20
SLOPE_TARGET = 0.02
GEMM_SECONDS = 0.25
DEFAULT_BUDGET = 30.0


class _Clock:
    """Seconds at the moment a wait returned: the host's clock, or on a GPU the stream's
    (CUDA events: an NCCL wait only makes the stream wait)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def between(self, first: int, second: int) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return self.marks[first].elapsed_time(self.marks[second]) / 1e3
        return self.marks[second] - self.marks[first]


def measure_links(budget: float = DEFAULT_BUDGET, delay: float = 0.0
                  ) -> tuple[list[list[float]], list[list[float]]]:
    """(bandwidth, latency) matrices of the world, gathered: alike on every rank (module
    docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = comm.group_device()
    payload = torch.zeros(PROBE_MAX_BYTES, dtype=torch.uint8, device=device)
    inbound = torch.empty(2, PROBE_MAX_BYTES, dtype=torch.uint8, device=device)
    incoming = [[float("inf"), 0.0] for _ in range(world)]  # peer -> (bw, latency) toward me
    pairs = list(itertools.combinations(range(world), 2))
    started = time.perf_counter()
    for index, (low, high) in enumerate(pairs):
        comm.barrier()
        if rank not in (low, high):
            continue
        peer = high if rank == low else low
        share = max(0.0, budget - (time.perf_counter() - started)) / (len(pairs) - index)
        pair_start = time.perf_counter()
        for pinger in (low, high):
            latency = _ping(peer, rank == pinger, device, delay)
            if rank == pinger:
                incoming[peer][1] = latency
        for sender in (low, high):
            rate = _stream(peer, rank == sender, payload, inbound, device,
                           pair_start + share)
            if rank != sender:
                incoming[peer][0] = rate
    rows = comm.all_gather_object(incoming)  # rows[j][i]: from i toward j; alike everywhere
    bandwidth = [[float("inf") if i == j else rows[j][i][0] for j in range(world)]
                 for i in range(world)]
    latency = [[0.0 if i == j else min(rows[j][i][1], rows[i][j][1]) for j in range(world)]
               for i in range(world)]
    return bandwidth, latency


def _ping(peer: int, pinging: bool, device: torch.device, delay: float) -> float:
    """The least round trip / 2 of PINGS pings (on the pinging side; 0.0 on the other)."""
    box = torch.zeros(1, device=device)
    best = float("inf")
    for _ in range(PINGS):
        start = time.perf_counter()
        if pinging:
            comm.isend(box, peer).wait()
            delayed_wait(comm.irecv(box, peer), delay)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        else:
            delayed_wait(comm.irecv(box, peer), delay)
            comm.isend(box, peer).wait()
    return best / 2 if pinging else 0.0


def _stream(peer: int, sending: bool, payload: torch.Tensor, inbound: torch.Tensor,
            device: torch.device, deadline: float) -> float:
    """One direction's bandwidth, bytes/s (on the receiving side; 0.0 on the sending side):
    two back-to-back messages of N bytes, N growing 4x while the second arrives in less than
    SLOPE_TARGET seconds; the receiver decides and tells the sender."""
    size, verdict = PROBE_MIN_BYTES, torch.zeros(1, device=device)
    while True:
        if sending:
            works = [comm.isend(payload[:size], peer), comm.isend(payload[:size], peer)]
            for work in works:
                work.wait()
            comm.irecv(verdict, peer).wait()
            rate = 0.0
        else:
            clock = _clock_pair(peer, size, inbound, device)
            slope = clock.between(0, 1)
            rate = size / slope if slope > 0 else float("inf")
            grow = slope < SLOPE_TARGET and size < PROBE_MAX_BYTES and time.perf_counter() < \
                deadline
            verdict.fill_(1.0 if grow else 0.0)
            comm.isend(verdict, peer).wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if verdict.item() == 0.0:
            return rate
        size = min(4 * size, PROBE_MAX_BYTES)


def _clock_pair(peer: int, size: int, inbound: torch.Tensor, device: torch.device) -> _Clock:
    clock = _Clock(device)
    works = [comm.irecv(inbound[0, :size], peer), comm.irecv(inbound[1, :size], peer)]
    for work in works:
        work.wait()
        clock.mark()
    return clock


def measure_speed(rows: int, inner: int, cols: int, dtype: torch.dtype,
                  seconds: float = GEMM_SECONDS, slowdown: float = 1.0) -> list[float]:
    """Every rank's FLOP/s on a (rows, inner) x (inner, cols) GEMM, all ranks at once, rank 0
    first, gathered: alike on every rank. `slowdown`: an emulated slower device (after each
    GEMM the rank waits slowdown - 1 times as long as it took)."""
    device = comm.group_device()
    a = torch.randn(rows, inner, device=device).to(dtype)
    b = torch.randn(inner, cols, device=device).to(dtype)
    torch.matmul(a, b)  # warm-up: kernels chosen, memory allocated
    comm.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        begin = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if slowdown > 1:
            time.sleep((slowdown - 1) * (time.perf_counter() - begin))
        count += 1
    speed = 2.0 * rows * inner * cols * count / (time.perf_counter() - start)
    return comm.all_gather_object(speed)


def measure_machine(rows: int, inner: int, cols: int, dtype: torch.dtype,
                    budget: float = DEFAULT_BUDGET, delay: float = 0.0,
                    slowdown: float = 1.0) -> Machine:
    """The world's Machine (module docstring): speeds first, then the links."""
    speed = measure_speed(rows, inner, cols, dtype, slowdown=slowdown)
    bandwidth, latency = measure_links(budget, delay)
    return Machine(tuple(map(tuple, bandwidth)), tuple(map(tuple, latency)), tuple(speed))


def describe(machine: Machine) -> str:
    """The measurement as printed at start-up: Mbit/s from each row's rank to each column's,
    latency in ms, GFLOP/s."""
    world = machine.world
    head = "from\\to" + "".join(f"{j:>11}" for j in range(world))
    lines = ["links (Mbit/s, row -> column):", head]
    for i in range(world):
        cells = "".join(f"{'-':>11}" if i == j else f"{machine.bandwidth[i][j] * 8e-6:>11.4g}"
                        for j in range(world))
        lines.append(f"{i:>7}{cells}")
    lines.append("latency (ms): " + ", ".join(
        f"{i}-{j} {machine.latency[i][j] * 1e3:.3g}"
        for i, j in itertools.combinations(range(world), 2)))
    lines.append("GEMM speed (GFLOP/s): " + ", ".join(
        f"{rank}: {speed / 1e9:.3g}" for rank, speed in enumerate(machine.speed)))
    return "\n".join(lines)
