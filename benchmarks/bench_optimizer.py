"""The optimizer step of a one-GPU step, alone: what each of its passes over the parameters costs,
and how close a fused pass gets to the HBM rate.

    python3 benchmarks/bench_optimizer.py --preset gpt3-1.3b --out optimizer.json

Parameters of the preset's shapes (bf16 model weights, fp32 masters, gradients and AdamW
moments, flat per layer as the ZeRO engine keeps them, each parameter a view). Variants, median
ms of CUDA events:
- `torch_fused`: the engine's step on CPU and before the flat pass: the gradients' global norm
  (torch.nn.utils.get_total_norm), torch's fused AdamW over the per-parameter views with
  clipping as its `grad_scale`, the fp32 masters copied into the bf16 weights, the gradients
  zeroed for the next step;
- `norm`, `adamw`, `copy`, `zero`: each of those passes alone;
- `flat`: the engine's step on CUDA (megadomino/zero/sharded.py): the norm, then the Triton
  `adamw_flat` per flat buffer (kernels/adamw_flat.py: AdamW, each element's group by a uint8
  index, the bf16 copy in the same pass), then the zeroing; `flat_compiled`: the same with
  torch.compile's kernel of the pass's torch reference instead.
`--sweep` also times the Triton pass alone over the block sizes and warps it could use
(`adamw_<block>_<warps>`, ms and TB/s), the measurement behind the kernel's defaults.
`bytes_gb` and `tb_per_s`: the bytes each pass must move (reads + writes) and the rate it reached;
for the two whole steps also one profiled call's top kernels and GPU idle time inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import median_ms, profile_summary  # noqa: E402

from megadomino.config import ModelConfig  # noqa: E402
from megadomino.kernels.adamw_flat import adamw_flat, adamw_flat_reference  # noqa: E402


def layer_shapes(config: ModelConfig) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, decayed) of one GPT layer's parameters."""
    h, f = config.hidden_size, config.ffn_hidden_size
    return [((h,), False), ((h,), False), ((3 * h, h), True), ((3 * h,), False), ((h, h), True),
            ((h,), False), ((h,), False), ((h,), False), ((f, h), True), ((f,), False),
            ((h, f), True), ((h,), False)]


class Flat:
    """One unit: flat fp32 master / grad / moments, a bf16 copy and the per-parameter views."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], bool]]):
        numel = sum(torch.Size(shape).numel() for shape, _ in shapes)
        self.master = torch.randn(numel, device="cuda") * 0.02
        self.grad = torch.randn(numel, device="cuda") * 1e-3
        self.exp_avg = torch.zeros(numel, device="cuda")
        self.exp_avg_sq = torch.zeros(numel, device="cuda")
        self.weights = self.master.to(torch.bfloat16)
        self.group = torch.zeros(numel, device="cuda", dtype=torch.uint8)
        self.views, offset = [], 0
        for shape, decayed in shapes:
            n = torch.Size(shape).numel()
            self.group[offset:offset + n] = 0 if decayed else 1
            self.views.append((self.master[offset:offset + n], self.grad[offset:offset + n],
                               decayed))
            offset += n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt3-1.3b")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--out", default="optimizer.json")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    config = ModelConfig.preset(args.preset)
    layers = args.num_layers or config.num_layers
    vocab = -(-config.vocab_size // 128) * 128
    units = [Flat([((vocab, config.hidden_size), True), ((config.seq_length, config.hidden_size),
                                                         True)])]
    units += [Flat(layer_shapes(config)) for _ in range(layers)]
    units.append(Flat([((config.hidden_size,), False), ((config.hidden_size,), False)]))
    numel = sum(unit.master.numel() for unit in units)
    groups = [{"params": [], "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}]
    for unit in units:
        for master, grad, decayed in unit.views:
            master.grad = grad
            groups[0 if decayed else 1]["params"].append(master)
    optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    grads = [grad for unit in units for _, grad, _ in unit.views]
    scale = torch.ones(1, device="cuda")
    lr, beta1, beta2, eps, wd = 1e-4, 0.9, 0.95, 1e-8, 0.1

    def norm():
        return torch.nn.utils.get_total_norm(grads)

    def adamw():
        optimizer.grad_scale = scale
        optimizer.step()

    def copy():
        for unit in units:
            unit.weights.copy_(unit.master)

    def zero():
        for unit in units:
            unit.grad.zero_()

    def torch_fused():
        norm()
        adamw()
        copy()
        zero()

    compiled = torch.compile(adamw_flat_reference, dynamic=True)
    step = torch.tensor(1.0, device="cuda")
    rates = torch.tensor([lr, lr], device="cuda")
    decays = torch.tensor([wd, 0.0], device="cuda")
    no_skip = torch.zeros((), device="cuda")

    def flat_pass(kernel, **options):
        coef = torch.clamp(1.0 / (norm() + 1e-6), max=1.0)
        for unit in units:
            kernel(unit.master, unit.grad, unit.exp_avg, unit.exp_avg_sq, unit.group, rates,
                   decays, beta1, beta2, eps, step, coef, no_skip, unit.weights, **options)
        zero()

    def adamw_alone(block, warps):
        for unit in units:
            adamw_flat(unit.master, unit.grad, unit.exp_avg, unit.exp_avg_sq, unit.group, rates,
                       decays, beta1, beta2, eps, step, scale, no_skip, unit.weights,
                       block=block, num_warps=warps)

    # bytes an element: reads + writes (flat: norm 4, the pass 16 + 1 read and 12 + 2 written)
    moved = {"norm": 4, "adamw": 28, "copy": 6, "zero": 4, "torch_fused": 42, "flat": 39,
             "flat_compiled": 39}
    variants = [("norm", norm), ("adamw", adamw), ("copy", copy), ("zero", zero),
                ("torch_fused", torch_fused), ("flat", lambda: flat_pass(adamw_flat)),
                ("flat_compiled", lambda: flat_pass(compiled))]
    if args.sweep:
        for block in (512, 1024, 2048, 4096):
            for warps in (4, 8, 16):
                moved[f"adamw_{block}_{warps}"] = 31
                variants.append((f"adamw_{block}_{warps}",
                                 lambda b=block, w=warps: adamw_alone(b, w)))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "preset": args.preset, "layers": layers, "parameters": numel, "variants": {}}
    for name, fn in variants:
        ms = median_ms(fn, iters=10)
        gb = moved[name] * numel / 1e9
        result["variants"][name] = {"ms": round(ms, 3), "bytes_gb": round(gb, 2),
                                    "tb_per_s": round(gb / ms, 2)}
        if name in ("torch_fused", "flat", "flat_compiled"):  # one call's kernels, GPU idle
            summary = profile_summary(fn, top=6)
            result["variants"][name].update(
                gpu_idle_ms=round(summary["gpu_idle_ms"], 3), kernels=summary["top_kernels"])
        print(name, result["variants"][name], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
