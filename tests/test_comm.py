"""`megadomino.distributed.comm`, the one module through which the package calls
torch.distributed, enforces NCCL's rules on gloo:

- placement: a small host value on a device the group does not serve is moved to the group's
  device and the result copied back (sync and async); a large tensor, or any point-to-point
  message, on such a device is refused with a PlacementError naming the call, shape and device;
- batched point-to-point: the pipeline (PP2 under each schedule, and a heterogeneous TP2 -> TP1
  plan through the resharding transport) trains exactly as the dense reference when
  `batch_isend_irecv` returns NCCL's one coalesced work for a whole batch instead of gloo's one
  work per op. The transports once zipped one work per op and broke on NCCL only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_pipeline_equivalence import check_pipeline
from test_pipeline_hetero import PLANS, check_hetero, file_plan

from dist_utils import C, DistSuite
from megadomino.distributed import ParallelDims, comm


@pytest.fixture
def served_elsewhere(monkeypatch):
    """The default group pretends its backend serves CUDA only while its device is the CPU: a
    CPU tensor then counts as misplaced, and moving it makes a real copy (as cpu -> cuda does)."""
    monkeypatch.setattr(comm, "group_devices", lambda group=None: ("cuda",))
    monkeypatch.setattr(comm, "group_device", lambda group=None: torch.device("cpu"))


@pytest.mark.usefixtures("single_process_group")
def test_a_large_misplaced_tensor_is_refused_naming_it():
    big = torch.empty(comm.HOST_VALUE_LIMIT + 1, device="meta")
    with pytest.raises(comm.PlacementError, match=r"all_reduce: a tensor of \(1025,\) "
                                                  r"torch.float32 on meta for a gloo group"):
        comm.all_reduce(big)
    out = torch.empty(2 * (comm.HOST_VALUE_LIMIT + 1), device="meta")
    with pytest.raises(comm.PlacementError, match="all_gather_single"):
        comm.all_gather_single(out, big)


@pytest.mark.usefixtures("single_process_group")
def test_a_point_to_point_message_is_never_moved():
    small = torch.empty(2, device="meta")
    for make in (comm.send_op, comm.recv_op):
        with pytest.raises(comm.PlacementError, match="create it on cpu"):
            make(small, 0)
    with pytest.raises(comm.PlacementError, match="isend"):
        comm.isend(small, 0)


@pytest.mark.usefixtures("single_process_group", "served_elsewhere")
def test_a_small_misplaced_value_is_moved_and_copied_back(monkeypatch):
    seen = []
    real = dist.all_reduce

    def all_reduce(tensor, **kwargs):
        seen.append(tensor)
        tensor.add_(1)  # stands in for the other ranks' contributions
        return real(tensor, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    count = torch.tensor([2.0])
    comm.all_reduce(count)
    assert seen[0] is not count and count.item() == 3.0  # reduced on a copy, copied back
    work = comm.all_reduce(count, async_op=True)
    work.wait()
    assert count.item() == 4.0
    with pytest.raises(comm.PlacementError):
        comm.all_reduce(torch.zeros(comm.HOST_VALUE_LIMIT + 1))


class _Coalesced:
    """NCCL's answer to batch_isend_irecv: one work for the whole batch."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


SUITE = DistSuite(worlds=(2, 3))


@SUITE.setup
def _setup(world: int) -> dict:
    batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [_Coalesced(batch(ops))]
    if world == 2:
        return {"ref": ParallelDims(tp=1), "pp2": ParallelDims(tp=1, pp=2)}
    return {"ref": ParallelDims(tp=1), "tp2_tp1": ParallelDims(plan=file_plan(*PLANS["tp2_tp1"]))}


for schedule, chunks in (("1f1b", 1), ("eager-1f1b", 1), ("interleaved", 2)):
    layers, first = (8, None) if chunks > 1 else (7, 4)
    SUITE.case(f"one-work-a-batch-pp2-{schedule}", check_pipeline, "gpt", C.pp2, C.ref,
               schedule, layers, 4, chunks, first, worlds=(2,))
def test_every_group_is_on_the_worlds_backend():
    """No new_group of the package names a backend of its own: on NCCL a world-wide new_group of
    another backend leaves the non-members in an ncclCommSplit the members never join, and a
    members-only gloo group hung its members on torch 2.11 (ParallelDims.stage_writers_group)."""
    import pathlib
    import re

    root = pathlib.Path(comm.__file__).parents[1]
    calls = [f"{path.relative_to(root)}" for path in root.rglob("*.py")
             if re.search(r"new_group\([^)]*(backend=|use_local_synchronization)",
                          path.read_text())]
    assert not calls, f"new_group with a backend of its own: {calls}"


SUITE.case("one-work-a-batch-tp2-tp1-reshard", check_hetero, "gpt", C.tp2_tp1, C.ref,
           "tp2_tp1", "1f1b", 4, 3, True, worlds=(3,))

test_nccl_batches_on_gloo = SUITE.test()
