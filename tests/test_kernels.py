"""Quantization kernels (kernels/block_*.py) against their torch references, and the scheme
(kernels/quant_scheme.py) itself against explicit expectations and a float64 oracle.

The Triton kernel runs on CPU only under Triton's interpreter, which must be chosen before triton
is first imported; so the kernel cases run in one subprocess started with TRITON_INTERPRET=1
(`python tests/test_kernels.py` runs them and prints JSON) and each pytest case reports its own
result. The `check_*` functions take (device, force_triton) and are reused by
tests/gpu/test_gpu_kernels.py on CUDA with larger sizes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
import warnings

import pytest
import torch

from megadomino.kernels import (
    PayloadLayout,
    Variant,
    dequantize,
    dequantize_reduce,
    dequantize_reduce_quantize,
    dequantize_reduce_quantize_reference,
    dequantize_reduce_reference,
    dequantize_reference,
    quantize,
    quantize_reference,
    quantized_size,
    swizzled_quantize,
    swizzled_quantize_reference,
)
from megadomino.kernels.quant_launch import HAS_TRITON, INTERPRETING

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Poison: values no op can produce (q is in [-qmax, qmax]; nibble -8 never appears; scales >= 0).
POISON_INT8, POISON_UINT8, POISON_FLOAT = -128, 0x88, -1.0
# full_range may write any q, so its checks run twice, the second time poisoned with these: an
# element left unwritten equals one of the two poisons, which no single result can.
POISON_INT8_FULL, POISON_UINT8_FULL = 127, 0x77
POISONS = {False: [False], True: [False, True]}


# --- inputs -------------------------------------------------------------------------------------

def make_input(numel: int, block_size: int, seed: int = 0) -> torch.Tensor:
    """fp32 values, negative and positive, each block with its own magnitude (1e-3 .. 1e3),
    blocks 3, 8, 13, ... all zeros, so that blocks do not share scales."""
    gen = torch.Generator().manual_seed(seed)
    blocks = math.ceil(numel / block_size)
    magnitude = torch.logspace(-3, 3, blocks)[torch.randperm(blocks, generator=gen)]
    magnitude[3::5] = 0.0
    x = torch.randn(blocks * block_size, generator=gen) * magnitude.repeat_interleave(block_size)
    return x[:numel].contiguous()


def poisoned_quantized(parts: int, numel: int, bits: int, block_size: int, device,
                       alternate: bool = False):
    q_numel, s_numel = quantized_size(numel, bits, block_size)
    poison = ((POISON_INT8_FULL if bits == 8 else POISON_UINT8_FULL) if alternate
              else (POISON_INT8 if bits == 8 else POISON_UINT8))
    q = torch.full((parts * q_numel,), poison,
                   dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
    return q, torch.full((parts * s_numel,), POISON_FLOAT, device=device)


def expected_cast(values: torch.Tensor, dtype: torch.dtype, interpreted: bool) -> torch.Tensor:
    """The fp32 reference values in the output dtype. Triton's interpreter truncates fp32 ->
    bf16 (compiled kernels round to nearest even, as torch does): mimic it there."""
    if interpreted and dtype == torch.bfloat16:
        return (values.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return values.to(dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape,
                                                                 want.dtype, want.shape)
    if not torch.equal(got, want) and not (got.is_floating_point()
                                           and torch.equal(got.isnan(), want.isnan())
                                           and torch.equal(got.nan_to_num(), want.nan_to_num())):
        bad = (got != want).nonzero().flatten()
        raise AssertionError(f"{what}: {bad.numel()} of {got.numel()} differ, first at "
                             f"{bad[:5].tolist()}: got {got[bad[:5]].tolist()}, "
                             f"want {want[bad[:5]].tolist()}")


# --- kernel == reference checks (every output element written: buffers are poisoned) ----------

def check_quantize(device: str, force_triton: bool, numel: int, dtype: str, bits: int,
                   block_size: int, full_range: bool = False) -> None:
    x = make_input(numel, block_size).to(DTYPES[dtype])
    q_ref, s_ref = quantize_reference(x, bits, block_size, full_range)
    for alternate in POISONS[full_range]:
        out = poisoned_quantized(1, numel, bits, block_size, device, alternate)
        q, scales = quantize(x.to(device), bits, block_size, out=out, force_triton=force_triton,
                             full_range=full_range)
        assert q.data_ptr() == out[0].data_ptr() and scales.data_ptr() == out[1].data_ptr()
        assert_same(q, q_ref, "q")
        assert_same(scales, s_ref, "scales")


def check_dequantize(device: str, force_triton: bool, numel: int, dtype: str, bits: int,
                     block_size: int) -> None:
    q, scales = quantize_reference(make_input(numel, block_size, seed=1), bits, block_size)
    out = torch.full((numel,), POISON_FLOAT, dtype=DTYPES[dtype], device=device)
    got = dequantize(q.to(device), scales.to(device), numel, bits, block_size, DTYPES[dtype],
                     out=out, force_triton=force_triton)
    want = dequantize_reference(q, scales, numel, bits, block_size)
    assert_same(got, expected_cast(want, DTYPES[dtype], force_triton), "dequantized")


def check_swizzled_quantize(device: str, force_triton: bool, nodes: int, devices_per_node: int,
                            partition_numel: int, bits: int, block_size: int,
                            dtype: str = "fp32", full_range: bool = False) -> None:
    world = nodes * devices_per_node
    x = make_input(world * partition_numel, block_size, seed=2).to(DTYPES[dtype])
    q_ref, s_ref = swizzled_quantize_reference(x, bits, block_size, nodes, devices_per_node,
                                               full_range)
    for alternate in POISONS[full_range]:
        out = poisoned_quantized(world, partition_numel, bits, block_size, device, alternate)
        q, scales = swizzled_quantize(x.to(device), bits, block_size, nodes, devices_per_node,
                                      out=out, force_triton=force_triton, full_range=full_range)
        assert_same(q, q_ref, "q")
        assert_same(scales, s_ref, "scales")


def quantized_inputs(num_inputs: int, parts: int, partition_numel: int, bits: int,
                     block_size: int, full_range: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """num_inputs stacked inputs of `parts` partitions each, quantized by the reference."""
    qs, ss = [], []
    for i in range(num_inputs * parts):
        q, s = quantize_reference(make_input(partition_numel, block_size, seed=10 + i), bits,
                                  block_size, full_range)
        qs.append(q)
        ss.append(s)
    return torch.cat(qs), torch.cat(ss)


def check_dequantize_reduce_quantize(device: str, force_triton: bool, num_inputs: int,
                                     parts: int, partition_numel: int, bits_in: int,
                                     bits_out: int, block_size: int,
                                     full_range: bool = False) -> None:
    q, s = quantized_inputs(num_inputs, parts, partition_numel, bits_in, block_size, full_range)
    q_ref, s_ref = dequantize_reduce_quantize_reference(q, s, num_inputs, bits_in, bits_out,
                                                        block_size, partition_numel, full_range)
    for alternate in POISONS[full_range]:
        out = poisoned_quantized(parts, partition_numel, bits_out, block_size, device, alternate)
        q_out, s_out = dequantize_reduce_quantize(q.to(device), s.to(device), num_inputs,
                                                  bits_in, bits_out, block_size, partition_numel,
                                                  out=out, force_triton=force_triton,
                                                  full_range=full_range)
        assert_same(q_out, q_ref, "q")
        assert_same(s_out, s_ref, "scales")


def check_dequantize_reduce(device: str, force_triton: bool, num_inputs: int, parts: int,
                            partition_numel: int, bits: int, block_size: int, dtype: str,
                            multiplier: float) -> None:
    q, s = quantized_inputs(num_inputs, parts, partition_numel, bits, block_size)
    out = torch.full((parts * partition_numel,), POISON_FLOAT, dtype=DTYPES[dtype],
                     device=device)
    got = dequantize_reduce(q.to(device), s.to(device), num_inputs, bits, block_size,
                            partition_numel, DTYPES[dtype], multiplier, out=out,
                            force_triton=force_triton)
    want = dequantize_reduce_reference(q, s, num_inputs, bits, block_size, partition_numel,
                                       torch.float32, multiplier)
    assert_same(got, expected_cast(want, DTYPES[dtype], force_triton), "reduced")


# --- row layouts: quantized data read and written in place in rows of a payload -------------

def row_buffers(kind: str, rows: int, per_row: int, partition_numel: int, bits: int,
                block_size: int, device):
    """Poisoned (q, scales) [rows, ...] views holding `per_row` partitions per row, and a check
    that nothing outside them changed. kind "payload": a PayloadLayout's views (one uint8 buffer;
    0x80 / 0x88 bytes read as an impossible q and, four of them, as a negative scale); "gapped":
    separate buffers whose rows are 3 q elements and 5 scales longer than their data (odd,
    unaligned row strides)."""
    q_numel, s_numel = quantized_size(partition_numel, bits, block_size)
    q_poison = POISON_INT8 if bits == 8 else POISON_UINT8
    if kind == "payload":
        layout = PayloadLayout(per_row, partition_numel, bits, block_size)
        payload = torch.full((rows, layout.row_bytes), q_poison & 0xFF, dtype=torch.uint8,
                             device=device)
        q, scales = layout.views(payload)
        gaps = (payload[:, layout.q_numel:layout.scales_offset],
                payload[:, layout.scales_offset + 4 * layout.scales_numel:])
        poison = [q_poison & 0xFF] * 2
    else:
        q_buf = torch.full((rows, per_row * q_numel + 3), q_poison,
                           dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
        s_buf = torch.full((rows, per_row * s_numel + 5), POISON_FLOAT, device=device)
        q, scales = q_buf[:, :per_row * q_numel], s_buf[:, :per_row * s_numel]
        gaps = (q_buf[:, per_row * q_numel:], s_buf[:, per_row * s_numel:])
        poison = [q_poison, POISON_FLOAT]

    def untouched() -> None:
        for gap, value in zip(gaps, poison):
            assert (gap.cpu() == value).all(), "wrote outside the rows"
    return q, scales, untouched


def in_rows(q: torch.Tensor, scales: torch.Tensor, kind: str, per_row: int,
            partition_numel: int, bits: int, block_size: int, device):
    """Flat quantized partitions copied into row_buffers(kind, ..., per_row, ...)."""
    rows = scales.numel() // (per_row * quantized_size(partition_numel, bits, block_size)[1])
    q_rows, s_rows, untouched = row_buffers(kind, rows, per_row, partition_numel, bits,
                                            block_size, device)
    q_rows.copy_(q.view(q_rows.shape))
    s_rows.copy_(scales.view(s_rows.shape))
    return q_rows, s_rows, untouched


def check_rows_quantize(device: str, force_triton: bool, numel: int, dtype: str, bits: int,
                        block_size: int, kind: str) -> None:
    x = make_input(numel, block_size, seed=4).to(DTYPES[dtype])
    q_out, s_out, untouched = row_buffers(kind, 1, 1, numel, bits, block_size, device)
    q, scales = quantize(x.to(device), bits, block_size, out=(q_out, s_out),
                         force_triton=force_triton)
    assert q.data_ptr() == q_out.data_ptr() and scales.data_ptr() == s_out.data_ptr()
    q_ref, s_ref = quantize_reference(x, bits, block_size)
    assert_same(q.reshape(-1), q_ref, "q")
    assert_same(scales.reshape(-1), s_ref, "scales")
    untouched()


def check_rows_swizzled_quantize(device: str, force_triton: bool, nodes: int,
                                 devices_per_node: int, partition_numel: int, bits: int,
                                 block_size: int, dtype: str, kind: str) -> None:
    """qgZ's send buffer: row d (for local rank d) holds `nodes` swizzled partitions."""
    x = make_input(nodes * devices_per_node * partition_numel, block_size, seed=5)
    x = x.to(DTYPES[dtype])
    q_out, s_out, untouched = row_buffers(kind, devices_per_node, nodes, partition_numel, bits,
                                          block_size, device)
    swizzled_quantize(x.to(device), bits, block_size, nodes, devices_per_node,
                      out=(q_out, s_out), force_triton=force_triton)
    q_ref, s_ref = swizzled_quantize_reference(x, bits, block_size, nodes, devices_per_node)
    assert_same(q_out.reshape(-1), q_ref, "q")
    assert_same(s_out.reshape(-1), s_ref, "scales")
    untouched()


