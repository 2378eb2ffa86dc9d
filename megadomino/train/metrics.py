"""Throughput accounting: Megatron-LM's model-FLOPs formula, TFLOP/s per GPU, MFU, peak memory.

The FLOPs count follows Megatron-LM's `num_floating_point_operations` for a dense transformer
(`megatron/training/training.py`): every GEMM is counted three times (forward, weight-gradient,
data-gradient) at 2 FLOPs per multiply-add; per layer and token

    attention   6 * (h * (q + 2 * kv) + q * h)       QKV and output projections (GQA-aware)
              + 6 * q * s / 2 * 2                    QK^T and PV under a causal mask (half)
    MLP         6 * h * ffn * (3 if SwiGLU else 2)   SwiGLU stacks three GEMMs, GELU two
    logits      6 * h * V_padded                     once per token, not per layer

with q = kv_channels * heads and kv = kv_channels * query_groups. Recomputation is not counted:
these are model FLOPs, so MFU does not reward recomputing.
"""

from __future__ import annotations

import resource
import sys

import torch

from megadomino.config import ModelConfig

_FWD_BWD = 3
_FMA = 2


def num_floating_point_operations(config: ModelConfig, batch_size: int,
                                  padded_vocab_size: int) -> float:
    """Model FLOPs of one training iteration over `batch_size` sequences of config.seq_length."""
    h, s = config.hidden_size, config.seq_length
    query_size = config.kv_channels * config.num_attention_heads
    kv_size = config.kv_channels * config.num_query_groups
    attention = (h * (query_size + 2 * kv_size)  # QKV projection
                 + query_size * s / 2 * 2  # causal QK^T and PV
                 + query_size * h)  # output projection
    mlp = h * config.ffn_hidden_size * (3 if config.swiglu else 2)
    logits = h * padded_vocab_size
    per_token = _FWD_BWD * _FMA * (config.num_layers * (attention + mlp) + logits)
    return float(batch_size * s * per_token)


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
