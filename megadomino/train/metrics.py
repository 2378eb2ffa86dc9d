"""Throughput accounting: Megatron-LM's model-FLOPs formula, TFLOP/s per GPU, MFU, peak memory.

The FLOPs count follows Megatron-LM's `num_floating_point_operations` for a dense transformer
(`megatron/training/training.py`): every GEMM is counted three times (forward, weight-gradient,
data-gradient) at 2 FLOPs per multiply-add, over the multiply-adds per token of
config/flops.py (each layer's attention and MLP GEMMs, the causal core at half, and the logits
once per token, not per layer). Recomputation is not counted: these are model FLOPs, so MFU
does not reward recomputing.
"""

from __future__ import annotations

import resource
import sys

import torch

from megadomino.config import ModelConfig
from megadomino.config.flops import layer_macs, logits_macs

_FWD_BWD = 3
_FMA = 2


def num_floating_point_operations(config: ModelConfig, batch_size: int,
                                  padded_vocab_size: int) -> float:
    """Model FLOPs of one training iteration over `batch_size` sequences of config.seq_length."""
    per_token = _FWD_BWD * _FMA * (config.num_layers * layer_macs(config)
                                   + logits_macs(config, padded_vocab_size))
    return float(batch_size * config.seq_length * per_token)


PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                    ("H200", 989.0), ("A100", 312.0))
"""Dense bf16 tensor-core peak TFLOP/s per GPU (NVIDIA's data sheets), by a part of the CUDA
device name; the first match counts."""


def peak_tflops(device_name: str, given: float | None) -> float | None:
    """The per-GPU peak MFU is measured against: `given` (--peak-tflops), else the GPU's dense
    bf16 peak when PEAK_BF16_TFLOPS knows it; None (no MFU) otherwise, the CPU included."""
    if given is not None:
        return given
    return next((peak for part, peak in PEAK_BF16_TFLOPS if part in device_name), None)


def throughput(flops_per_iteration: float, tokens_per_iteration: int, seconds_per_iteration: float,
               world_size: int, peak_tflops: float | None) -> dict[str, float]:
    """TFLOP/s per GPU (Megatron: total model FLOPs / time / world size), global tokens/s, and
    MFU when the peak is known."""
    tflops_per_gpu = flops_per_iteration / (seconds_per_iteration * world_size) / 1e12
    metrics = {"tflops_per_gpu": tflops_per_gpu,
               "tokens_per_s": tokens_per_iteration / seconds_per_iteration}
    if peak_tflops is not None:
        metrics["mfu"] = tflops_per_gpu / peak_tflops
    return metrics


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank in GiB: the CUDA caching allocator's max allocated bytes on a GPU;
    on CPU the process's peak resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20
