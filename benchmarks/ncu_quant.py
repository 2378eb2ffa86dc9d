"""Run each quantization op once (after a warm-up) for Nsight Compute, one GPU:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        -k regex:quantize.*_kernel python3 benchmarks/ncu_quant.py --ops drq4 q8

Ops: q8 / q4 (quantize fp16), drq4 / drq8 (dequantize-reduce-quantize, 4 inputs), at the
group sizes given (default 2048 8192). The kernels run in the order listed, once per op."""
import argparse
import functools

import torch

from megadomino import kernels as quant

OPS = ("q8", "q4", "drq8", "drq4", "dq8", "dq4")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--groups", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--numel", type=int, default=1 << 27)
    args = parser.parse_args()
    x = torch.randn(args.numel, device="cuda", dtype=torch.float16)
    for group in args.groups:
        for op in args.ops:
            bits = int(op[-1])
            if op.startswith("q"):
                run = functools.partial(quant.quantize, x, bits, group)
            elif op.startswith("dq"):
                q, s = quant.quantize(x, bits, group)
                run = functools.partial(quant.dequantize, q, s, args.numel, bits, group)
            else:
                q, s = quant.swizzled_quantize(x, bits, group, 2, 4)
                run = functools.partial(quant.dequantize_reduce_quantize, q, s, 4, bits, bits,
                                        group, args.numel // 8)
            run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{op} g{group}")
            run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
