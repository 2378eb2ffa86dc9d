"""On the GPU machine: the ZeRO engine's cases of tests/test_zero.py (stage 1 / 3 vs plain DP,
qgZ and qwZ within their bounds, ZeRO++ vs ZeRO-3 over 100 steps, inf/NaN, bf16 bytes, the hpZ
resume) with NCCL on 4 GPUs as 2 nodes x 2 (and TP=2 x DP=2), fp32 with TF32 off. Skipped with
fewer than 4 GPUs; `python -m pytest tests --tier gpu -q` runs it.

test_zero.py writes its cases for CPU tensors; each rank here runs them unchanged with every
tensor they make on its GPU: the default device is the GPU, and in test_zero's namespace
`build_model` builds there, `_batch` moves its samples there and `torch.Generator()` is a CUDA
generator (random values differ from the CPU run's; the cases check bounds, not values).
"""

from __future__ import annotations

import types

import test_zero
import torch
from gpu_twins import built_on, patch

from megadomino.build import build_model


class _TorchWithDeviceGenerators(types.ModuleType):
    """torch, except that `Generator()` makes a generator on `device`."""

    def __init__(self, device: torch.device):
        super().__init__("torch")
        self._device = device

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def Generator(self, device: torch.device | str | None = None) -> torch.Generator:  # noqa: N802
        return torch.Generator(device if device is not None else self._device)


def _on_this_gpu(world: int) -> dict:
    """In each rank: test_zero's setup, with every tensor its cases make on this rank's GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_default_device(device)
    on_cpu = test_zero._batch

    def batch_on_device(*args, **kwargs) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in on_cpu(*args, **kwargs))

    patch(test_zero, build_model=built_on(build_model, device), _batch=batch_on_device,
          torch=_TorchWithDeviceGenerators(device))
    return test_zero._setup(world)


SUITE = test_zero.SUITE.derived(backend="nccl", setup=_on_this_gpu, worlds=(4,))
test_gpu_zero = SUITE.test()
