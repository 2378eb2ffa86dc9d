"""The link settings of benchmarks/bench_domino.py's communication-bound testbed, and the bus
bandwidth of the collectives tensor parallelism runs, measured at a layer's message sizes.

A link setting is a set of NCCL environment variables that the benchmark exports in each rank
before NCCL starts (the benchmark's testbed, not library behaviour: megadomino reads no
environment). Every setting names the whole set of variables it manages: a variable it does not
set is removed, so `--link nvlink` is NCCL's defaults whatever the calling shell exported. The
settings restrict NCCL only: SP's fused collectives (torch symmetric memory) still copy over
NVLink, so that column runs only under nvlink (BYPASSES_NCCL).

Bus bandwidth follows nccl-tests: for a message of S bytes (a layer's activation s x b x h, the
all-reduce's input, the reduce-scatter's input, the all-gather's output) that takes t seconds
among n ranks, all-reduce moves 2 (n-1)/n S per rank, reduce-scatter and all-gather (n-1)/n S.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megadomino.distributed import comm
from megadomino.pipeline.placement.scale import BUS_FACTOR


@dataclass(frozen=True)
class LinkSetting:
    env: dict[str, str]
    emulates: str


LINKS = {
    "nvlink": LinkSetting({}, "NCCL's defaults: P2P over NVLink (an HGX/DGX server)"),
    "pcie": LinkSetting(
        {"NCCL_P2P_DISABLE": "1"},
        "no GPU peer-to-peer: every transfer staged through host memory (NCCL's SHM transport), "
        "as on PCIe cards without P2P (workstation GPUs, GPUs under different CPU sockets)"),
    "pcie-1ch": LinkSetting(
        {"NCCL_P2P_DISABLE": "1", "NCCL_MIN_NCHANNELS": "1", "NCCL_MAX_NCHANNELS": "1",
         "NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "1"},
        "host-memory staging through one NCCL channel: a slower or shared PCIe path (a switch "
        "shared by several cards), or one NIC a GPU between hosts; meant to sit between pcie "
        "and socket (each row's bandwidth probe says where it does)"),
    "socket": LinkSetting(
        {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
         "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"},
        "NCCL's TCP sockets over the loopback interface: tensor parallelism across hosts over "
        "Ethernet without RDMA"),
}
"""`--link` choices: what each is meant to emulate; the bandwidth each gives is measured per row
(measure_collectives), not assumed. Both channel-count names are set: older NCCL releases read
*_NCHANNELS, newer ones *_CTAS."""

BYPASSES_NCCL = (
    "not run on this link: SP's fused collectives (--tp-comm-overlap) move data with torch "
    "symmetric memory (CUDA peer copies over NVLink), which no NCCL variable restricts")
"""Why bench_domino leaves the fused SP column out under every link but nvlink."""


def link_carries_fused_sp(link: str | None) -> bool:
    """Whether the fused SP column measures `link`: only NCCL's own defaults (nvlink) or no
    NCCL setting at all (gloo on CPUs, where the fused path runs plain collectives)."""
    return link in (None, "nvlink")


MANAGED = sorted({name for link in LINKS.values() for name in link.env})


def link_help() -> str:
    """Each setting, what it emulates and its variables (the --link help)."""
    parts = []
    for name, link in LINKS.items():
        variables = " ".join(f"{key}={value}" for key, value in link.env.items())
        parts.append(f"{name}: {link.emulates} ({variables or 'no variables'})")
    return "; ".join(parts)


def link_environment(name: str, environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with the variables of link `name` set and the other managed variables removed."""
    if name not in LINKS:
        raise ValueError(f"--link {name!r} is unknown; choose one of: {', '.join(LINKS)}")
    env = {key: value for key, value in environ.items() if key not in MANAGED}
    env.update(LINKS[name].env)
    return env


def bus_bandwidth(collective: str, nbytes: int, seconds: float, world: int) -> float:
    """Bus bandwidth in GB/s (1e9 bytes) of one collective over `nbytes` (module docstring)."""
    return nbytes * BUS_FACTOR[collective](world) / seconds / 1e9


def device_timer(device: torch.device):
    """(start, stop): stop(start()) is the milliseconds between them, the work queued on the
    device included on a GPU (CUDA events on the current stream, into which every step joins
    its side streams; stop then waits for the whole device), else the wall clock."""
    if device.type == "cuda":
        def start():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def stop(begin):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            return begin.elapsed_time(end)
        return start, stop
    return time.perf_counter, lambda begin: (time.perf_counter() - begin) * 1e3


def _calls(full: torch.Tensor, shard: torch.Tensor, group) -> dict:
    """Each collective on one message: `full` the whole activation, `shard` a rank's 1/n."""
    return {"all_reduce": lambda: comm.all_reduce(full, group=group),
            "reduce_scatter": lambda: comm.reduce_scatter_single(shard, full, group=group),
            "all_gather": lambda: comm.all_gather_single(full, shard, group=group)}


def message_numels(seq: int, hidden: int, micro_batch: int, batch_slices) -> list[int]:
    """Elements of one activation s x b x h (what every TP collective of a layer moves) and of
    the largest batch slice for each N in `batch_slices` (Domino's per-slice collectives)."""
    slices = {-(-micro_batch // n) for n in batch_slices if n <= micro_batch}
    return sorted({seq * hidden * b for b in (micro_batch, *slices)}, reverse=True)


def measure_collectives(numels: list[int], dtype: torch.dtype, device: torch.device,
                        group=None, warmup: int = 2, iters: int = 5) -> dict[int, dict]:
    """Per message size (elements), per collective: the median ms over `iters` (after `warmup`),
    MAX over ranks, and its bus bandwidth in GB/s. Sizes are rounded down to a multiple of the
    world size. A collective the backend lacks is reported as {"error": ...}."""
    world = dist.get_world_size(group)
    start, stop = device_timer(device)
    results: dict[int, dict] = {}
    for numel in numels:
        numel -= numel % world
        full = torch.randn(numel, device=device).to(dtype)
        shard = torch.empty(numel // world, device=device, dtype=dtype)
        row = results.setdefault(numel, {"bytes": numel * full.element_size()})
        for name, call in _calls(full, shard, group).items():
            try:
                for _ in range(warmup):
                    call()
                times = []
                for _ in range(iters):
                    begin = start()
                    call()
                    times.append(stop(begin))
            except (RuntimeError, NotImplementedError) as error:
                row[name] = {"error": f"{type(error).__name__}: {error}"[:200]}
                continue
            ms = torch.tensor([statistics.median(times)], device=device)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
            row[name] = {"ms": ms.item(),
                         "bus_gbps": bus_bandwidth(name, row["bytes"], ms.item() / 1e3, world)}
    return results
