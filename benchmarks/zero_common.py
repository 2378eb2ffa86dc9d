"""What the ZeRO benchmarks share: the configurations compared, the model, one training step.

Imported by zero_bytes.py, bench_zero_netns.py and bench_zero.py (run from the repository root as
`python benchmarks/<script>.py`, which puts this directory on sys.path).
"""

from __future__ import annotations

import argparse
import functools

import torch

from megadomino.build import build_model
from megadomino.config import FP8Recipe, ModelConfig
from megadomino.data import MockDataset
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.zero import ZeroConfig, ZeroPlusPlus

# ZeRO-3 sends bf16 gradients like the paper's fp16 baseline (DeepSpeed reduces in the
# parameters' dtype); the ZeRO++ rows add qwZ, hpZ and qgZ one at a time.
CONFIGS: dict[str, dict] = {
    "plain dp": dict(stage=0),
    "zero3": dict(reduce_dtype="bfloat16"),
    "qwz": dict(reduce_dtype="bfloat16", quantized_weights=True),
    "qwz+hpz": dict(reduce_dtype="bfloat16", quantized_weights=True, hpz_partition_size=-1),
    "zero++": dict(quantized_weights=True, hpz_partition_size=-1, quantized_gradients=True),
    "zero++ int8 grads": dict(quantized_weights=True, hpz_partition_size=-1,
                              quantized_gradients=True, gradient_bits=8),
}
# Not run by default: the gradient reductions one deep (ZeroConfig.reduce_pipeline_depth=1),
# to compare with the default two-deep pipeline in the same run.
DEPTH1 = {f"{name} depth1": dict(CONFIGS[name], reduce_pipeline_depth=1)
          for name in ("zero3", "qwz", "zero++")}
CONFIGS.update(DEPTH1)
# The rows above size units by parameters (ZeroConfig.unit_params, the default: 4 layers a unit
# at GPT-3 1.3B, 1 from 6.7B up). Not run by default: K layers a unit (ZeroConfig.layers_per_unit,
# --zero-layers-per-unit); x1 is the engine's layout before units of unit_params (one layer each).
GROUPED = {f"{name} x{k}": dict(CONFIGS[name], layers_per_unit=k)
           for name in ("zero3", "qwz", "qwz+hpz", "zero++") for k in (1, 2, 4, 8)}
CONFIGS.update(GROUPED)
# Not run by default: ZeRO++ quantizing with DeepSpeed's levels (--zeropp-quantize-full-range).
FULL_RANGE = {"zero++ full range": dict(CONFIGS["zero++"], quantize_full_range=True)}
CONFIGS.update(FULL_RANGE)
# Not run by default: the model's linears in FP8 (hybrid; delayed scaling, "tw": tensorwise), at
# stages 3 and 1, without and with the FP8 weight gather (--fp8-param-gather); "fp8" (the
# recipe) is not a ZeroConfig field.
FP8 = {"zero3 fp8": dict(reduce_dtype="bfloat16", fp8="delayed"),
       "zero3 fp8 gather": dict(reduce_dtype="bfloat16", fp8="delayed", fp8_param_gather=True),
       "zero1 fp8": dict(stage=1, reduce_dtype="bfloat16", fp8="delayed"),
       "zero1 fp8 gather": dict(stage=1, reduce_dtype="bfloat16", fp8="delayed",
                                fp8_param_gather=True),
       "zero3 fp8 tw": dict(reduce_dtype="bfloat16", fp8="tensorwise"),
       "zero3 fp8 tw gather": dict(reduce_dtype="bfloat16", fp8="tensorwise",
                                   fp8_param_gather=True)}
CONFIGS.update(FP8)
NOT_DEFAULT = {**DEPTH1, **GROUPED, **FULL_RANGE, **FP8}
ADAM = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


def add_model_args(parser: argparse.ArgumentParser, preset: str, hidden: int | None,
                   layers: int | None, seq: int) -> None:
    """Model flags; hidden size, layers and heads default to `preset`'s where None."""
    parser.add_argument("--preset", default=preset)
    parser.add_argument("--hidden-size", type=int, default=hidden)
    parser.add_argument("--num-layers", type=int, default=layers)
    parser.add_argument("--num-attention-heads", type=int, default=8 if hidden else None)
    parser.add_argument("--seq-length", type=int, default=seq)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))


def model_config(args: argparse.Namespace) -> ModelConfig:
    overrides = {name: getattr(args, name) for name in
                 ("hidden_size", "num_layers", "num_attention_heads")
                 if getattr(args, name) is not None}
    return ModelConfig.preset(args.preset, seq_length=args.seq_length,
                              max_position_embeddings=args.seq_length, hidden_dropout=0.0,
                              attention_dropout=0.0, params_dtype=args.dtype, **overrides)


def build_engine(name: str, dims: ParallelDims, args: argparse.Namespace,
                 device: str | None = None) -> ZeroPlusPlus:
    """The engine as configuration `name` says: ZeRO stage 3 unless it names another stage
    ("plain dp" is stage 0); hpZ over the node's DP ranks."""
    fields = dict(CONFIGS[name], block_size=args.block_size)
    if fields.get("hpz_partition_size") == -1:
        fields["hpz_partition_size"] = dims.dp_per_node
    recipe = fields.pop("fp8", None)
    fp8 = FP8Recipe(recipe=recipe) if recipe else None
    model_parallel_seed(1234, dims)
    model = build_model(model_config(args), dims, "gpt", device=device, fp8=fp8)
    factory = functools.partial(torch.optim.AdamW, **ADAM)
    return ZeroPlusPlus(model, dims, factory, ZeroConfig(**{"stage": 3, **fields}),
                        clip_grad=1.0)


def train_step(engine, dims: ParallelDims, args: argparse.Namespace, step: int,
               device: str | torch.device = "cpu") -> float:
    """One step on this DP rank's micro-batch of the mock data; returns the local loss."""
    data = _data(args.seq_length)
    start = (step * dims.dp + dims.dp_rank) * args.micro_batch_size
    samples = torch.stack([data[i] for i in range(start, start + args.micro_batch_size)])
    samples = samples.to(device)
    loss = engine(samples[:, :-1], labels=samples[:, 1:]).mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


@functools.cache
def _data(seq_length: int) -> MockDataset:
    return MockDataset(seq_length, 512, seed=7)  # tokens < 512: within every preset's vocab

