"""Torch references for kernels/quantization.py: the same scheme (see its docstring) in plain
torch ops, with the kernel's fp32 operations in the kernel's order, so that results are
bit-identical. CPU tensors run these; the tests use them as the oracle.

Quantized inputs (q, scales) are flat, or [rows, ...] views of a payload (PayloadLayout.views):
the partitions are read row by row, as the kernel reads them; results are flat."""

import math

import torch
from torch import Tensor

MAX_BLOCK_SIZE = 16384
FLT_MAX = torch.finfo(torch.float32).max


def check_scheme(bits: int, block_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    if bits == 4 and block_size % 2:
        raise ValueError(f"int4 needs an even block_size (two elements per byte), got {block_size}")


def quantized_size(numel: int, bits: int, block_size: int) -> tuple[int, int]:
    """(elements of q, elements of scales) for one `numel`-element partition."""
    return (numel if bits == 8 else (numel + 1) // 2), math.ceil(numel / block_size)


def _pack_int4(q: Tensor) -> Tensor:
    """int8 (parts, n) in [-7, 7] -> uint8 (parts, ceil(n / 2)), element 2i in the low nibble."""
    q = torch.nn.functional.pad(q.to(torch.int16), (0, q.shape[1] % 2)) & 15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def _unpack_int4(packed: Tensor) -> Tensor:
    """uint8 (parts, nbytes) -> int8 (parts, 2 * nbytes), sign-extending each nibble."""
    packed = packed.to(torch.int16)
    low, high = ((packed & 15) ^ 8) - 8, ((packed >> 4) ^ 8) - 8
    return torch.stack((low, high), dim=-1).flatten(1).to(torch.int8)


def _quantize_partitions(values: Tensor, bits: int, block_size: int,
                         full_range: bool = False) -> tuple[Tensor, Tensor]:
    """fp32 (parts, n) -> q (parts, q_numel), scales (parts, blocks), each row on its own.
    full_range: scale absmax / 2^(bits-1), q in [-2^(bits-1), 2^(bits-1) - 1]."""
    parts, numel = values.shape
    qmax = 2 ** (bits - 1) - 1
    qmin = -qmax - 1 if full_range else -qmax
    blocks = math.ceil(numel / block_size)
    padded = torch.nn.functional.pad(values, (0, blocks * block_size - numel))
    padded = padded.view(parts, blocks, block_size)
    magnitude = padded.abs()
    finite = magnitude <= FLT_MAX
    absmax = torch.where(finite, magnitude, math.inf).amax(dim=-1)
    scale = absmax / (qmax + 1 if full_range else qmax)
    scale = torch.where(scale == 0, 1.0, scale)
    ratio = torch.where(finite, padded, 0.0) / scale[..., None]
    q = torch.round(ratio.clamp(qmin, qmax)).to(torch.int8).view(parts, -1)[:, :numel]
    scales = torch.where(torch.isinf(absmax), math.nan, scale)
    return (q if bits == 8 else _pack_int4(q)), scales


def _dequantize_partitions(q: Tensor, scales: Tensor, numel: int, bits: int,
                           block_size: int) -> Tensor:
    """q (parts, q_numel), scales (parts, blocks) -> fp32 (parts, numel)."""
    parts, blocks = scales.shape
    values = (q if bits == 8 else _unpack_int4(q))[:, :numel]
    values = torch.nn.functional.pad(values, (0, blocks * block_size - numel))
    values = values.view(parts, blocks, block_size).float() * scales[..., None]
    return values.view(parts, -1)[:, :numel]


def quantize_reference(x: Tensor, bits: int = 8, block_size: int = 2048,
                       full_range: bool = False) -> tuple[Tensor, Tensor]:
    """quantize() in torch ops."""
    check_scheme(bits, block_size)
    q, scales = _quantize_partitions(x.reshape(1, -1).float(), bits, block_size, full_range)
    return q.view(-1), scales.view(-1)


def dequantize_reference(q: Tensor, scales: Tensor, numel: int, bits: int = 8,
                         block_size: int = 2048, dtype: torch.dtype = torch.float32) -> Tensor:
    """dequantize() in torch ops."""
    check_scheme(bits, block_size)
    return _dequantize_partitions(q.reshape(1, -1), scales.reshape(1, -1), numel, bits,
                                  block_size).view(-1).to(dtype)


def swizzled_quantize_reference(x: Tensor, bits: int, block_size: int, num_nodes: int,
                                devices_per_node: int,
                                full_range: bool = False) -> tuple[Tensor, Tensor]:
    """swizzled_quantize() in torch ops: output position o holds partition
    (o % num_nodes) * devices_per_node + o // num_nodes."""
    check_scheme(bits, block_size)
    world = num_nodes * devices_per_node
    order = [(o % num_nodes) * devices_per_node + o // num_nodes for o in range(world)]
    parts = x.reshape(world, -1).float()[order]
    q, scales = _quantize_partitions(parts, bits, block_size, full_range)
    return q.reshape(-1), scales.reshape(-1)


def _sum_inputs(q: Tensor, scales: Tensor, num_inputs: int, bits: int, block_size: int,
                partition_numel: int) -> Tensor:
    """fp32 (S, partition_numel): the dequantized inputs summed in input order."""
    parts = scales.numel() // math.ceil(partition_numel / block_size)
    values = _dequantize_partitions(q.reshape(parts, -1), scales.reshape(parts, -1),
                                    partition_numel, bits, block_size)
    values = values.view(num_inputs, parts // num_inputs, -1)
    total = torch.zeros_like(values[0])
    for value in values:
        total = total + value
    return total


def dequantize_reduce_quantize_reference(q: Tensor, scales: Tensor, num_inputs: int,
                                         bits_in: int, bits_out: int, block_size: int,
                                         partition_numel: int,
                                         full_range: bool = False) -> tuple[Tensor, Tensor]:
    """dequantize_reduce_quantize() in torch ops."""
    check_scheme(bits_in, block_size)
    check_scheme(bits_out, block_size)
    total = _sum_inputs(q, scales, num_inputs, bits_in, block_size, partition_numel)
    q_out, s_out = _quantize_partitions(total, bits_out, block_size, full_range)
    return q_out.reshape(-1), s_out.reshape(-1)


def dequantize_reduce_reference(q: Tensor, scales: Tensor, num_inputs: int, bits: int,
                                block_size: int, partition_numel: int,
                                dtype: torch.dtype = torch.float32,
                                multiplier: float = 1.0) -> Tensor:
    """dequantize_reduce() in torch ops."""
    check_scheme(bits, block_size)
    total = _sum_inputs(q, scales, num_inputs, bits, block_size, partition_numel)
    return (total * torch.tensor(multiplier, dtype=torch.float32)).view(-1).to(dtype)
