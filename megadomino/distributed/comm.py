"""Every collective and point-to-point call of the package, with the rules NCCL enforces made
the same on gloo, so that CPU tests exercise them.

What differs between the backends, and what this module does about it:
- **Placement.** NCCL takes CUDA tensors only ("No backend type associated with device type
  cpu"); gloo takes CPU tensors (and CUDA ones, through a silent host copy). A tensor on a device
  the group's backend does not serve is moved to the group's device only when it is a small host
  value (at most `HOST_VALUE_LIMIT` elements: a count, a flag, a norm; the result is copied back
  in place), and refused with a `ValueError` naming the call, the tensor and the group's device
  otherwise: a silent copy of an activation or a gradient bucket would hide a placement bug and
  cost a round trip through host memory every step.
- **Batched point-to-point.** `batch_isend_irecv` returns one work per op on gloo and one work
  for the whole batch on NCCL (a coalesced launch). `batch_p2p` returns one `P2PBatch` whatever
  the backend: waiting it waits every op of the batch.

The group's device: CUDA (the current device) for NCCL, the CPU for gloo; a group of several
backends ("cpu:gloo,cuda:nccl") serves each listed device. `group=None` is the default group.

Signatures follow torch.distributed's (tensors first, then `op=`, `group=`, `async_op=`), so the
collective trace (tests/collective_trace.py) records the same protocol whichever layer it wraps.
torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (the old names warn); torch 2.11 has only the old names: both work here.

No other module of the package calls torch.distributed's collectives or P2P functions
(tests/test_architecture.py enforces it); process groups, ranks and sizes are still read from
torch.distributed directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

HOST_VALUE_LIMIT = 1024
"""The most elements a tensor on the wrong device may have and still be moved to the group's
device (a count or a flag): anything larger is refused."""

ReduceOp = dist.ReduceOp
_SERVED = {"nccl": ("cuda",), "gloo": ("cpu",)}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def group_devices(group=None) -> tuple[str, ...]:
    """The device types the group's backend serves ("cpu:gloo,cuda:nccl" -> ("cpu", "cuda"))."""
    backend = str(dist.get_backend(group))
    if ":" not in backend:
        return _SERVED.get(backend, ("cpu", "cuda"))
    return tuple(pair.split(":")[0] for pair in backend.split(","))


