"""On the GPU machine: the compiled quantization kernels against their torch references (bit
for bit, bf16 output rounded to nearest even as torch does), larger than the interpreter allows,
plus offsets past 2^31, a tensor on another GPU than the current one, and the row layouts
(quantized data read and written in place in payload rows) of tests/test_kernels.py; and the
fused FP8 cast (kernels/fp8_cast.py) on random inputs (tests/test_fp8_kernel.py), and the
bias-gradient kernel (kernels/bias_grad.py, tests/test_bias_grad_kernel.py) at the default tiles
and at layer sizes; and the row top-k (kernels/row_topk.py, tests/test_row_topk_kernel.py) against
its exact oracle and torch.topk, alone and as the adatopk codec's select. Skipped
without CUDA; `python -m pytest tests/gpu/test_gpu_kernels.py -q` runs it."""

from __future__ import annotations

import pytest
import torch
from test_kernels import (
    DTYPES,
    EXPLICIT_CHECKS,
    assert_same,
    check_dequantize,
    check_dequantize_reduce,
    check_dequantize_reduce_quantize,
    check_near_ties,
    check_quantize,
    check_swizzled_quantize,
    check_tiny_scales,
    row_cases,
)

from megadomino.kernels import dequantize, quantize, quantize_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SIZES = [(1, 256), (2049, 2048), (1_000_003, 256), (1_000_003, 2048), (4_194_305, 8192),
         (999_999, 3000), (65_536, 16384)]


@pytest.mark.parametrize("numel,block_size", SIZES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_dequantize(numel: int, block_size: int, dtype: str, bits: int) -> None:
    check_quantize("cuda", False, numel, dtype, bits, block_size)
    check_dequantize("cuda", False, numel, dtype, bits, block_size)


@pytest.mark.parametrize("case", list(EXPLICIT_CHECKS))
def test_explicit(case: str) -> None:
    check, params = EXPLICIT_CHECKS[case]
    check("cuda", False, **params)


ROW_CASES = row_cases()


@pytest.mark.parametrize("case", list(ROW_CASES))
def test_row_layouts(case: str) -> None:
    """The row layouts (PayloadLayout rows and gapped rows) on the compiled kernel."""
    check, params = ROW_CASES[case]
    check("cuda", False, **params)


@pytest.mark.parametrize("bits", [8, 4])
def test_division_paths(bits: int) -> None:
    check_tiny_scales("cuda", False, bits)
    check_tiny_scales("cuda", False, bits, block_size=8192)  # the looping quantize
    check_near_ties("cuda", False, bits)


@pytest.mark.parametrize("nodes,devices_per_node,partition_numel,block_size",
                         [(2, 4, 262_144, 2048), (2, 8, 100_001, 256), (4, 2, 8192, 8192)])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [8, 4])
def test_swizzled_quantize(nodes: int, devices_per_node: int, partition_numel: int,
                           block_size: int, dtype: str, bits: int) -> None:
    check_swizzled_quantize("cuda", False, nodes, devices_per_node, partition_numel, bits,
                            block_size, dtype)


@pytest.mark.parametrize("num_inputs,parts,partition_numel,block_size",
                         [(4, 2, 262_144, 2048), (8, 2, 100_001, 256), (16, 1, 65_536, 8192)])
@pytest.mark.parametrize("bits_in,bits_out", [(4, 4), (8, 8), (4, 8), (8, 4)])
def test_dequantize_reduce_quantize(num_inputs: int, parts: int, partition_numel: int,
                                    block_size: int, bits_in: int, bits_out: int) -> None:
    check_dequantize_reduce_quantize("cuda", False, num_inputs, parts, partition_numel, bits_in,
                                     bits_out, block_size)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_reduce(dtype: str, bits: int) -> None:
    check_dequantize_reduce("cuda", False, 4, 2, 100_001, bits, 2048, dtype, 1 / 8)