def check_rows_dequantize_reduce_quantize(device: str, force_triton: bool, num_inputs: int,
                                          parts: int, partition_numel: int, bits_in: int,
                                          bits_out: int, block_size: int, kind: str,
                                          per_row_in: int, per_row_out: int) -> None:
    """Inputs read from rows of `per_row_in` partitions (qgZ step 3: one source's `parts` per
    row), written to rows of `per_row_out` (qgZ: one per inter-node destination)."""
    q, s = quantized_inputs(num_inputs, parts, partition_numel, bits_in, block_size)
    q_in, s_in, in_untouched = in_rows(q, s, kind, per_row_in, partition_numel, bits_in,
                                       block_size, device)
    q_out, s_out, out_untouched = row_buffers(kind, parts // per_row_out, per_row_out,
                                              partition_numel, bits_out, block_size, device)
    dequantize_reduce_quantize(q_in, s_in, num_inputs, bits_in, bits_out, block_size,
                               partition_numel, out=(q_out, s_out), force_triton=force_triton)
    q_ref, s_ref = dequantize_reduce_quantize_reference(q, s, num_inputs, bits_in, bits_out,
                                                        block_size, partition_numel)
    assert_same(q_out.reshape(-1), q_ref, "q")
    assert_same(s_out.reshape(-1), s_ref, "scales")
    in_untouched()
    out_untouched()


