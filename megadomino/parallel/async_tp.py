"""Sequence-parallel linears with the collective fused into the GEMM (Megatron's
`--tp-comm-overlap`), on torch's symmetric-memory kernels: the all-gather before a
column-parallel GEMM and the reduce-scatter after a row-parallel GEMM are cut into per-rank
chunks that move over NVLink copy engines while the GEMM computes the chunks already there,
forward and backward. Copy engines take no SMs from the GEMMs they overlap, which is where
NCCL-beside-GEMM overlap loses on these GPUs (BENCHMARKS.md).

    column:  y = all_gather_s(x_shard) @ W^T     backward: dx_shard = reduce_scatter_s(dy @ W)
    row:     y_shard = reduce_scatter_s(x @ W^T) backward: dx = all_gather_s(dy_shard) @ W

Activations are [s, b, h] with the sequence (dim 0) sharded. The gathered input of a column
linear is kept for its weight gradient (memory for one all-gather per linear, as without
recompute). On NCCL + CUDA the fused kernels run (`enable(group)` registers the TP group for
symmetric memory); elsewhere (CPU tests) the same autograd math runs on plain collectives.

On the GPU, MEGADOMINO_FUSED_COMM picks the symmetric-memory protocol (`fused_comm_mode`):
torch's fused ops (default), or ours, which take most barriers off the compute stream (the TP=4
timeline suggests barrier waits are most of (f)'s gap to its no-communication limit; at TP=2
the protocols measured within noise: BENCHMARKS.md).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from megadomino.parallel.mappings import all_gather_dim0, reduce_scatter_dim0

_enabled: set[str] = set()
_groups: dict[str, object] = {}


def enable(group) -> str:
    """Register the group for symmetric memory once (NCCL only); returns its name."""
    name = group.group_name
    _groups[name] = group
    if name not in _enabled and available(group):
        symm_mem.enable_symm_mem_for_group(name)
        _enabled.add(name)
    return name


def _all_gather_matmul(x_shard, weight_t, group_name):
    """(all_gather_s(x_shard), all_gather_s(x_shard) @ weight_t)."""
    group = _groups[group_name]
    if available(group):
        if fused_comm_mode() == "ours":
            return _local_first_all_gather_matmul(x_shard, weight_t, group_name)
        x_full, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
            x_shard, [weight_t], gather_dim=0, group_name=group_name)
        return x_full, y
    x_full = all_gather_dim0(x_shard.contiguous(), group)[0]
    return x_full, x_full.matmul(weight_t)


def _matmul_reduce_scatter(x, weight_t, group_name):
    """reduce_scatter_s(x @ weight_t)."""
    group = _groups[group_name]
    if available(group):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(
            x, weight_t, "sum", scatter_dim=0, group_name=group_name)
    return reduce_scatter_dim0(x.matmul(weight_t), group)[0]


def _weight_grad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    device = torch.cuda.current_device()
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream()
    return _side_streams[device]


FUSED_COMM_MODES = ("torch", "whole-dgrad", "ours")


def fused_comm_mode() -> str:
    """Which symmetric-memory protocol the fused ops use, from MEGADOMINO_FUSED_COMM (read at
    each call, so at capture time under CUDA graphs):

    - "torch" (default): torch's fused_all_gather_matmul / fused_matmul_reduce_scatter
      everywhere. Each all-gather-matmul passes 3 barriers on the compute stream (before and
      after its copy-in, and at its end), each matmul-reduce-scatter 2 + 2 per peer.
    - "whole-dgrad": a column linear's backward as one input-gradient GEMM, its reduce-scatter
      pulled by copy engines while the weight-gradient GEMM runs (_dgrad_reduce_scatter: 2
      barriers).
    - "ours": "whole-dgrad", and every all-gather-matmul local-first
      (_local_first_all_gather_matmul): its barriers and copies go on a side stream, hidden
      behind the GEMM of the local rows, with no barrier at its end.

    Our ops use their own symmetric workspace per group (_workspace), apart from torch's, and
    each starts with its barrier 0 (all ranks are done reading it), so none needs a barrier at
    its end; torch's ops keep theirs. Either kind can follow the other."""
    mode = os.environ.get("MEGADOMINO_FUSED_COMM", "torch")
    if mode not in FUSED_COMM_MODES:
        raise ValueError(f"MEGADOMINO_FUSED_COMM={mode!r}: use one of {FUSED_COMM_MODES}")
    return mode