@pytest.mark.parametrize("block_size", [2048, 8192])  # 8192: the looping quantize
def test_offsets_past_2_31(block_size: int) -> None:
    """2^31 + 2^21 fp16 elements: the last blocks (bytes past 2^31) match the reference."""
    numel, tail = 2**31 + 2**21, 2**22
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    x = torch.randn(numel, dtype=torch.float16, device="cuda")
    q, scales = quantize(x, 8, block_size)
    q_ref, s_ref = quantize_reference(x[-tail:].cpu(), 8, block_size)
    assert_same(q[-tail:], q_ref, "q")
    assert_same(scales[-tail // block_size:], s_ref, "scales")
    q4, s4 = quantize(x, 4, block_size)
    q4_ref, _ = quantize_reference(x[-tail:].cpu(), 4, block_size)
    assert_same(q4[-tail // 2:], q4_ref, "q int4")
    out = dequantize(q4, s4, numel, 4, block_size, torch.float16)
    assert_same(out[-tail:], dequantize(q4_ref, s4[-tail // block_size:].cpu(), tail, 4,
                                        block_size, torch.float16), "dequantized")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_on_another_gpu() -> None:
    x = torch.randn(100_001, dtype=torch.bfloat16)
    with torch.cuda.device(0):
        q, scales = quantize(x.to("cuda:1"), 4, 256)
    assert q.device == torch.device("cuda:1")
    q_ref, s_ref = quantize_reference(x, 4, 256)
    assert_same(q, q_ref, "q")
    assert_same(scales, s_ref, "scales")


@pytest.mark.parametrize("numel,block_size", [(1_000_003, 256), (1_000_003, 2048),
                                              (4_194_305, 8192), (999_999, 3000)])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [8, 4])
def test_full_range(numel: int, block_size: int, dtype: str, bits: int) -> None:
    """full_range=True (DeepSpeed's levels) on the compiled kernels: quantize (every path), the
    swizzle, the reduce (int4 words and bytes, int8), tiny scales and near-ties."""
    check_quantize("cuda", False, numel, dtype, bits, block_size, full_range=True)
    if dtype == "fp32" and numel == 1_000_003:
        check_swizzled_quantize("cuda", False, 2, 4, 100_001, bits, block_size, "bf16",
                                full_range=True)
        check_dequantize_reduce_quantize("cuda", False, 4, 2, 262_144, bits, bits, block_size,
                                         full_range=True)
        check_tiny_scales("cuda", False, bits, full_range=True)
        check_tiny_scales("cuda", False, bits, block_size=8192, full_range=True)
        check_near_ties("cuda", False, bits, full_range=True)


@pytest.mark.parametrize("shape", [(37, 70), (130, 3), (2048, 4096), (8192, 1000)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_fp8_cast_transpose(shape: tuple[int, int], dtype: str, fp8: str) -> None:
    """kernels/fp8_cast.py on CUDA, random values (rounding to nearest, saturation, inf) and a
    NaN: q, its transpose and the amax bit for bit as the torch reference."""
    from test_fp8_kernel import check_cast
    check_cast("cuda", False, shape, dtype, fp8, exact=False)
    check_cast("cuda", False, shape, dtype, fp8, exact=False, nan=True)


@pytest.mark.parametrize("rows, cols", [(37, 70), (8192, 8192), (3000, 1000)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gelu_bias_backward(rows: int, cols: int, dtype: str) -> None:
    from test_bias_grad_kernel import check_gelu
    check_gelu("cuda", False, rows, cols, dtype, block=(64, 128))



@pytest.mark.parametrize("rows,hidden", [(8192, 2048), (512, 8192), (128, 16384), (1000, 1000),
                                         (4097, 37)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", ["distinct", "ties", "special"])
def test_row_topk(rows: int, hidden: int, dtype: str, kind: str) -> None:
    """kernels/row_topk.py on CUDA (tests/test_row_topk_kernel.py's checks): the exact oracle's
    indices at k = 1, 3, h / 10, h - 1, h, the values bit for bit, torch.topk's set where the
    k-th magnitude has no tie."""
    from test_row_topk_kernel import check_row_topk
    check_row_topk("cuda", False, rows, hidden, dtype, kind)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["distinct", "ties"])
@pytest.mark.parametrize("values", ["native", "int8", "int4"])
def test_adatopk_codec_on_the_kernel(dtype: str, kind: str, values: str) -> None:
    """The codec's adatopk round trip on CUDA (its select: the kernel) against the torch.topk
    path on CPU, at a gpt3-1.3b row (h = 2048)."""
    from test_row_topk_kernel import check_codec
    check_codec("cuda", False, 2048, 2048, dtype, kind, values)
