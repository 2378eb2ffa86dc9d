"""On the GPU machine: the compiled flat AdamW pass (megadomino/zero/sharded.py, the CUDA
default) equals the eager one the CPU tests check against torch's AdamW, at sizes that are not
multiples of anything (one compiled kernel for every size), with clipping, two groups, a skipped
step and the bf16 weights written; and on the same data torch's fused AdamW over the
per-parameter views. `python -m pytest tests/gpu/test_gpu_adamw_flat.py -q` runs it."""

from __future__ import annotations

import pytest
import torch

from megadomino.zero.sharded import _compiled_adamw_flat, adamw_flat

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("n", [1, 4097, 3_000_001])
def test_compiled_flat_adamw_equals_eager_and_torch(n):
    torch.manual_seed(n)
    device = torch.device("cuda")
    split = n // 3
    group = torch.zeros(n, dtype=torch.uint8, device=device)
    group[split:] = 1
    lr = torch.tensor([1e-3, 2e-3], device=device)
    weight_decay = torch.tensor([0.1, 0.0], device=device)
    start = torch.randn(n, device=device)
    runs = {}
    for name, kernel in (("eager", adamw_flat), ("compiled", _compiled_adamw_flat())):
        master, exp_avg, exp_avg_sq = start.clone(), torch.zeros(n, device=device), \
            torch.zeros(n, device=device)
        weights = torch.empty(n, dtype=torch.bfloat16, device=device)
        step = torch.zeros((), device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        for i in range(4):
            grad = torch.randn(n, device=device, generator=gen)
            skip = torch.tensor(1.0 if i == 1 else 0.0, device=device)
            step += 1 - skip
            kernel(master, grad, exp_avg, exp_avg_sq, group, lr, weight_decay, 0.9, 0.95, 1e-8,
                   step, torch.tensor(0.5, device=device), skip, weights)
        assert torch.equal(weights, master.to(torch.bfloat16))
        runs[name] = (master, exp_avg, exp_avg_sq)
    for eager, compiled in zip(runs["eager"], runs["compiled"]):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    pieces = [start[:split].clone(), start[split:].clone()]
    optimizer = torch.optim.AdamW([{"params": pieces[:1], "lr": 1e-3},
                                   {"params": pieces[1:], "lr": 2e-3, "weight_decay": 0.0}],
                                  weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    for i in range(4):
        grad = torch.randn(n, device=device, generator=gen)
        if i == 1:
            continue
        pieces[0].grad, pieces[1].grad = grad[:split] * 0.5, grad[split:] * 0.5
        optimizer.step()
    torch.testing.assert_close(runs["compiled"][0], torch.cat(pieces), rtol=1e-5, atol=1e-6)