def check_rows_dequantize_reduce(device: str, force_triton: bool, num_inputs: int, parts: int,
                                 partition_numel: int, bits: int, block_size: int, dtype: str,
                                 multiplier: float, kind: str, per_row: int) -> None:
    """Inputs read from rows of `per_row` partitions (qwZ: 1 input, one rank's shard per row;
    qgZ step 5: one node's partial sum per row)."""
    q, s = quantized_inputs(num_inputs, parts, partition_numel, bits, block_size)
    q_in, s_in, untouched = in_rows(q, s, kind, per_row, partition_numel, bits, block_size,
                                    device)
    out = torch.full((parts * partition_numel,), POISON_FLOAT, dtype=DTYPES[dtype],
                     device=device)
    got = dequantize_reduce(q_in, s_in, num_inputs, bits, block_size, partition_numel,
                            DTYPES[dtype], multiplier, out=out, force_triton=force_triton)
    want = dequantize_reduce_reference(q, s, num_inputs, bits, block_size, partition_numel,
                                       torch.float32, multiplier)
    assert_same(got, expected_cast(want, DTYPES[dtype], force_triton), "reduced")
    untouched()


def row_cases() -> dict[str, tuple]:
    """Row-layout cases (payload rows padded to 16 bytes, and odd gaps), int8 and int4, odd
    sizes, several inputs; small enough for the interpreter."""
    cases = {}
    for bits in (8, 4):
        for kind in ("payload", "gapped"):
            for numel, block_size, dtype in [(7, 4, "fp16"), (2049, 2048, "bf16"),
                                             (3001, 300, "fp32")]:
                cases[f"rows-{kind}-quantize-{numel}-{block_size}-{dtype}-int{bits}"] = (
                    check_rows_quantize, {"numel": numel, "dtype": dtype, "bits": bits,
                                          "block_size": block_size, "kind": kind})
            for nodes, dpn, numel, block_size, dtype in [(2, 2, 1000, 256, "bf16"),
                                                         (3, 1, 515, 512, "fp16"),
                                                         (1, 4, 7, 4, "fp32")]:
                cases[f"rows-{kind}-swizzle-{nodes}x{dpn}-{numel}-{dtype}-int{bits}"] = (
                    check_rows_swizzled_quantize,
                    {"nodes": nodes, "devices_per_node": dpn, "partition_numel": numel,
                     "bits": bits, "block_size": block_size, "dtype": dtype, "kind": kind})
            for bits_out in (8, 4):
                for num_inputs, parts, numel, block_size, per_row_in, per_row_out in [
                        (4, 2, 1000, 256, 2, 1), (2, 1, 4097, 2048, 1, 1),
                        (3, 3, 7, 4, 1, 3)]:
                    cases[f"rows-{kind}-dequant-reduce-quant-{num_inputs}x{parts}-{numel}-"
                          f"rows{per_row_in}:{per_row_out}-int{bits}-int{bits_out}"] = (
                        check_rows_dequantize_reduce_quantize,
                        {"num_inputs": num_inputs, "parts": parts, "partition_numel": numel,
                         "bits_in": bits, "bits_out": bits_out, "block_size": block_size,
                         "kind": kind, "per_row_in": per_row_in, "per_row_out": per_row_out})
            for num_inputs, parts, numel, dtype, multiplier, per_row in [
                    (1, 4, 1001, "bf16", 1.0, 1), (2, 1, 999, "fp32", 0.25, 1),
                    (3, 2, 999, "fp16", 1 / 3, 2)]:
                cases[f"rows-{kind}-dequant-reduce-{num_inputs}x{parts}-{numel}-rows{per_row}-"
                      f"{dtype}-int{bits}"] = (
                    check_rows_dequantize_reduce,
                    {"num_inputs": num_inputs, "parts": parts, "partition_numel": numel,
                     "bits": bits, "block_size": 128, "dtype": dtype, "multiplier": multiplier,
                     "kind": kind, "per_row": per_row})
    return cases


