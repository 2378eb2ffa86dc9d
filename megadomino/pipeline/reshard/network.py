"""The machine a plan is made for: which links a message crosses, and what the backend does.

Links. Ranks fill hosts in order (torchrun's and `--gpus-per-node`'s placement), so rank r is
GPU d = r % gpus_per_host of its host. A host has nics_per_host NICs, its GPUs spread evenly
over them: GPU d sends and receives through NIC d * nics_per_host // gpus_per_host. An edge
between hosts loads the sender's NIC uplink ("up", nic) and the receiver's NIC downlink
("down", nic). With one NIC (the default) the NIC is named after its host, so senders are
balanced per host; with nics_per_host = gpus_per_host every GPU has its own NIC ("host/nicD")
and senders are balanced per device. An edge inside a host loads ("local", host), which has no
rate (loopback), unless local_rate is given: then it loads the sender GPU's ("out", "host/gpuD")
and the receiver's ("in", ...) port, each local_rate bytes/s (NVLink or PCIe on a GPU host).

Backends (what plan.py's `broadcast` strategy and the all-gather exchange become; cost.py
prices them):
- gloo: broadcast is a binomial tree (gloo/broadcast.cc: in round i, virtual rank v < 2^i
  sends the whole message to v + 2^i; a rank posts its sends to all its children at once,
  once it has received the whole message); the exchange is point-to-point, each replica
  sending its part to every other.
- nccl: broadcast is a pipelined ring (NCCL has no tree broadcast, NVIDIA/nccl#317): the
  message flows in chunks along a chain through the group, so its time hardly depends on the
  number of receivers; the exchange is a ring all-gather (each part travels the ring from its
  owner). A rank runs its collectives one after another (one stream, in the plan's order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("gloo", "nccl")

Link = tuple[str, str]
"""("up" | "down", nic) | ("local", host) | ("out" | "in", gpu)."""

NCCL_CHUNK_BYTES = (4 << 20) // 8
"""NCCL's pipeline step for its Simple protocol: NCCL_BUFFSIZE (4 MiB by default) over its
NCCL_STEPS (8) slots; a broadcast moves one step per chunk (BROADCAST_CHUNKSTEPS = 1)."""


@dataclass(frozen=True)
class Network:
    """backend: "gloo" or "nccl"; latency: seconds a message takes to start crossing one hop
    (alpha); chunk_cost: seconds of overhead per pipelined chunk per hop; chunk_bytes: the
    chunk of NCCL's own pipelining (broadcast, all-gather); gpus_per_host, nics_per_host: the
    NIC of each rank (module docstring); local_rate: bytes/s of a GPU's intra-host port, None
    for an unrated loopback. Host link rates come with the plan (make_plan's `rates`), per
    NIC."""

    backend: str = "gloo"
    latency: float = 0.0
    chunk_cost: float = 0.0
    chunk_bytes: int = NCCL_CHUNK_BYTES
    gpus_per_host: int = 1
    nics_per_host: int = 1
    local_rate: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: choose from {', '.join(BACKENDS)}")
        if self.gpus_per_host < 1 or not 1 <= self.nics_per_host <= self.gpus_per_host:
            raise ValueError(f"nics_per_host={self.nics_per_host}, gpus_per_host="
                             f"{self.gpus_per_host}: need 1 <= nics_per_host <= gpus_per_host "
                             "(1: senders balanced per host; gpus_per_host: per device)")
        if min(self.latency, self.chunk_cost) < 0 or self.chunk_bytes < 1:
            raise ValueError(f"latency={self.latency}, chunk_cost={self.chunk_cost}, "
                             f"chunk_bytes={self.chunk_bytes}: costs must be >= 0, chunks >= 1")
        if self.local_rate is not None and not self.local_rate > 0:
            raise ValueError(f"local_rate={self.local_rate}: a rate in bytes/s > 0, or None")

    @property
    def rings(self) -> bool:
        """Whether broadcast and all-gather are rings (NCCL) rather than gloo's tree and
        point-to-point exchange."""
        return self.backend == "nccl"

    def nic(self, rank: int, host: str) -> str:
        if self.nics_per_host == 1:
            return host
        return f"{host}/nic{self.gpu_index(rank) * self.nics_per_host // self.gpus_per_host}"

    def gpu(self, rank: int, host: str) -> str:
        return f"{host}/gpu{self.gpu_index(rank)}"

    def gpu_index(self, rank: int) -> int:
        return rank % self.gpus_per_host

    def edge_links(self, edge: tuple[int, int], host_of: dict[int, str]) -> tuple[Link, ...]:
        """The links a message from edge[0] to edge[1] loads, the sender's side first."""
        (source, target), src_host, dst_host = edge, host_of[edge[0]], host_of[edge[1]]
        if src_host != dst_host:
            return ("up", self.nic(source, src_host)), ("down", self.nic(target, dst_host))
        if self.local_rate is None:
            return (("local", src_host),)
        return ("out", self.gpu(source, src_host)), ("in", self.gpu(target, dst_host))

    def link_rates(self, host_rates: dict[str, float], host_of: dict[int, str]
                   ) -> dict[Link, float]:
        """bytes/s of every rated link the ranks of `host_of` use: each NIC at its host's
        rate, each GPU port at local_rate."""
        rates: dict[Link, float] = {}
        for rank, host in host_of.items():
            for way in ("up", "down"):
                rates[(way, self.nic(rank, host))] = host_rates[host]
            if self.local_rate is not None:
                for way in ("out", "in"):
                    rates[(way, self.gpu(rank, host))] = self.local_rate
        return rates

    def edge_rate(self, edge: tuple[int, int], host_of: dict[int, str],
                  rates: dict[Link, float]) -> float:
        """The slowest rated link of the edge (inf for the loopback)."""
        return min((rates[link] for link in self.edge_links(edge, host_of) if link in rates),
                   default=math.inf)

    def describe(self) -> str:
        per = ("per host" if self.nics_per_host == 1 else "per device"
               if self.nics_per_host == self.gpus_per_host
               else f"{self.nics_per_host} NICs per {self.gpus_per_host} GPUs")
        return f"{self.backend}, senders balanced {per}"


DEFAULT_NETWORK = Network()
"""gloo, one unrated loopback per host, one NIC per host, no latency: times are link bounds."""

NOMINAL = {"nccl": (10e-6, 50e9, 450e9), "gloo": (50e-6, 1.25e9, None)}
"""backend -> (latency s, bytes/s of a NIC, bytes/s of a GPU's intra-host port or None): the
figures the training transport plans with when nothing was measured. nccl: a GPU cluster's
400 Gb/s NIC (InfiniBand NDR) and NVLink 4's 450 GB/s a direction; gloo: a 10 Gb/s Ethernet
NIC, the host's loopback unrated. They set the strategies' relative cost (bytes against
latency, links against ports), which is what the choice depends on; the predicted times are
first-order."""


def nominal_network(backend: str, gpus_per_host: int, nics_per_host: int
                    ) -> tuple[Network, float]:
    """`NOMINAL`'s network for `backend` and the rate of each NIC (make_plan's `rates`)."""
    latency, nic_rate, local_rate = NOMINAL[backend]
    return Network(backend, latency=latency, gpus_per_host=gpus_per_host,
                   nics_per_host=nics_per_host, local_rate=local_rate), nic_rate
