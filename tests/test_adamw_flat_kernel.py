"""The flat AdamW kernel (kernels/adamw_flat.py, the engine's optimizer step on CUDA) against its
torch reference, step by step: sizes that leave a partial block, one to four groups with their
own rates and weight decay, clipping, a skipped step (nothing written), beta1 0, and the bf16
copy of the masters or none.

The kernel runs on CPU only under Triton's interpreter, chosen before triton is imported: the
cases run in one subprocess started with TRITON_INTERPRET=1 (`python
tests/test_adamw_flat_kernel.py` prints their results as JSON). Masters and moments are
compared to 1e-6 relative (1e-7 absolute); the bf16 copy within one bf16 step (the interpreter
truncates to bf16 where CUDA rounds to nearest). tests/gpu/test_gpu_adamw_flat.py runs the same
checks on CUDA, the bf16 copy exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from interpreted import interpreted_test, run_cases

from megadomino.kernels.adamw_flat import adamw_flat, adamw_flat_reference


def _state(n: int, groups: int, weights: bool, seed: int, device: str) -> list:
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    state = [master, torch.zeros(n), torch.zeros(n),
             torch.randint(0, groups, (n,), generator=gen).to(torch.uint8),
             master.to(torch.bfloat16) if weights else None]
    return [None if t is None else t.to(device) for t in state]


def check_adamw(device: str, force_triton: bool, n: int, groups: int, weights: bool,
                beta1: float, exact_weights: bool = False, block: int = 128) -> None:
    """Five steps, the third skipped, each with fresh gradients and a clipping coefficient."""
    ours, ref = _state(n, groups, weights, n, device), _state(n, groups, weights, n, device)
    lr = torch.tensor([1e-2, 3e-3, 5e-4, 2e-2][:groups], device=device)
    decay = torch.tensor([0.1, 0.0, 0.01, 0.05][:groups], device=device)
    step = torch.zeros((), device=device)
    gen = torch.Generator().manual_seed(7)
    for i in range(5):
        grad = torch.randn(n, generator=gen).to(device)
        skip = torch.tensor(1.0 if i == 2 else 0.0, device=device)
        coef = torch.tensor(0.5 + 0.1 * i, device=device)
        step += 1 - skip
        for kernel, (master, m, v, group, w), kwargs in (
                (adamw_flat, ours, {"force_triton": force_triton, "block": block}),
                (adamw_flat_reference, ref, {})):
            kernel(master, grad, m, v, group, lr, decay, beta1, 0.95, 1e-8, step, coef, skip, w,
                   **kwargs)
        for got, want, what in zip(ours[:3], ref[:3], ("master", "exp_avg", "exp_avg_sq")):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"step {i}: {what}")
        if weights:
            if exact_weights:
                assert torch.equal(ours[4], ours[0].to(torch.bfloat16)), f"step {i}: bf16 copy"
            else:
                torch.testing.assert_close(ours[4].float(), ref[4].float(), rtol=2 ** -7, atol=0)


def cases() -> dict[str, tuple]:
    return {f"n{n}-g{groups}-{'w' if weights else 'now'}-b1_{beta1}": (n, groups, weights, beta1)
            for n, groups, weights, beta1 in ((1000, 2, True, 0.9), (129, 1, False, 0.9),
                                              (4099, 4, True, 0.9), (77, 3, True, 0.0))}


CASES = cases()


test_adamw_flat_kernel_interpreted = interpreted_test(__file__, CASES)


def test_adamw_flat_runs_its_reference_on_cpu() -> None:
    check_adamw("cpu", False, 1000, 2, True, 0.9, exact_weights=True)


def test_adamw_flat_refuses_buffers_of_other_lengths() -> None:
    z = torch.zeros(8)
    with pytest.raises(ValueError, match="contiguous flat tensors of one length"):
        adamw_flat(z, torch.zeros(9), z.clone(), z.clone(), torch.zeros(8, dtype=torch.uint8),
                   torch.ones(1), torch.zeros(1), 0.9, 0.95, 1e-8, torch.ones(()),
                   torch.ones(()), torch.zeros(()), None, force_triton=True)


if __name__ == "__main__":
    print(json.dumps(run_cases(CASES, lambda *args: check_adamw("cpu", True, *args))))
