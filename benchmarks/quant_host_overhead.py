"""Host (Python) time of the quantization wrappers per call, with the Triton launch stubbed out:
what a small-micro-batch ZeRO++ step pays per quantize / reduce call before the kernel launch
itself (its numbers: benchmarks/reports/2026-11-22-zero-engine-nvlink.md). Runs on CPU, no GPU
needed.

    python benchmarks/quant_host_overhead.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megadomino import kernels as quant  # noqa: E402
from megadomino.kernels import block_dequantize, block_quantize, block_requantize  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    for module in (block_quantize, block_dequantize, block_requantize):
        for name in dir(module):
            if name.endswith("_kernel"):
                setattr(module, name, _NoLaunch())
        module.use_triton = lambda tensor, force_triton: True  # the CUDA path, on CPU tensors
    numel, block = 2**20, 2048
    x = torch.randn(numel, dtype=torch.bfloat16)
    layout = quant.PayloadLayout(2, numel // 4, 4, block)  # 2 x 2 ranks: 2 rows of 2 parts
    payload = layout.empty(2, "cpu")
    q, scales = layout.views(payload)
    cases = {
        "quantize": lambda: quant.quantize(x, 8, block),
        "PayloadLayout.views": lambda: layout.views(payload),
        "swizzled_quantize into a payload": lambda: quant.swizzled_quantize(
            x, 4, block, 2, 2, out=layout.views(payload)),
        "dequantize_reduce": lambda: quant.dequantize_reduce(q, scales, 2, 4, block, numel // 4,
                                                             torch.float32, 0.5),
        "dequantize_reduce_quantize": lambda: quant.dequantize_reduce_quantize(
            q, scales, 2, 4, 4, block, numel // 4),
    }
    for name, fn in cases.items():
        print(f"{name}: {per_call_us(fn, args.calls):.1f} us per call")


if __name__ == "__main__":
    main()