_workspaces: dict[str, object] = {}
_workspace_buffers: dict[str, torch.Tensor] = {}


def _workspace(group_name: str, nbytes: int):
    """Our symmetric workspace of the group (a rendezvous handle: get_buffer, barrier), at least
    `nbytes`. Growing it frees the old buffer, which peers may still be reading (our ops end
    without a barrier): every rank first drains its GPU work and meets the others (a host
    barrier), so growth costs a sync, once per new size, in the first steps. Not possible under
    CUDA graph capture: the eager warm-up steps before capture size it."""
    handle = _workspaces.get(group_name)
    if handle is not None and handle.buffer_size >= nbytes:
        return handle
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"megadomino's symmetric workspace of group {group_name} must grow to {nbytes} "
            "bytes during CUDA graph capture; run the step eagerly once before capturing")
    if handle is not None:
        torch.cuda.synchronize()
        dist.barrier(group=_groups[group_name])
    size = max(nbytes, 2 * (handle.buffer_size if handle is not None else 0))
    buffer = symm_mem.empty(size, dtype=torch.uint8, device=torch.cuda.current_device())
    handle = symm_mem.rendezvous(buffer, group_name)
    _workspaces[group_name] = handle
    _workspace_buffers[group_name] = buffer  # the handle does not own the allocation
    return handle


