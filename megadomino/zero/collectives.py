"""The engine's collectives, counted: plain all-gather / reduce-scatter, qwZ's quantized all-gather,
qgZ's hierarchical quantized reduce-scatter and DiLoCo's pseudo-gradient mean across sites.

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
payloads and their fp32 scales included, padding included: a quantized collective moves one uint8
buffer whose row per peer is [q | fp32 scales], each section padded to 16 bytes, the kernels'
`PayloadLayout`). What a ring algorithm puts on the wire differs by the forwarding it does;
`benchmarks/bench_zero_netns.sh` sets the two side by side.

The quantization scheme is the kernels' (`megadomino.kernels.quant_scheme` specifies it):
symmetric (or, with `full_range`, every two's-complement level as DeepSpeed's quantizer), one
fp32 scale per block of `block_size` elements, int4 packed two per byte, and each
rank's chunk quantized on its own (its blocks restart at the chunk; a trailing partial block has
its own scale), so a chunk of any size works: sizes that do not divide by dp are padded with
zeros by the engine's flat layout (`partition.FlatUnit`), nothing falls back.

Zero-copy: each quantized exchange moves q and scales in one collective without packing copies:
the quantizers write straight into the send buffer's rows and the dequantizing reductions read
the received rows in place (strided rows, one kernel launch per op).

Ordering: each function issues its collectives on the calling thread in a fixed order; with
`async_op=True` the returned `Pending` finishes the work when waited on. Ranks must launch and
wait in the same order (the engine does both in unit order). CUDA: collectives are enqueued after
the work already queued on the current stream; `wait()` makes the current stream wait for them.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from megadomino.distributed import comm


class Pending:
    """A launched collective; `wait()` finishes it and returns its result (once). A multi-stage
    one (qgZ) may also take `advance`, its middle stage: `advance()` runs it (once) without
    waiting for the last stage, so that its next collective is in flight while the caller goes
    on; wait() advances first if nobody did."""

    def __init__(self, finish: Callable[[], torch.Tensor],
                 advance: Callable[[], None] | None = None):
        self._finish = finish
        self._advance = advance
        self._result: torch.Tensor | None = None

    def advance(self) -> None:
        if self._advance is not None:
            advance, self._advance = self._advance, None
            advance()

    def wait(self) -> torch.Tensor:
        self.advance()
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
        return comm.all_gather_single(output, shard, group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, group, tag: str,
                       async_op: bool = False):
        self._count(group, tag, _nbytes(full) / dist.get_world_size(group))
        return comm.reduce_scatter_single(output, full, group=group, async_op=async_op)

    def all_to_all(self, output: torch.Tensor, data: torch.Tensor, group, tag: str,
                   async_op: bool = False):
        self._count(group, tag, _nbytes(data) / dist.get_world_size(group))
        return comm.all_to_all_single(output, data, group=group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, group, tag: str, op=dist.ReduceOp.SUM,
                   async_op: bool = False):
        self._count(group, tag, 2 * _nbytes(tensor) / dist.get_world_size(group))
        return comm.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _kernels():
    # Imported on first use: only quantized configurations need the kernels package.
    import megadomino.kernels
    return megadomino.kernels


@functools.lru_cache(maxsize=1024)
def _layout(parts: int, partition_numel: int, bits: int, block_size: int):
    """kernels.PayloadLayout, made once per shape: the same few shapes recur every step,
    and a small-micro-batch step waits on this host work."""
    return _kernels().PayloadLayout(parts, partition_numel, bits, block_size)


# ---- plain ---------------------------------------------------------------------------------------


def all_gather(comm: CommCounter, shard: torch.Tensor, group, tag: str) -> Pending:
    """Launch the all-gather of `shard` [S]; wait() -> [g * S] in group-rank order."""
    full = shard.new_empty(shard.numel() * dist.get_world_size(group))
    work = comm.all_gather(full, shard, group, tag, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return full
    return Pending(finish)


def all_reduce_mean(comm: CommCounter, flat: torch.Tensor, group) -> Pending:
    """Stage 0: `flat` becomes the group's mean in place (divided by the group size, then
    summed: the order Megatron's DDP uses); the result is `flat` itself."""
    flat.div_(dist.get_world_size(group))
    work = comm.all_reduce(flat, group, "gradients", async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return flat
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


def quantize_shard(shard: torch.Tensor, bits: int, block_size: int,
                   full_range: bool = False) -> torch.Tensor:
    """qwZ's send buffer for `shard` [S]: uint8 [1, row_bytes], `PayloadLayout(1, S, bits,
    block_size)`, the quantized shard written straight into it (no packing copy)."""
    quant = _kernels()
    layout = _layout(1, shard.numel(), bits, block_size)
    payload = layout.empty(1, shard.device)
    quant.quantize(shard, bits, block_size, out=layout.views(payload), full_range=full_range)
    return payload


def all_gather_quantized(comm: CommCounter, shard: torch.Tensor, group, bits: int,
                         block_size: int, tag: str, payload: torch.Tensor | None = None,
                         full_range: bool = False) -> Pending:
    """qwZ: quantize `shard` [S] (bf16/fp16/fp32 read as is) and all-gather every rank's payload
    row (q and fp32 scales, PayloadLayout) in one collective; wait() -> the dequantized [g * S]
    in `shard.dtype`, group-rank order (each rank's S elements quantized on their own), read
    from the received rows in place. `payload`: this rank's quantize_shard(shard, ...) made
    earlier, sent instead of quantizing again."""
    quant = _kernels()
    size, numel = dist.get_world_size(group), shard.numel()
    layout = _layout(1, numel, bits, block_size)
    if payload is None:
        payload = quantize_shard(shard, bits, block_size, full_range)
    elif payload.shape != (1, layout.row_bytes):
        raise ValueError(f"payload must be quantize_shard's [1, {layout.row_bytes}], got "
                         f"{list(payload.shape)}")
    received = layout.empty(size, shard.device)
    work = comm.all_gather(received.view(-1), payload.view(-1), group, tag, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        q_all, scales_all = layout.views(received)  # one rank's shard per row
        return quant.dequantize_reduce(q_all, scales_all, 1, bits, block_size, numel,
                                       shard.dtype)
    return Pending(finish)


# ---- DiLoCo --------------------------------------------------------------------------------------


def all_gather_mean(comm: CommCounter, flat: torch.Tensor, group, encoding: str,
                    block_size: int, tag: str) -> Pending:
    """DiLoCo's pseudo-gradient exchange: launch the all-gather of `flat` [S] (fp32) encoded as
    `encoding` ('fp32' as it is, 'bf16' rounded to bfloat16, 'int8' quantize_shard's payload,
    one fp32 scale per `block_size` elements); wait() -> the members' decoded values summed in
    fp32 in group-rank order, times 1 / g, [S] fp32. Gathered rather than all-reduced: every
    member sums the same rows in the same order, so all hold the same bits (which the replicas'
    checksums rely on), and a quantized payload cannot be summed on the wire."""
    size, numel = dist.get_world_size(group), flat.numel()
    if encoding == "int8":
        quant = _kernels()
        layout = _layout(1, numel, 8, block_size)
        payload = quantize_shard(flat, 8, block_size)
        received = layout.empty(size, flat.device)
        work = comm.all_gather(received.view(-1), payload.view(-1), group, tag, async_op=True)

        def decode() -> torch.Tensor:
            work.wait()
            q_all, scales_all = layout.views(received)  # one member's payload per row
            return quant.dequantize_reduce(q_all, scales_all, size, 8, block_size, numel,
                                           torch.float32, multiplier=1.0 / size)
        return Pending(decode)
    sent = flat.to(torch.bfloat16 if encoding == "bf16" else torch.float32)
    rows = sent.new_empty(size, numel)
    work = comm.all_gather(rows.view(-1), sent, group, tag, async_op=True)

    def total() -> torch.Tensor:
        work.wait()
        mean = rows[0].float().clone()
        for row in rows[1:]:
            mean += row.float()
        return mean.mul_(torch.tensor(1.0 / size, dtype=torch.float32))
    return Pending(total)


# ---- qgZ -----------------------------------------------------------------------------------------


def reduce_scatter_quantized(comm: CommCounter, flat: torch.Tensor, dims, bits: int,
                             block_size: int, found_nonfinite: torch.Tensor,
                             full_range: bool = False) -> Pending:
    """qgZ: the average over the DP group of `flat` [dp * S] (any float dtype), this rank's chunk
    [S] in fp32 (chunk d for DP rank d: what reduce-scatter gives, divided by dp), by the
    hierarchical all-to-all of `megadomino.kernels` (its docstring has the steps):

      1. swizzled_quantize: the chunks of the ranks with local index j (one per node) side by side
         for each j, each chunk quantized on its own;
      2. all-to-all inside the node: local rank j receives its P node-mates' n chunks;
      3. dequantize_reduce_quantize: the node's sum of each of those n chunks;
      4. all-to-all across nodes (the ranks of local index j): rank (node k, j) receives every
         node's sum of its chunk;
      5. dequantize_reduce, times 1 / dp.

    Steps 1-2 run at launch (2 asynchronously), 3-4 in the Pending's advance() (4 left in
    flight), 5 in wait(); with P == 1 or n == 1 steps 2-3 or 3-4 drop out. Zero-copy: steps 1
    and 3 quantize straight into the rows of the next all-to-all's send buffer (PayloadLayout,
    one row per destination), and steps 3 and 5 read the received rows in place. inf/NaN: the
    quantizer gives a block holding one a NaN scale (and the sums keep it NaN, never finite
    garbage); step 1's scales are checked here, before anything is sent, and `found_nonfinite`
    is set (no host sync)."""
    quant = _kernels()
    nodes, local, chunk = dims.num_nodes_dp, dims.dp_per_node, flat.numel() // dims.dp
    # The first all-to-all: inside the node, or across nodes with one rank per node. Row d of
    # its send buffer holds the chunks for group rank d (swizzled_quantize's order).
    first_group, first_size = ((dims.inter_node_group, nodes) if local == 1
                               else (dims.intra_node_group, local))
    sent = _layout(dims.dp // first_size, chunk, bits, block_size)
    payload = sent.empty(first_size, flat.device)
    _, scales = quant.swizzled_quantize(flat, bits, block_size, nodes, local,
                                        out=sent.views(payload), full_range=full_range)
    found_nonfinite.logical_or_(torch.isnan(scales).any())

    def reduce(received: torch.Tensor, layout, inputs: int) -> torch.Tensor:
        return quant.dequantize_reduce(*layout.views(received), inputs, bits, block_size, chunk,
                                       torch.float32, multiplier=1.0 / dims.dp)

    first = _exchange(comm, payload, first_group)
    if local == 1 or nodes == 1:
        return Pending(lambda: reduce(first(), sent, dims.dp))

    sums = _layout(1, chunk, bits, block_size)  # row n: the node's sum for node n
    second: list[Callable[[], torch.Tensor]] = []

    def advance() -> None:  # steps 3-4: the inter-node all-to-all left in flight
        node_sums = sums.empty(nodes, flat.device)
        quant.dequantize_reduce_quantize(*sent.views(first()), local, bits, bits, block_size,
                                         chunk, out=sums.views(node_sums), full_range=full_range)
        second.append(_exchange(comm, node_sums, dims.inter_node_group))

    return Pending(lambda: reduce(second[0](), sums, nodes), advance)


def _exchange(comm: CommCounter, payload: torch.Tensor,
              group) -> Callable[[], torch.Tensor]:
    """Launch the all-to-all sending row i of `payload` [g, row_bytes] to group rank i; the
    returned callable waits and gives the received [g, row_bytes], row i from group rank i."""
    received = torch.empty_like(payload)
    work = comm.all_to_all(received.view(-1), payload.view(-1), group, "gradients", async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return received
    return finish
