"""On the GPU machine: checkpoints written from GPUs with NCCL and resumed at another TP and PP,
and Megatron-LM's torch_dist checkpoints at TP 2 / PP 2, against the same references as their
CPU twins; one world of 4 ranks (the gpu tier, `python -m pytest tests --tier gpu -q`; the
heterogeneous plan's checkpoints run in test_gpu_pipeline.py's world of 3).

- tests/test_checkpoint.py: 20 steps at TP2 x DP2 (dropout on) equal 10 saved + 10 resumed,
  bit for bit (the CUDA generators of every TP rank restored); without the RNG states they
  differ.
- tests/test_pipeline_checkpoint.py: the same exact resume at PP2 x TP2; saved at PP2 x TP2 and
  resumed at PP4 (another TP and PP at once) and at TP2 x DP2 (another PP), each within 1e-4 of
  the straight run's losses; the PP4 resume in bf16 tracks the straight fp32 run (each step
  within 2%).
- tests/test_megatron_checkpoint.py (needs megatron-core): megatron-core writes a GPT at TP2
  (torch_dist) that --load reads at TP1 and TP2 with megatron-core's logits; a training run
  resumes it and writes torch_dist files megatron-core loads with the weights our own files
  hold. Without megatron-core: Megatron-LM's legacy TP2 x PP2 fixture loads into PP2 stages
  with the whole model's values.
- tests/test_pipeline_interop.py (needs megatron-core): Llama at PP2 x TP2 written as torch_dist
  by its stages loads in megatron-core at TP2 with the logits of the model without PP, into us
  at PP1 and at another split of PP2.

The twins' cases run unchanged; the setup swaps their CPU-bound helpers in each rank (see
tests/gpu/gpu_twins.py): whole models and stages built on an explicit "cpu" are built on the
rank's GPU, token batches drawn from a CPU generator are moved there, the 1e-5 bounds (`REL`)
become 1e-4. megatron_reference.py runs megatron-core on a CPU-only torch, patching away its
CUDA calls (`cpu_only`); here those calls are left alone (a no-op context), megatron-core's
model is drawn on the CPU as there (the same weights) and moved to the GPU, and its logits take
positions on the tokens' device. The cases that resume bit for bit run under deterministic
kernels.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import pytest
import test_checkpoint as checkpoint
import test_megatron_checkpoint as megatron_checkpoint
import test_pipeline_checkpoint as pipeline_checkpoint
import test_pipeline_interop as interop
import torch
from gpu_twins import (
    FP32_REL,
    adopt,
    assert_bf16_tracks,
    built_on,
    deterministic,
    drawn_then_moved,
    patch,
    rank_device,
)

from dist_utils import C, DistSuite
from megadomino.build import build_stage
from megadomino.distributed import ParallelDims
from megadomino.models.gpt import GPTModel

LOOP = 120.0  # budget (s) of a case: a few short runs of the training loop
# What the megatron-core cases require: the top-level package, because DistSuite checks it with
# importlib.util.find_spec, which raises (not returns None) for "megatron.core" without it.
MEGATRON = "megatron"


def _megatron_logits(model: torch.nn.Module, tokens: torch.Tensor,
                     vocab_size: int) -> torch.Tensor:
    """megatron_reference.megatron_logits with the positions on the tokens' device."""
    b, s = tokens.shape
    positions = torch.arange(s, device=tokens.device).expand(b, s)  # (b, s)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    return logits[..., :vocab_size]


def _megatron_on(device: torch.device) -> None:
    """megatron_reference's helpers for a GPU (see the module docstring)."""
    import megatron_reference

    build = megatron_reference.build_megatron_gpt

    @functools.wraps(build)
    def build_on_device(*args, **kwargs) -> torch.nn.Module:
        return build(*args, **kwargs).to(device)

    patch(megatron_reference, cpu_only=contextlib.nullcontext,
          build_megatron_gpt=build_on_device, megatron_logits=_megatron_logits)


