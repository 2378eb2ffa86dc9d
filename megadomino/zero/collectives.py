"""The engine's collectives, counted: plain all-gather / reduce-scatter, qwZ's quantized all-gather
and qgZ's hierarchical quantized reduce-scatter.

Byte accounting. Every collective the engine issues goes through one `CommCounter`, which forwards
it to torch.distributed and adds, under a tag ('weights forward', 'weights backward', 'gradients',
'scalars'), the bytes this rank hands to the collective for delivery to each other member of the
group, split by whether that member is on this rank's node (node = global rank // gpus_per_node,
as ParallelDims cuts nodes):

    all-gather of a shard of B bytes          B to each other member
    reduce-scatter / all-to-all of B bytes    B / g to each other member (g = group size)
    all-reduce of B bytes                     2 B / g to each other member (reduce-scatter +
                                              all-gather)

These are the bytes a direct exchange moves, counted from the real calls' tensor sizes (quantized
payloads and their fp32 scales included, padding included). What a ring algorithm puts on the
wire differs by the forwarding it does; `benchmarks/bench_zero_netns.sh` sets the two side by side.

The quantization scheme is the kernels' (`megadomino.kernels.quantization`, issue 4 item 5):
symmetric, one fp32 scale per block of `block_size` elements, int4 packed two per byte, and each
rank's chunk quantized on its own (its blocks restart at the chunk; a trailing partial block has
its own scale), so a chunk of any size works: sizes that do not divide by dp are padded with
zeros by the engine's flat layout (`partition.FlatUnit`), nothing falls back.

Ordering: each function issues its collectives on the calling thread in a fixed order; with
`async_op=True` the returned `Pending` finishes the work when waited on. Ranks must launch and
wait in the same order (the engine does both in unit order). CUDA: collectives are enqueued after
the work already queued on the current stream; `wait()` makes the current stream wait for them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from megadomino.parallel.compat import all_gather_single, reduce_scatter_single


class Pending:
    """A launched collective; `wait()` finishes it and returns its result (once)."""

    def __init__(self, finish: Callable[[], torch.Tensor]):
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


class CommCounter:
    """Counts the bytes handed to each collective (see the module docstring), per tag."""

    def __init__(self, gpus_per_node: int):
        self.gpus_per_node = gpus_per_node
        self._node = dist.get_rank() // gpus_per_node
        self._peers: dict[object, tuple[int, int]] = {}
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: {"intra": 0, "inter": 0})
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def totals(self) -> dict[str, int]:
        """{'intra': bytes, 'inter': bytes} over every tag since the last reset()."""
        return {side: sum(count[side] for count in self.bytes.values())
                for side in ("intra", "inter")}

    def _count(self, group, tag: str, bytes_per_peer: float) -> None:
        if group not in self._peers:
            nodes = [r // self.gpus_per_node for r in dist.get_process_group_ranks(group)]
            same = sum(node == self._node for node in nodes) - 1
            self._peers[group] = (same, len(nodes) - 1 - same)
        same, other = self._peers[group]
        self.bytes[tag]["intra"] += int(bytes_per_peer * same)
        self.bytes[tag]["inter"] += int(bytes_per_peer * other)
        self.calls[tag] += 1

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group, tag: str,
                   async_op: bool = False):
        self._count(group, tag, _nbytes(shard))
        return all_gather_single(output, shard, group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, group, tag: str,
                       async_op: bool = False):
        self._count(group, tag, _nbytes(full) / dist.get_world_size(group))
        return reduce_scatter_single(output, full, group=group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, data: torch.Tensor, group, tag: str,
                   async_op: bool = False):
        self._count(group, tag, _nbytes(data) / dist.get_world_size(group))
        return dist.all_to_all_single(output, data, group=group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, group, tag: str, op=dist.ReduceOp.SUM):
        self._count(group, tag, 2 * _nbytes(tensor) / dist.get_world_size(group))
        dist.all_reduce(tensor, op=op, group=group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _quantization():
    # Imported on first use: only quantized configurations need the kernels package.
    from megadomino.kernels import quantization
    return quantization


# ---- plain ---------------------------------------------------------------------------------------


def all_gather(comm: CommCounter, shard: torch.Tensor, group, tag: str) -> Pending:
    """Launch the all-gather of `shard` [S]; wait() -> [g * S] in group-rank order."""
    full = shard.new_empty(shard.numel() * dist.get_world_size(group))
    work = comm.all_gather(full, shard, group, tag, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return full
    return Pending(finish)


def reduce_scatter(comm: CommCounter, flat: torch.Tensor, group, dtype: torch.dtype) -> Pending:
    """Launch the reduce-scatter (sum) of `flat` [g * S], sent as `dtype`; wait() -> this rank's
    [S] chunk in fp32."""
    data = flat.to(dtype)
    out = data.new_empty(flat.numel() // dist.get_world_size(group))
    work = comm.reduce_scatter(out, data, group, "gradients", async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out.float()
    return Pending(finish)


# ---- qwZ -----------------------------------------------------------------------------------------


def all_gather_quantized(comm: CommCounter, shard: torch.Tensor, group, bits: int,
                         block_size: int, tag: str) -> Pending:
    """qwZ: quantize `shard` [S] (bf16/fp16/fp32 read as is), gather every rank's int payload and
    fp32 scales in one collective; wait() -> the dequantized [g * S] in `shard.dtype`, group-rank
    order (each rank's S elements quantized on their own)."""
    quant = _quantization()
    size, numel = dist.get_world_size(group), shard.numel()
    q, scales = quant.quantize(shard, bits=bits, block_size=block_size)
    payload = _pack(q, scales, parts=1)
    received = payload.new_empty(size * payload.numel())
    work = comm.all_gather(received, payload.view(-1), group, tag, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        q_all, scales_all = _unpack(received.view(size, -1), q.numel(), q.dtype)
        return quant.dequantize_reduce(q_all, scales_all, 1, bits, block_size, numel,
                                       shard.dtype)
    return Pending(finish)


# ---- qgZ -----------------------------------------------------------------------------------------


def reduce_scatter_quantized(comm: CommCounter, flat: torch.Tensor, dims, bits: int,
                             block_size: int, found_nonfinite: torch.Tensor) -> Pending:
    """qgZ: the average over the DP group of `flat` [dp * S] (any float dtype), this rank's chunk
    [S] in fp32 (chunk d for DP rank d: what reduce-scatter gives, divided by dp), by the
    hierarchical all-to-all of `megadomino.kernels.quantization` (its docstring has the steps):

      1. swizzled_quantize: the chunks of the ranks with local index j (one per node) side by side
         for each j, each chunk quantized on its own;
      2. all-to-all inside the node: local rank j receives its P node-mates' n chunks;
      3. dequantize_reduce_quantize: the node's sum of each of those n chunks;
      4. all-to-all across nodes (the ranks of local index j): rank (node k, j) receives every
         node's sum of its chunk;
      5. dequantize_reduce, times 1 / dp.

    Steps 1-2 run at launch (2 asynchronously), 3-5 in wait(); with P == 1 or n == 1 steps 2-3 or
    3-4 drop out. inf/NaN: the quantizer gives a block holding one a NaN scale (and the sums keep
    it NaN, never finite garbage); step 1's scales are checked here, before anything is sent, and
    `found_nonfinite` is set (no host sync)."""
    quant = _quantization()
    nodes, local, chunk = dims.num_nodes_dp, dims.dp_per_node, flat.numel() // dims.dp
    q, scales = quant.swizzled_quantize(flat, bits, block_size, nodes, local)
    found_nonfinite.logical_or_(torch.isnan(scales).any())

    def reduce(q_in, scales_in, inputs: int) -> torch.Tensor:
        return quant.dequantize_reduce(q_in, scales_in, inputs, bits, block_size, chunk,
                                       torch.float32, multiplier=1.0 / dims.dp)

    if local == 1:
        inter = _exchange(comm, q, scales, nodes, dims.inter_node_group)
        return Pending(lambda: reduce(*inter(), nodes))
    intra = _exchange(comm, q, scales, local, dims.intra_node_group)

    def finish() -> torch.Tensor:
        q_node, scales_node = intra()
        if nodes == 1:
            return reduce(q_node, scales_node, local)
        q_sum, scales_sum = quant.dequantize_reduce_quantize(q_node, scales_node, local, bits,
                                                             bits, block_size, chunk)
        return reduce(*_exchange(comm, q_sum, scales_sum, nodes, dims.inter_node_group)(), nodes)
    return Pending(finish)


def _exchange(comm: CommCounter, q: torch.Tensor, scales: torch.Tensor, parts: int,
              group) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Launch the all-to-all sending part i of (q, scales) to group rank i; the returned callable
    waits and gives (q, scales) of the parts received, in group-rank order."""
    payload = _pack(q, scales, parts)
    received = torch.empty_like(payload)
    work = comm.all_to_all(received.view(-1), payload.view(-1), group, "gradients", async_op=True)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        work.wait()
        return _unpack(received, q.numel() // parts, q.dtype)
    return finish


def _pack(q: torch.Tensor, scales: torch.Tensor, parts: int) -> torch.Tensor:
    """[parts, q bytes + scale bytes of one part]: what one collective moves per destination."""
    return torch.cat([q.view(torch.uint8).view(parts, -1),
                      scales.view(torch.uint8).view(parts, -1)], dim=1)


def _unpack(payload: torch.Tensor, q_bytes: int,
            q_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of _pack over the received [parts, ...]: (q of every part, scales of every part),
    each contiguous in part order."""
    q = payload[:, :q_bytes].contiguous().view(q_dtype).view(-1)
    scales = payload[:, q_bytes:].contiguous().view(torch.float32).view(-1)
    return q, scales