def check_tiny_scales(device: str, force_triton: bool, bits: int,
                      block_size: int = 64, full_range: bool = False) -> None:
    """Blocks whose scale is tiny or subnormal (the kernel divides instead of using its fma
    residual there, or rescales: _ratio_branchless), beside ordinary blocks in the same
    program; ties included. block_size 8192: the looping quantize (and its swizzled form)."""
    absmax = [1e-30, 1e-37, 1e-40, 1e-44, 1.4e-45, 3.0, 1e-28, 5e-39]
    x = torch.cat([torch.linspace(-a, a, block_size) for a in absmax])
    check_against_reference(x, bits, block_size, device, force_triton, full_range)
    if block_size < 8192:
        return
    for branchless in (False, True):  # int4: both forms of the looping quantize
        variant = Variant(stream_int4_branchless=branchless)
        q, scales = quantize(x.to(device), bits, block_size, force_triton=force_triton,
                             full_range=full_range, variant=variant)
        q_ref, s_ref = quantize_reference(x, bits, block_size, full_range)
        assert_same(scales, s_ref, f"scales (branchless={branchless})")
        assert_same(q, q_ref, f"q (branchless={branchless})")
        q, scales = swizzled_quantize(x.to(device), bits, block_size, 2, 2,
                                      force_triton=force_triton, full_range=full_range,
                                      variant=variant)
        q_ref, s_ref = swizzled_quantize_reference(x, bits, block_size, 2, 2, full_range)
        assert_same(q.cpu(), q_ref, "swizzled q")
        assert_same(scales.cpu(), s_ref, "swizzled scales")


def check_near_ties(device: str, force_triton: bool, bits: int,
                    full_range: bool = False) -> None:
    """x / scale at and within a few ulps of k + 0.5 for scales with full mantissas, where a
    reciprocal multiply alone would round the wrong way."""
    gen = torch.Generator().manual_seed(3)
    block_size = 256
    qmax = 2 ** (bits - 1) - 1
    absmax = (torch.rand(64, generator=gen) + 1) * torch.logspace(-20, 20, 64)
    scale = absmax / qmax
    k = torch.randint(-qmax, qmax, (64, block_size), generator=gen).float() + 0.5
    x = (k * scale[:, None]).view(torch.int32)
    x = (x + torch.randint(-2, 3, x.shape, generator=gen, dtype=torch.int32)).view(torch.float32)
    x = torch.cat([absmax[:, None], x[:, 1:].clamp(-absmax[:, None], absmax[:, None])], dim=1)
    check_against_reference(x.flatten(), bits, block_size, device, force_triton, full_range)


def check_against_reference(x: torch.Tensor, bits: int, block_size: int, device: str,
                            force_triton: bool, full_range: bool = False) -> None:
    q, scales = quantize(x.to(device), bits, block_size, force_triton=force_triton,
                         full_range=full_range)
    q_ref, s_ref = quantize_reference(x, bits, block_size, full_range)
    assert_same(scales, s_ref, "scales")
    assert_same(q, q_ref, "q")


# --- explicit expectations (run on the reference in-process and on the kernels) ----------------

def check_ties(device: str, force_triton: bool, bits: int) -> None:
    """Exact ties x / scale = k + 0.5 round to even, with a power-of-two scale and with a scale
    of 3 * 2^-10 (not a power of two; the products stay exact in fp32)."""
    qmax = 2 ** (bits - 1) - 1
    halves = [h + 0.5 for h in range(-qmax, qmax)]
    for scale in (2.0**-4, 3 * 2.0**-10):
        x = torch.tensor([qmax * scale] + [h * scale for h in halves])
        q, scales = quantize(x.to(device), bits, len(x) + len(x) % 2,
                             force_triton=force_triton)
        assert scales.cpu().tolist() == [scale]
        want = [qmax] + [round(h) for h in halves]  # Python's round: half to even
        assert unpack(q.cpu(), bits, len(x)).tolist() == want


