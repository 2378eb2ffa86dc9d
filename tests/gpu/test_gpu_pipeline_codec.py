"""On the GPU machine: tests/test_pipeline_codec.py's gloo cases under NCCL, PP2 on 2 GPUs and
PP3 on 3 (int8 and int4 through the ZeRO++ Triton kernels, adatopk's top-k on the GPU): none
and adatopk at k = h bit for bit the pipeline without a codec, the masked function's gradient
against one process's masked model (1e-4 relative: TF32 off, the GPU's summation orders; a
top-k near a tie could pick another index in the reference, which would show as a gradient
error), bytes on the wire, the exact resume with error feedback, the adaptive decisions
(timed by polling NCCL's works). The setup builds the twin's models and stages on the rank's
GPU, moves its CPU-drawn batches there (gpu_twins.py) and turns on deterministic kernels for
the world: the bit-identical cases compare two runs of the same kernels.
`python -m pytest tests --tier gpu -q tests/gpu/test_gpu_pipeline_codec.py` runs it.
"""

from __future__ import annotations

import test_pipeline_codec as twin
import torch
from gpu_twins import FP32_REL, built_on, drawn_then_moved, patch, rank_device, under_default_device
from test_tp_equivalence import batch

from megadomino.build import build_model, build_stage


def _setup(world: int) -> dict:
    device = rank_device()
    patch(twin, build_stage=built_on(build_stage, device),
          build_model=built_on(build_model, device), batch=drawn_then_moved(batch, device),
          _masked_reference=under_default_device(twin._masked_reference, device), REL=FP32_REL)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return twin._setup(world)


SUITE = twin.SUITE.derived(backend="nccl", setup=_setup, worlds=None)
test_gpu_pipeline_codec = SUITE.test()
