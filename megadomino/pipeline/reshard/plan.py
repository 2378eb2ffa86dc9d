"""Tile-to-slice planning and the traffic each strategy puts on each link.

For each destination tile (a box held by one or more destination ranks, its replicas) and each
source tile that overlaps it, their intersection is a *slice* that one of the source tile's
holders must deliver to every replica: a `Transfer`. A strategy turns transfers into *works*,
the units a solver gives a sender:

- `send_recv`: one work per (slice, receiver); the sender sends the slice to that receiver.
- `send_recv_allgather`: the slice's elements (row-major) split into one part per replica; one
  work per part, sent to its replica; then the replicas exchange their parts (each part sent by
  its replica to every other replica: the all-gather inside the destination mesh, as P2P).
- `broadcast`: one work per slice: torch's broadcast on the group {sender} + replicas. gloo runs
  it as a binomial tree over the group's ranks in ascending order, rooted at the sender (virtual
  rank v = (rank - root) mod n; in round i every v < 2^i with bit i clear sends to v + 2^i), not
  pipelined: each edge carries the whole slice after the edge into its source has finished.
  NCCL runs it as a pipelined ring, modelled as the chain of `chained_broadcast` (network.py).
- `chained_broadcast`: one work per slice, sent along a chain sender -> replicas (the sender's
  host first, then host by host), in chunks so that every edge streams at once: each link that
  the chain crosses carries the slice once.

The exchange of `send_recv_allgather` is point-to-point on gloo; on NCCL a ring all-gather:
each part travels the ring of the replicas (host by host) from its owner.

Every work becomes edges (source rank, destination rank), each carrying the work's bytes. An
edge between two hosts loads the source host's uplink ("up", host) and the destination's downlink
("down", host); an edge inside a host loads ("local", host), which has no rate (loopback). With
several NICs per host, or rated GPU ports, the links are the network's (network.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Box, Layout, box_intersection, box_numel, part_range
from .network import DEFAULT_NETWORK, Link, Network

STRATEGIES = ("send_recv", "send_recv_allgather", "broadcast", "chained_broadcast")

Edge = tuple[int, int]
"""(source rank, destination rank) of one copy of a work's bytes."""


@dataclass(frozen=True)
class Transfer:
    """A slice of one destination tile that one holder of a source tile must deliver.

    box: the slice, in full-tensor coordinates; tile: the destination tile it belongs to;
    senders: the source tile's holders (ascending); receivers: the tile's replicas (ascending)."""

    box: Box
    tile: Box
    senders: tuple[int, ...]
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class Work:
    """What one sender sends: elements [start, stop) of `transfer.box` flattened row-major, to
    `receivers` (one rank, or all of the tile's replicas for the broadcasts)."""

    transfer: Transfer
    start: int
    stop: int
    receivers: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_transfers(shape: tuple[int, ...], src: Layout, dst: Layout) -> list[Transfer]:
    """Every (destination tile, overlapping source tile) slice, in destination-tile order then
    source-tile order (both in their meshes' rank order): the same list on every rank."""
    if set(src.mesh.ranks) & set(dst.mesh.ranks):
        raise ValueError(f"source ranks {src.mesh.ranks} and destination ranks "
                         f"{dst.mesh.ranks} overlap; resharding moves between disjoint meshes")
    src_tiles = src.tiles(shape)
    transfers = []
    for tile, receivers in dst.tiles(shape).items():
        for src_tile, senders in src_tiles.items():
            box = box_intersection(tile, src_tile)
            if box is not None:
                transfers.append(Transfer(box, tile, senders, receivers))
    return transfers


def make_works(strategy: str, transfers: list[Transfer]) -> list[Work]:
    """The works of `strategy` (see the module docstring), transfer by transfer."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: choose from auto, {', '.join(STRATEGIES)}")
    works = []
    for transfer in transfers:
        numel = box_numel(transfer.box)
        if strategy == "send_recv":
            works += [Work(transfer, 0, numel, (r,)) for r in transfer.receivers]
        elif strategy == "send_recv_allgather":
            for start, stop, receiver in allgather_parts(transfer, numel):
                works.append(Work(transfer, start, stop, (receiver,)))
        else:
            works.append(Work(transfer, 0, numel, transfer.receivers))
    return works


def allgather_parts(transfer: Transfer, numel: int) -> list[tuple[int, int, int]]:
    """(start, stop, replica) of each non-empty part of a slice split over its replicas."""
    parts = [(*part_range(numel, len(transfer.receivers), index), receiver)
             for index, receiver in enumerate(transfer.receivers)]
    return [(start, stop, receiver) for start, stop, receiver in parts if stop > start]


def chain_order(sender: int, receivers: tuple[int, ...], host_of: dict[int, str]) -> list[int]:
    """The chain of a chained broadcast: the sender, the replicas on its host, then the other
    hosts' replicas host by host (hosts in the order of their lowest replica)."""
    hosts = [host_of[sender]]
    for receiver in receivers:
        if host_of[receiver] not in hosts:
            hosts.append(host_of[receiver])
    return [sender] + [r for host in hosts for r in receivers if host_of[r] == host]


def binomial_edges(sender: int, receivers: tuple[int, ...]) -> list[Edge]:
    """gloo's broadcast tree over sorted({sender} + receivers), rooted at the sender."""
    group = sorted({sender, *receivers})
    size, root = len(group), group.index(sender)
    edges, step = [], 1
    while step < size:
        for vrank in range(step):
            if vrank + step < size:
                edges.append((group[(vrank + root) % size], group[(vrank + step + root) % size]))
        step *= 2
    return edges


def work_edges(strategy: str, work: Work, sender: int, host_of: dict[int, str],
               network: Network = DEFAULT_NETWORK) -> list[Edge]:
    """The edges that carry `work` from `sender`, each the work's whole payload."""
    if strategy == "broadcast" and not network.rings:
        return binomial_edges(sender, work.receivers)
    if strategy in ("broadcast", "chained_broadcast"):
        chain = chain_order(sender, work.receivers, host_of)
        return list(zip(chain[:-1], chain[1:]))
    return [(sender, receiver) for receiver in work.receivers]


def exchange_edges(work: Work, host_of: dict[int, str] | None = None,
                   network: Network = DEFAULT_NETWORK) -> list[Edge]:
    """send_recv_allgather's second phase for one part: its replica sends it to the others
    (gloo), or it travels the replicas' ring from its replica (NCCL's all-gather)."""
    (owner,) = work.receivers
    if not network.rings:
        return [(owner, other) for other in work.transfer.receivers if other != owner]
    ring = chain_order(work.transfer.receivers[0], work.transfer.receivers, host_of)[1:]
    start = ring.index(owner)  # one ring for every part, entered at its owner
    ring = ring[start:] + ring[:start]
    return list(zip(ring[:-1], ring[1:]))


def add_edge_bytes(loads: dict[Link, int], edge: Edge, nbytes: int, host_of: dict[int, str],
                   network: Network = DEFAULT_NETWORK) -> None:
    """Count `nbytes` sent over `edge` on the links it crosses."""
    for link in network.edge_links(edge, host_of):
        loads[link] = loads.get(link, 0) + nbytes


def edge_loads(edges: list[Edge], nbytes: int, host_of: dict[int, str],
               network: Network = DEFAULT_NETWORK) -> dict[Link, int]:
    loads: dict[Link, int] = {}
    for edge in edges:
        add_edge_bytes(loads, edge, nbytes, host_of, network)
    return loads