def _local_first_all_gather_matmul(x_shard: torch.Tensor, weight_t: torch.Tensor,
                                   group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather_s(x_shard), all_gather_s(x_shard) @ weight_t), with no barrier on the
    compute stream.

    Streams and ordering (every rank runs the same sequence):
    - side stream, after the current one: barrier 0 (every rank is done reading our group
      workspace), copy x_shard into this rank's workspace, barrier 1 (every shard is in place),
      then copy engines pull the other ranks' shards into x_full, the next rank's first, one
      event per shard, and last this rank's own rows;
    - current stream, beside it: the GEMM of the local rows (needs nothing from the peers:
      it hides the barriers, the copy-in and the first pull), then each remote rank's rows as
      soon as its event fires; finally it waits for the side stream.
    x_full and y are allocated on the current stream, which waits for the side stream before
    either can be reused; the next op's barrier 0 keeps peers from overwriting their workspace
    before these pulls are done."""
    group = _groups[group_name]
    world = group.size()
    shard = x_shard.reshape(-1, x_shard.shape[-1])
    if not shard.is_contiguous():
        shard = shard.contiguous()
    rows, k = shard.shape
    workspace = _workspace(group_name, shard.numel() * shard.element_size())
    rank = workspace.rank
    current, side = torch.cuda.current_stream(), _side_stream()
    x_full = shard.new_empty(world * rows, k)
    y = shard.new_empty(world * rows, weight_t.shape[1])
    order = [(rank + step) % world for step in range(1, world)]
    arrived = {}
    side.wait_stream(current)
    with torch.cuda.stream(side):
        workspace.barrier(channel=0)
        workspace.get_buffer(rank, (rows, k), shard.dtype).copy_(shard)
        workspace.barrier(channel=1)
        for source in order:
            x_full[source * rows:(source + 1) * rows].copy_(
                workspace.get_buffer(source, (rows, k), shard.dtype))
            arrived[source] = torch.cuda.Event()
            arrived[source].record(side)
        x_full[rank * rows:(rank + 1) * rows].copy_(shard)
    torch.mm(shard, weight_t, out=y[rank * rows:(rank + 1) * rows])
    for source in order:
        current.wait_event(arrived[source])
        torch.mm(x_full[source * rows:(source + 1) * rows], weight_t,
                 out=y[source * rows:(source + 1) * rows])
    current.wait_stream(side)
    lead = (world * x_shard.shape[0], *x_shard.shape[1:-1])
    return x_full.view(*lead, k), y.view(*lead, weight_t.shape[1])


def _dgrad_reduce_scatter(grad_out: torch.Tensor, weight: torch.Tensor, x_full: torch.Tensor,
                          group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(reduce_scatter_s(grad_out @ weight), grad_out^T @ x_full): the column linear's input
    and weight gradients, with the reduce-scatter hidden behind the weight-gradient GEMM.

    Streams and ordering (every rank runs the same sequence):
    1. current stream: barrier 0 (every rank is done reading our group workspace), the whole
       input-gradient GEMM into this rank's workspace, barrier 1 (every rank's GEMM is written);
    2. side stream, after the current one: copy engines pull this rank's rows from each rank's
       workspace (its own included) into `stacked`, then one kernel sums them (fp32
       accumulation, one rounding), what a reduce-scatter gives;
    3. current stream, beside 2: the weight-gradient GEMM; then it waits for the side stream.
    `stacked` and the result are allocated on the current stream, which waits for the side
    stream before it can reuse them; the next op's barrier 0 keeps peers from overwriting a
    workspace before these pulls are done."""
    group = _groups[group_name]
    world = group.size()
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
    rows, hidden = grad_2d.shape[0], weight.shape[1]
    shard_rows = rows // world
    workspace = _workspace(group_name, rows * hidden * grad_out.element_size())
    rank = workspace.rank
    current, side = torch.cuda.current_stream(), _side_stream()
    stacked = grad_out.new_empty(world, shard_rows, hidden)
    grad_x = grad_out.new_empty(shard_rows, hidden)
    workspace.barrier(channel=0)
    torch.mm(grad_2d, weight, out=workspace.get_buffer(rank, (rows, hidden), grad_out.dtype))
    workspace.barrier(channel=1)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for step in range(world):
            source = (rank + step) % world
            stacked[source].copy_(workspace.get_buffer(
                source, (shard_rows, hidden), grad_out.dtype,
                storage_offset=rank * shard_rows * hidden))
        torch.sum(stacked, dim=0, out=grad_x)
    grad_weight = _weight_grad(grad_out, x_full)
    current.wait_stream(side)
    return grad_x.view(-1, *grad_out.shape[1:-1], hidden), grad_weight


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, group_name):
        x_full, y = _all_gather_matmul(x_shard, weight.t(), group_name)
        ctx.save_for_backward(x_full, weight)
        ctx.group_name, ctx.has_bias = group_name, bias is not None
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad_out):
        x_full, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if available(_groups[ctx.group_name]) and fused_comm_mode() != "torch":
            grad_x, grad_weight = _dgrad_reduce_scatter(grad_out, weight, x_full,
                                                        ctx.group_name)
        else:
            grad_x = _matmul_reduce_scatter(grad_out, weight, ctx.group_name)
            grad_weight = _weight_grad(grad_out, x_full)
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group_name):
        ctx.save_for_backward(x, weight)
        ctx.group_name = group_name
        return _matmul_reduce_scatter(x.contiguous(), weight.t(), group_name)

    @staticmethod
    def backward(ctx, grad_shard):
        x, weight = ctx.saved_tensors
        grad_full, grad_x = _all_gather_matmul(grad_shard.contiguous(), weight, ctx.group_name)
        return grad_x, _weight_grad(grad_full, x), None


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      group) -> torch.Tensor:
    """(s/tp, b, in) -> (s, b, out/tp): the column-parallel GEMM with its input all-gather."""
    return _AllGatherMatmul.apply(x_shard, weight, bias, enable(group))


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """(s, b, in/tp) -> (s/tp, b, out): the row-parallel GEMM with its output reduce-scatter."""
    return _MatmulReduceScatter.apply(x, weight, enable(group))


def available(group) -> bool:
    """Fused kernels need CUDA tensors on an NCCL group."""
    return torch.cuda.is_available() and dist.get_backend(group) == "nccl"