def group_device(group=None) -> torch.device:
    """The device a tensor of this group lives on: this rank's current CUDA device when the
    backend serves CUDA (NCCL), else the CPU."""
    if "cuda" in group_devices(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PlacementError(ValueError):
    """A large tensor handed to a group whose backend does not serve its device."""


def _placed(call: str, tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` if the group's backend serves its device, else a copy on the group's device
    (values of at most HOST_VALUE_LIMIT elements only: anything larger is refused)."""
    served = group_devices(group)
    if tensor.device.type in served:
        return tensor
    if tensor.numel() > HOST_VALUE_LIMIT:
        raise PlacementError(
            f"{call}: a tensor of {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} for a "
            f"{dist.get_backend(group)} group, which serves {' and '.join(served)} tensors; "
            f"create it on {group_device(group)} (only values of at most {HOST_VALUE_LIMIT} "
            f"elements are moved)")
    return tensor.to(group_device(group), copy=True)


class _CopyBack:
    """The work of a collective on moved small values: waiting it copies the results back."""

    def __init__(self, work, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.work, self.pairs = work, pairs

    def wait(self) -> bool:
        self.work.wait()
        for original, moved in self.pairs:
            original.copy_(moved)
        return True


def _run(call: str, written: tuple[torch.Tensor, ...], read: tuple[torch.Tensor, ...], group,
         async_op: bool, launch):
    """launch(*written, *read) with each tensor on the group's device; `written` (the tensors
    the collective writes) are copied back when they had to be moved."""
    moved_written = [_placed(call, t, group) for t in written]
    moved_read = [_placed(call, t, group) for t in read]
    work = launch(*moved_written, *moved_read)
    pairs = [(t, m) for t, m in zip(written, moved_written) if m is not t]
    if not pairs:
        return work
    if async_op:
        return _CopyBack(work, pairs)
    for original, moved in pairs:
        original.copy_(moved)
    return work


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce over the group, in place."""
    return _run("all_reduce", (tensor,), (), group, async_op,
                lambda t: dist.all_reduce(t, op=op, group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """`tensor` of global rank `src` to every member, in place."""
    return _run("broadcast", (tensor,), (), group, async_op,
                lambda t: dist.broadcast(t, src, group=group, async_op=async_op))


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False):
    """The members' `input`s concatenated along dim 0 into `output`."""
    return _run("all_gather_single", (output,), (input,), group, async_op,
                lambda o, i: _all_gather_single(o, i, group=group, async_op=async_op))


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                          group=None, async_op: bool = False):
    """`input` reduced over the group; this member keeps its dim-0 chunk in `output`."""
    return _run("reduce_scatter_single", (output,), (input,), group, async_op,
                lambda o, i: _reduce_scatter_single(o, i, op=op, group=group,
                                                    async_op=async_op))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False):
    """Dim-0 chunk i of `input` to member i; chunk i of `output` from member i."""
    return _run("all_to_all_single", (output,), (input,), group, async_op,
                lambda o, i: dist.all_to_all_single(o, i, group=group, async_op=async_op))


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False):
    """Member i's `tensor` into `outputs[i]` (tensors of different shapes allowed)."""
    return _run("all_gather", tuple(outputs), (tensor,), group, async_op,
                lambda *t: dist.all_gather(list(t[:-1]), t[-1], group=group,
                                           async_op=async_op))


def _refuse(call: str, tensor: torch.Tensor, group) -> None:
    """Point-to-point messages are never moved: a tensor on a device the group does not serve
    is refused whatever its size (a receive must land in the caller's buffer)."""
    if tensor.device.type not in group_devices(group):
        raise PlacementError(f"{call}: a tensor on {tensor.device} for a "
                             f"{dist.get_backend(group)} group; create it on "
                             f"{group_device(group)}")


def barrier(group=None) -> None:
    """Every member has reached this call. On NCCL it runs on this rank's current device."""
    if "cuda" in group_devices(group) and "cpu" not in group_devices(group):
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def all_gather_object(obj, group=None) -> list:
    """Every member's picklable `obj`, in group-rank order (NCCL: through the current device)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(obj, src: int = 0, group=None):
    """Global rank `src`'s picklable `obj` on every member."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def send_op(tensor: torch.Tensor, peer: int | None = None, group=None, tag: int = 0,
            group_peer: int | None = None) -> dist.P2POp:
    """A send for `batch_p2p`: to global rank `peer`, or to `group_peer` of `group`. A message
    is never moved: the tensor must be on the group's device."""
    _refuse("send", tensor, group)
    return dist.P2POp(dist.isend, tensor, peer, group=group, tag=tag, group_peer=group_peer)


def recv_op(tensor: torch.Tensor, peer: int | None = None, group=None, tag: int = 0,
            group_peer: int | None = None) -> dist.P2POp:
    """A receive into `tensor` for `batch_p2p` (see send_op)."""
    _refuse("recv", tensor, group)
    return dist.P2POp(dist.irecv, tensor, peer, group=group, tag=tag, group_peer=group_peer)


class P2PBatch:
    """The works of one `batch_p2p`: one on NCCL, one per op on gloo. `wait()` waits them all
    (once; later calls return at once)."""

    def __init__(self, works: Sequence):
        self._works = list(works)
        self._started = tuple(self._works)

    def wait(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def done(self) -> bool:
        """Whether every operation completed, without waiting: NCCL's works say so once their
        CUDA work finished (waited or not); gloo's point-to-point works only once waited."""
        return all(work.is_completed() for work in self._started)


def batch_p2p(ops: list[dist.P2POp]) -> P2PBatch:
    """Start `ops` (from send_op / recv_op) together: NCCL runs a batch's sends and receives as
    one launch, so a send to a peer never waits behind a receive from it. Every rank named in a
    batch must post its matching batch."""
    if not ops:
        return P2PBatch(())
    return P2PBatch(dist.batch_isend_irecv(ops))


def open_links(links: Sequence[tuple]) -> None:
    """Open NCCL's connections of `links` now, one after the other, in the order given, which
    must be the same on every rank (each rank passes every link, member or not). A link is
    ("p2p", group, sender, receiver): the connection from global rank `sender` to `receiver`;
    ("broadcast", group, root); or ("all_gather", group). A rank takes part in the links whose
    group holds it (one one-element message or collective each) and skips the others.

    Why: NCCL connects a pair of ranks on a communicator at the pair's first send / receive
    there (a collective's at its first call), inside the host call that starts it, which
    returns only once the peer starts its own (NVIDIA/nccl#783). Left to a step, each rank
    would first use its channels in the order its schedule reaches them, and a rank whose host
    waits in one connection cannot post what its peer, waiting in another, needs. Opened in one
    global order, the earliest link not yet open always has every member at it, so all open;
    a step's first uses then find them open and never wait on the host."""
    rank = dist.get_rank()
    waits = []
    for kind, group, *ends in links:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        one = torch.zeros(1, device=group_device(group))
        if kind == "p2p":
            sender, receiver = ends
            if rank not in (sender, receiver):
                continue
            op = (send_op(one, receiver, group=group) if rank == sender
                  else recv_op(one, sender, group=group))
            waits.append(batch_p2p([op]))
        elif kind == "broadcast":
            waits.append(broadcast(one, ends[0], group=group, async_op=True))
        elif kind == "all_gather":
            out = torch.zeros(dist.get_world_size(group), device=one.device)
            waits.append(all_gather_single(out, one, group=group, async_op=True))
        else:
            raise ValueError(f"unknown link kind {kind!r}: p2p, broadcast or all_gather")
    for work in waits:
        work.wait()


def isend(tensor: torch.Tensor, peer: int, group=None, tag: int = 0):
    """Send to global rank `peer`; returns the work."""
    _refuse("isend", tensor, group)
    return dist.isend(tensor, peer, group=group, tag=tag)


def irecv(tensor: torch.Tensor, peer: int, group=None, tag: int = 0):
    """Receive from global rank `peer` into `tensor`; returns the work."""
    _refuse("irecv", tensor, group)
    return dist.irecv(tensor, peer, group=group, tag=tag)