def _twins_on(device: torch.device) -> None:
    tokens_of = drawn_then_moved(megatron_checkpoint.tokens_of, device)
    for twin in (megatron_checkpoint, interop):
        patch(twin, GPTModel=built_on(GPTModel, device), build_stage=built_on(build_stage, device),
              tokens_of=tokens_of, REL=FP32_REL)
    patch(pipeline_checkpoint, REL=FP32_REL)
    if device.type == "cuda" and importlib.util.find_spec(MEGATRON) is not None:
        _megatron_on(device)


SUITE = DistSuite(worlds=(4,), backend="nccl", timeout=120.0)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    """The names the adopted cases use (renamed in `adopt` where twins differ)."""
    _twins_on(rank_device())
    dp4, tp2 = ParallelDims(tp=1), ParallelDims(tp=2)
    return {"root": root, "dp4": dp4, "tp2": tp2, "tp2dp2": tp2, "dims": {1: dp4, 2: tp2},
            "pp2tp2": ParallelDims(tp=2, pp=2), "pp2dp2": ParallelDims(pp=2),
            "pp4": ParallelDims(pp=4)}


def track_bf16_across(saver: ParallelDims, loader: ParallelDims, root: str, name: str) -> None:
    """test_pipeline_checkpoint.check_across in bf16: saved halfway at `saver`'s layout,
    resumed at `loader`'s; every step's loss tracks the straight fp32 run at `saver`."""
    directory = f"{root}/{name}"
    fp32 = pipeline_checkpoint._train(saver)
    first = pipeline_checkpoint._train(saver, bf16=True, save=directory,
                                       exit_interval=pipeline_checkpoint.HALF)
    resumed = pipeline_checkpoint._train(loader, bf16=True, load=directory)
    assert len(resumed["losses"]) == pipeline_checkpoint.ITERS - pipeline_checkpoint.HALF
    bf16 = {"losses": first["losses"] + resumed["losses"], "model": resumed["model"]}
    assert_bf16_tracks(bf16, fp32, name)


adopt(SUITE, checkpoint.SUITE, "resume_tp2", 4, prefix="ckpt", timeout=LOOP, wrap=deterministic)
SUITE.case("pp-ckpt-resume-pp2tp2", deterministic, pipeline_checkpoint.check_resume, C.pp2tp2,
           C.root, timeout=LOOP)
for _name in ("pp2tp2-to-pp4", "pp2tp2-to-tp2dp2"):
    adopt(SUITE, pipeline_checkpoint.SUITE, _name, 4, prefix="pp-ckpt", timeout=LOOP)
SUITE.case("pp-ckpt-bf16-pp2tp2-to-pp4", track_bf16_across, C.pp2tp2, C.pp4, C.root,
           "bf16-pp2tp2-to-pp4", timeout=LOOP)

# megatron-core writes at TP2, --load reads it at TP1 and TP2; the run resuming it (needs it).
adopt(SUITE, megatron_checkpoint.SUITE, "megatron-writes-gpt-tp2", 4, prefix=None,
      timeout=LOOP, requires=MEGATRON)
adopt(SUITE, megatron_checkpoint.SUITE, "resume", 4, prefix="megatron", timeout=LOOP,
      requires=MEGATRON)
adopt(SUITE, megatron_checkpoint.FIXTURES, "legacy-llama_tp2_pp2-at-pp2", 4, prefix="megatron",
      timeout=LOOP, refs={"pp2": "pp2dp2", "tp1": "dp4"})
adopt(SUITE, interop.SUITE, "torch-dist-llama", 4, prefix="interop", timeout=LOOP,
      refs={"pp2": "pp2tp2", "whole": "tp2"}, requires=MEGATRON)


@pytest.fixture(scope="module")
def gpu_checkpoint_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("gpu-checkpoints")),)


test_gpu_checkpoint = SUITE.test(args_fixture="gpu_checkpoint_root")