def unpack(q: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Independent int4 unpacking for the checks: element 2i low nibble, 2i+1 high."""
    if bits == 8:
        return q.to(torch.int64)
    b = q.to(torch.int64)
    nibbles = torch.stack((b & 15, b >> 4), dim=-1).flatten()[:numel]
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)


def check_int4_layout(device: str, force_triton: bool) -> None:
    """Packing by hand: absmax 7 gives scale 1, so q = x; odd numel pads the last high nibble."""
    x = torch.tensor([1.0, -1.0, 7.0, -7.0, 0.0, 3.0, -4.0, 2.0, 5.0])
    q, scales = quantize(x.to(device), 4, 10, force_triton=force_triton)
    assert scales.cpu().tolist() == [1.0]
    assert q.dtype == torch.uint8
    assert q.cpu().tolist() == [0xF1, 0x97, 0x30, 0x2C, 0x05]


def check_zero_blocks(device: str, force_triton: bool, bits: int) -> None:
    """All-zero blocks (also -0.0, and a partial last block) get scale 1 and q 0."""
    x = torch.tensor([0.0] * 8 + [-0.0] * 8 + [1.0, -2.0] + [0.0] * 6 + [0.0, -0.0])
    q, scales = quantize(x.to(device), bits, 8, force_triton=force_triton)
    assert scales.cpu().tolist()[:2] == [1.0, 1.0] and scales.cpu().tolist()[3] == 1.0
    assert (unpack(q.cpu(), bits, len(x))[:16] == 0).all()
    assert (unpack(q.cpu(), bits, len(x))[24:] == 0).all()
    deq = dequantize(q, scales, len(x), bits, 8, force_triton=force_triton).cpu()
    assert (deq[:16] == 0).all() and (deq[24:] == 0).all()


def check_nonfinite(device: str, force_triton: bool, bits: int, dtype: str = "fp32") -> None:
    """A block holding NaN, +Inf or -Inf gets scale NaN and q 0 and dequantizes to NaN; finite
    blocks beside it are untouched; a reduce whose sum overflows marks the block the same way.
    (16-bit inputs: the kernel finds them from the 16-bit patterns.)"""
    block_size = 4
    x = torch.tensor([1.0, float("nan"), 2.0, 3.0, 1.0, 2.0, 3.0, 4.0,
                      float("inf"), 1.0, 1.0, 1.0, -1.0, 1.0, float("-inf"), 1.0],
                     dtype=DTYPES[dtype])
    q, scales = quantize(x.to(device), bits, block_size, force_triton=force_triton)
    assert torch.isnan(scales.cpu()).tolist() == [True, False, True, True]
    values = unpack(q.cpu(), bits, len(x)).view(4, block_size)
    assert (values[[0, 2, 3]] == 0).all() and (values[1] != 0).all()
    deq = dequantize(q, scales, len(x), bits, block_size, force_triton=force_triton).cpu()
    assert deq.view(4, block_size)[[0, 2, 3]].isnan().all()
    assert ((deq[4:8] - x[4:8]).abs() <= scales[1].cpu() / 2).all()
    big = torch.full((2 * block_size,), 3e38)  # two inputs, one partition each: sum overflows
    q_big, s_big = quantize_reference(big, bits, block_size)
    q_sum, s_sum = dequantize_reduce_quantize(q_big.to(device), s_big.to(device), 2, bits, bits,
                                              block_size, block_size, force_triton=force_triton)
    assert torch.isnan(s_sum.cpu()).all() and (unpack(q_sum.cpu(), bits, block_size) == 0).all()


def check_int4_words(device: str, force_triton: bool) -> None:
    """int4 -> int4 dequantize-reduce-quantize over aligned partitions (multiples of 8
    elements) takes the int32-word decode (Variant.words); the byte decode is forced for the
    same inputs: both equal the reference, with a zero block, a NaN block, scales down to
    2^-130 (subnormal) and every nibble value -8..7 (including -8, which the scheme never
    writes but a payload may hold) among the inputs."""
    num_inputs, parts, numel, block_size = 3, 2, 1048, 8
    blocks = num_inputs * parts * (numel // block_size)
    q = torch.randint(0, 256, (num_inputs * parts * numel // 2,), dtype=torch.uint8)
    q[:4] = 0  # a zero block
    q[4:8] = torch.tensor([0x10, 0x32, 0x54, 0x76], dtype=torch.uint8)  # nibbles 0..7
    q[8:12] = torch.tensor([0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)  # -8..-1
    scales = torch.rand(blocks) * 2.0 ** torch.randint(-130, 10, (blocks,)).float()
    scales[5] = float("nan")
    want = dequantize_reduce_quantize_reference(q, scales, num_inputs, 4, 4, block_size, numel)
    for words in (True, False):
        got = dequantize_reduce_quantize(q.to(device), scales.to(device), num_inputs, 4, 4,
                                         block_size, numel, force_triton=force_triton,
                                         variant=Variant(words=words))
        assert_same(got[0].cpu(), want[0], f"q (words={words})")
        assert_same(got[1].cpu(), want[1], f"scales (words={words})")


EXPLICIT_CHECKS = {
    "int4-words": (check_int4_words, {}),
    "ties-int8": (check_ties, {"bits": 8}), "ties-int4": (check_ties, {"bits": 4}),
    "int4-layout": (check_int4_layout, {}),
    "zero-blocks-int8": (check_zero_blocks, {"bits": 8}),
    "zero-blocks-int4": (check_zero_blocks, {"bits": 4}),
    "nonfinite-int8": (check_nonfinite, {"bits": 8}),
    "nonfinite-int4": (check_nonfinite, {"bits": 4}),
    "nonfinite-bf16-int8": (check_nonfinite, {"bits": 8, "dtype": "bf16"}),
    "nonfinite-fp16-int4": (check_nonfinite, {"bits": 4, "dtype": "fp16"}),
}


def kernel_cases() -> dict[str, tuple]:
    """Small inputs (<= 64K elements) for the interpreter: odd sizes, partial blocks, several
    blocks per program (256), non-power-of-two blocks (300), one block per program (16384)."""
    cases = dict(EXPLICIT_CHECKS)
    sizes = [(1, 2), (7, 4), (2047, 2048), (2049, 2048), (5000, 256), (3001, 300)]
    for numel, block_size in sizes:
        for dtype in DTYPES:
            for bits in (8, 4):
                params = {"numel": numel, "dtype": dtype, "bits": bits, "block_size": block_size}
                cases[f"quantize-{numel}-{block_size}-{dtype}-int{bits}"] = (check_quantize,
                                                                              params)
                if numel in (7, 2049, 5000):
                    cases[f"dequantize-{numel}-{block_size}-{dtype}-int{bits}"] = (
                        check_dequantize, params)
    # 65535 / 8192: 8 blocks (the last partial) over a few programs that loop
    # (block_quantize._quantize_loop_kernel)
    for numel, block_size in [(65536, 16384), (65535, 256), (65535, 8192)]:
        for dtype in DTYPES:
            for bits in (8, 4):
                params = {"numel": numel, "dtype": dtype, "bits": bits, "block_size": block_size}
                for op, check in (("quantize", check_quantize), ("dequantize", check_dequantize)):
                    cases[f"{op}-{numel}-{block_size}-{dtype}-int{bits}"] = (check, params)
    for bits in (8, 4):
        cases[f"tiny-scales-int{bits}"] = (check_tiny_scales, {"bits": bits})
        cases[f"tiny-scales-8192-int{bits}"] = (check_tiny_scales,
                                                {"bits": bits, "block_size": 8192})
        cases[f"near-ties-int{bits}"] = (check_near_ties, {"bits": bits})
        for nodes, dpn, numel, block_size, dtype in [
                (2, 4, 6, 4, "fp32"), (2, 2, 1000, 256, "bf16"), (3, 1, 515, 512, "fp16"),
                (1, 4, 2048, 2048, "fp32"), (2, 2, 3 * 8192 + 5, 8192, "bf16")]:
            cases[f"swizzle-{nodes}x{dpn}-{numel}-{block_size}-{dtype}-int{bits}"] = (
                check_swizzled_quantize, {"nodes": nodes, "devices_per_node": dpn,
                                          "partition_numel": numel, "bits": bits,
                                          "block_size": block_size, "dtype": dtype})
        for bits_out in (8, 4):
            for num_inputs, parts, numel, block_size in [(4, 2, 1000, 256), (2, 1, 4097, 2048),
                                                         (1, 3, 7, 4)]:
                cases[f"dequant-reduce-quant-{num_inputs}x{parts}-{numel}-{block_size}-"
                      f"int{bits}-int{bits_out}"] = (
                    check_dequantize_reduce_quantize,
                    {"num_inputs": num_inputs, "parts": parts, "partition_numel": numel,
                     "bits_in": bits, "bits_out": bits_out, "block_size": block_size})
        for dtype, multiplier in (("fp32", 0.25), ("bf16", 1.0), ("fp16", 1 / 3)):
            cases[f"dequant-reduce-{dtype}-int{bits}"] = (
                check_dequantize_reduce,
                {"num_inputs": 2, "parts": 2, "partition_numel": 999, "bits": bits,
                 "block_size": 256, "dtype": dtype, "multiplier": multiplier})
    cases.update(row_cases())
    cases.update(full_range_cases())
    return cases


def full_range_cases() -> dict[str, tuple]:
    """full_range=True (DeepSpeed's levels) on every kernel path: odd sizes and partial blocks,
    several blocks a program, one block a program and the looping quantize, the swizzle, the
    reduce (int4 -> int4 on words and bytes, int8), tiny scales, near-ties."""
    cases: dict[str, tuple] = {}
    for numel, block_size in [(7, 4), (2049, 2048), (5000, 256), (3001, 300), (65536, 16384),
                              (65535, 8192)]:
        for dtype in DTYPES:
            for bits in (8, 4):
                cases[f"full-range-quantize-{numel}-{block_size}-{dtype}-int{bits}"] = (
                    check_quantize, {"numel": numel, "dtype": dtype, "bits": bits,
                                     "block_size": block_size, "full_range": True})
    for bits in (8, 4):
        for nodes, dpn, numel, block_size, dtype in [(2, 2, 1000, 256, "bf16"),
                                                     (2, 2, 3 * 8192 + 5, 8192, "fp16")]:
            cases[f"full-range-swizzle-{nodes}x{dpn}-{numel}-{block_size}-int{bits}"] = (
                check_swizzled_quantize, {"nodes": nodes, "devices_per_node": dpn,
                                          "partition_numel": numel, "bits": bits,
                                          "block_size": block_size, "dtype": dtype,
                                          "full_range": True})
        for num_inputs, parts, numel, block_size in [(4, 2, 1000, 256), (2, 1, 4097, 2048),
                                                     (2, 2, 1001, 256)]:
            cases[f"full-range-dequant-reduce-quant-{num_inputs}x{parts}-{numel}-int{bits}"] = (
                check_dequantize_reduce_quantize,
                {"num_inputs": num_inputs, "parts": parts, "partition_numel": numel,
                 "bits_in": bits, "bits_out": bits, "block_size": block_size,
                 "full_range": True})
        cases[f"full-range-tiny-scales-int{bits}"] = (check_tiny_scales,
                                                      {"bits": bits, "full_range": True})
        cases[f"full-range-tiny-scales-8192-int{bits}"] = (
            check_tiny_scales, {"bits": bits, "block_size": 8192, "full_range": True})
        cases[f"full-range-near-ties-int{bits}"] = (check_near_ties,
                                                    {"bits": bits, "full_range": True})
        cases[f"full-range-levels-int{bits}"] = (check_full_range_levels, {"bits": bits})
    return cases


def check_full_range_levels(device: str, force_triton: bool, bits: int) -> None:
    """full_range: scale absmax / 2^(bits-1); -absmax takes the extra level -2^(bits-1) and
    +absmax is clipped to 2^(bits-1) - 1; ties round half to even."""
    levels = 2 ** (bits - 1)
    scale = 2.0**-3
    x = torch.tensor([-levels * scale, levels * scale, 2.5 * scale, -0.5 * scale, 1.5 * scale,
                      0.0])
    q, scales = quantize(x.to(device), bits, 6, force_triton=force_triton, full_range=True)
    assert scales.cpu().tolist() == [scale]
    assert unpack(q.cpu(), bits, len(x)).tolist() == [-levels, levels - 1, 2, 0, 2, 0]


def run_cases(device: str, force_triton: bool, cases: dict[str, tuple],
              timings: dict[str, float] | None = None) -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for name, (check, params) in cases.items():
        start = time.process_time()
        try:
            check(device, force_triton, **params)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        if timings is not None:
            timings[name] = time.process_time() - start
    return results


# --- the interpreted kernels, one subprocess ------------------------------------------------------

KERNEL_CASES = kernel_cases()
ROW_CASES = row_cases()


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str | None]:
    if not HAS_TRITON:
        pytest.skip("triton is not installed (the test extra brings it where a wheel exists: "
                    "bash scripts/setup.sh test): kernel cases not run")
    if INTERPRETING:
        return run_cases("cpu", True, KERNEL_CASES)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    if "<skip>" in results:
        pytest.skip(results["<skip>"])
    return results


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_interpreted(case: str, interpreted_results: dict[str, str | None]) -> None:
    assert interpreted_results[case] is None, interpreted_results[case]


# --- the references, in-process ----------------------------------------------------------------

@pytest.mark.parametrize("case", list(EXPLICIT_CHECKS))
def test_reference_explicit(case: str) -> None:
    check, params = EXPLICIT_CHECKS[case]
    check("cpu", False, **params)


def float64_oracle(x: torch.Tensor, bits: int, block_size: int,
                   full_range: bool = False) -> torch.Tensor:
    """The scheme written independently in float64: absmax scaling, round half even
    (full_range: DeepSpeed's levels, absmax / 2^(bits-1), [-2^(bits-1), 2^(bits-1) - 1])."""
    qmax = 2 ** (bits - 1) - 1
    x64 = torch.nn.functional.pad(x.double(), (0, -len(x) % block_size)).view(-1, block_size)
    scale = x64.abs().amax(dim=1, keepdim=True) / (qmax + full_range)
    scale[scale == 0] = 1.0
    return ((x64 / scale).round().clamp(-qmax - full_range, qmax) * scale).flatten()[:len(x)]


@pytest.mark.parametrize("full_range", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("block_size", [256, 2048])
def test_reference_error_and_round_trip(bits: int, dtype: str, block_size: int,
                                        full_range: bool) -> None:
    """Error no worse than 1.05x the float64 oracle's; |dequantize(quantize(x)) - x| <= scale/2
    per element (and half an ulp of the output dtype more); full_range: one scale where a
    block's positive maximum is clipped."""
    x = make_input(3 * block_size + 17, block_size).to(DTYPES[dtype])
    q, scales = quantize(x, bits, block_size, full_range=full_range)
    deq = dequantize(q, scales, x.numel(), bits, block_size).double()
    x64 = x.double()
    error = (deq - x64).norm() / x64.norm()
    oracle_error = (float64_oracle(x, bits, block_size, full_range) - x64).norm() / x64.norm()
    assert error <= 1.05 * oracle_error + 1e-12, (error, oracle_error)
    # scale / 2, plus the fp32 rounding of x / scale and of q * scale
    per_element = scales.double().repeat_interleave(block_size)[: x.numel()]
    clipped = x64 > per_element * (2 ** (bits - 1) - 0.5) if full_range else \
        torch.zeros_like(x64, dtype=torch.bool)
    bound = torch.where(clipped, per_element, per_element / 2) + x64.abs() * 2**-22
    assert ((deq - x64).abs() <= bound).all()
    low = dequantize(q, scales, x.numel(), bits, block_size, DTYPES[dtype]).double()
    assert ((low - x64).abs() <= bound + torch.finfo(DTYPES[dtype]).eps * x64.abs()).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_qgz_pipeline_is_mean_reduce_scatter(bits: int) -> None:
    """The five qgZ steps of megadomino.kernels' docstring, the all-to-alls done by indexing,
    2 nodes x 2 ranks: each rank ends with the mean of its partition within the quantization
    bound."""
    nodes, dpn, partition, block_size = 2, 2, 1000, 256
    world = nodes * dpn
    grads = [make_input(world * partition, block_size, seed=20 + r) for r in range(world)]
    q_elems, s_elems = quantized_size(partition, bits, block_size)
    swizzled = [swizzled_quantize(g, bits, block_size, nodes, dpn) for g in grads]
    stage1_bound = sum(s.view(world, -1).double() for _, s in swizzled)  # (position, block)
    for rank in range(world):
        node, local = divmod(rank, dpn)
        # intra-node all-to-all: from each peer on this node, its piece `local` (nodes parts)
        peers = [node * dpn + j for j in range(dpn)]
        recv_q = torch.cat([swizzled[p][0].view(dpn, -1)[local] for p in peers])
        recv_s = torch.cat([swizzled[p][1].view(dpn, -1)[local] for p in peers])
        partial = {}
        for n in range(nodes):  # what rank (n, local) computes in step 3, for every node n
            peers_n = [n * dpn + j for j in range(dpn)]
            q_n = torch.cat([swizzled[p][0].view(dpn, -1)[local] for p in peers_n])
            s_n = torch.cat([swizzled[p][1].view(dpn, -1)[local] for p in peers_n])
            partial[n] = dequantize_reduce_quantize(q_n, s_n, dpn, bits, bits, block_size,
                                                    partition)
        assert torch.equal(partial[node][0], dequantize_reduce_quantize(
            recv_q, recv_s, dpn, bits, bits, block_size, partition)[0])
        # inter-node all-to-all: from each node n, its partition for this rank's node
        final_q = torch.cat([partial[n][0].view(nodes, q_elems)[node] for n in range(nodes)])
        final_s = torch.cat([partial[n][1].view(nodes, s_elems)[node] for n in range(nodes)])
        mean = dequantize_reduce(final_q, final_s, nodes, bits, block_size, partition,
                                 multiplier=1 / world).double()
        exact = torch.stack([g.view(world, -1)[rank].double() for g in grads]).mean(dim=0)
        position = local * nodes + node  # where partition `rank` sits after the swizzle
        bound = stage1_bound[position] / 2 + sum(final_s.view(nodes, -1).double()) / 2
        bound = bound.repeat_interleave(block_size)[:partition] / world
        assert ((mean - exact).abs() <= bound * (1 + 1e-5) + 1e-30).all()


def test_swizzle_order_matches_deepspeed() -> None:
    """2 nodes x 4: partitions 0..7 come out as 0 4 1 5 2 6 3 7 (DeepSpeed's example)."""
    x = torch.arange(8.0).repeat_interleave(16) + 1  # partition p is all p + 1
    q, scales = swizzled_quantize(x, 8, 16, 2, 4)
    values = dequantize(q, scales, 128, 8, 16).view(8, 16)
    assert values[:, 0].tolist() == [1.0, 5.0, 2.0, 6.0, 3.0, 7.0, 4.0, 8.0]
    assert (values == values[:, :1]).all()


def test_partition_multiple_of_block_is_plain_quantize() -> None:
    x = make_input(4 * 512, 256)
    order = [0, 2, 1, 3]  # 2 nodes x 2
    q, scales = swizzled_quantize(x, 4, 256, 2, 2)
    q_ref, s_ref = quantize(x.view(4, -1)[order].flatten(), 4, 256)
    assert torch.equal(q, q_ref) and torch.equal(scales, s_ref)


def test_invalid_arguments_are_refused() -> None:
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits"):
        quantize(x, 3)
    with pytest.raises(ValueError, match="even block_size"):
        quantize(x, 4, 5)
    with pytest.raises(ValueError, match="block_size"):
        quantize(x, 8, 16385)
    with pytest.raises(TypeError, match="float32"):
        quantize(torch.arange(10), 8)
    with pytest.raises(ValueError, match="equal partitions"):
        swizzled_quantize(x, 8, 4, 2, 2)
    q, scales = quantize(x, 8, 4)
    with pytest.raises(ValueError, match="q must be"):
        dequantize(q, scales, 11, 8, 4)
    with pytest.raises(ValueError, match="q must be"):
        dequantize(q.view(torch.uint8), scales, 10, 4, 4)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize(q, scales[:2], 10, 8, 4)
    with pytest.raises(ValueError, match="out scales must be"):
        quantize(x, 8, 4, out=(torch.empty(10, dtype=torch.int8), torch.empty(2)))
    with pytest.raises(ValueError, match="whole"):
        dequantize_reduce_quantize(q, scales, 3, 8, 8, 4, 10)


def test_payload_layout_sizes() -> None:
    """Two int4 partitions of 1001 per row: 2 x 501 q bytes padded to 1008, 2 x 8 scales (64
    bytes, already a multiple of 16); the views sit at those offsets of each row."""
    layout = PayloadLayout(2, 1001, 4, 128)
    assert (layout.q_numel, layout.scales_numel) == (1002, 16)
    assert (layout.scales_offset, layout.row_bytes) == (1008, 1072)
    payload = layout.empty(3, "cpu")
    q, scales = layout.views(payload)
    assert q.dtype == torch.uint8 and q.shape == (3, 1002) and q.stride() == (1072, 1)
    assert scales.shape == (3, 16) and scales.stride() == (268, 1)
    assert scales.data_ptr() - payload.data_ptr() == 1008
    assert scales[1:].data_ptr() - payload.data_ptr() == 1072 + 1008
    q8, _ = PayloadLayout(1, 5, 8, 4).views(PayloadLayout(1, 5, 8, 4).empty(1, "cpu"))
    assert q8.dtype == torch.int8 and PayloadLayout(1, 5, 8, 4).row_bytes == 32


def test_row_layouts_refused() -> None:
    x = torch.randn(2, 10)
    layout = PayloadLayout(1, 10, 8, 4)
    with pytest.raises(ValueError, match="payload must be"):
        layout.views(torch.empty(2, layout.row_bytes + 1, dtype=torch.uint8))
    q = torch.empty(2, 10, dtype=torch.int8)
    scales = torch.empty(2, 3)
    overlapping = (q.as_strided((2, 10), (5, 1)), scales)
    with pytest.raises(ValueError, match="non-overlapping"):
        swizzled_quantize(x, 8, 4, 2, 1, out=overlapping)
    q, scales = torch.zeros(24, dtype=torch.int8), torch.ones(12)  # 4 partitions of 6
    with pytest.raises(ValueError, match="whole partitions"):  # 3 rows of 4 / 3 partitions
        dequantize_reduce(q.view(3, 8), scales.view(3, 4), 1, 8, 2, 6)
    with pytest.raises(ValueError, match="whole partitions"):  # q in 2 rows, scales in 1
        dequantize_reduce(q.view(2, 12), scales.view(1, 12), 1, 8, 2, 6)


@pytest.mark.parametrize("case", list(ROW_CASES))
def test_reference_rows(case: str) -> None:
    """The CPU path (torch reference) reads and writes the same row layouts."""
    check, params = ROW_CASES[case]
    check("cpu", False, **params)


def test_empty_input() -> None:
    q, scales = quantize(torch.empty(0, dtype=torch.bfloat16), 4, 2048)
    assert q.numel() == 0 and scales.numel() == 0 and q.dtype == torch.uint8
    assert dequantize(q, scales, 0, 4, 2048, torch.bfloat16).numel() == 0


@pytest.mark.skipif(not HAS_TRITON or INTERPRETING,
                    reason="needs triton imported without TRITON_INTERPRET")
def test_force_triton_without_interpreter_says_why() -> None:
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        quantize(torch.randn(8), force_triton=True)


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the dispatch takes the CUDA branch, the reference
    it falls back to runs on CPU."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_every_kernel_without_triton_on_cuda_says_so_once(monkeypatch) -> None:
    """Each op's fallback to its torch reference on a CUDA tensor (triton not importable) warns
    once a process, naming the op, through the one dispatch (quant_launch.use_triton)."""
    from megadomino.kernels import adamw_flat, bias_grad, fp8_cast, quant_launch

    def cuda(*shape: int, fill: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full(shape, fill, dtype=dtype).as_subclass(CudaLooking)

    calls = {"ZeRO++ quantization": lambda: quantize(cuda(64), 8, 32),
             "the FP8 cast": lambda: fp8_cast.cast_transpose(
                 cuda(4, 4), torch.ones(()), torch.float8_e4m3fn, True, True),
             "the GELU bias gradient": lambda: bias_grad.gelu_bias_backward(
                 cuda(4, 4), cuda(4, 4), cuda(4)),
             "AdamW's flat step": lambda: adamw_flat.adamw_flat(
                 cuda(8), cuda(8), cuda(8), cuda(8), cuda(8, fill=0, dtype=torch.uint8),
                 torch.ones(1), torch.zeros(1), 0.9, 0.95, 1e-8, torch.ones(()), torch.ones(()),
                 torch.zeros(()), None)}
    monkeypatch.setattr(quant_launch, "HAS_TRITON", False)
    quant_launch._warn_no_triton.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # not the registry: use_triton itself warns once
            for call in [*calls.values(), *calls.values()]:
                call()
    finally:
        quant_launch._warn_no_triton.cache_clear()
    assert [str(w.message) for w in caught] == [
        f"triton is not installed: {op} on CUDA tensors runs its slow torch reference"
        for op in calls]


def interpreter_fma_is_fused() -> bool:
    """The kernel's division relies on tl.fma rounding once; some Triton versions' interpreters
    (3.6) emulate it as a multiply then an add, which the GPU never does."""
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(ptr):
        a = tl.load(ptr)
        tl.store(ptr, tl.fma(a, a, -(1.0 + 2.0**-11)))

    value = torch.tensor([1.0 + 2.0**-12])
    fma_kernel[(1,)](value)
    return value.item() == 2.0**-24


if __name__ == "__main__":  # the interpreter subprocess: run every kernel case, print JSON
    assert INTERPRETING, "run with TRITON_INTERPRET=1"
    if not interpreter_fma_is_fused():
        import triton

        print(json.dumps({"<skip>": f"triton {triton.__version__}'s interpreter does not fuse "
                                    "tl.fma (triton 3.9's does); tests/gpu checks the kernels"}))
    else:
        print(json.dumps(run_cases("cpu", True, KERNEL_CASES)))
