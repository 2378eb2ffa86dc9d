"""Load a Megatron-LM checkpoint (`torch_dist` or legacy `torch`) into our model at any TP.

    counters = load_megatron(Path("ckpt/iter_0000100"), model, dims)   # not collective

Each rank rebuilds, one parameter at a time, the full (unsharded, unpadded) tensor from the
checkpoint and keeps its own shard (`shard_full`), so any saved TP degree loads at any of ours:
torch_dist holds full tensors already; a legacy checkpoint's TP shards are our shards at its
degree (megatron.py says why) and are joined as our `unshard_rows` joins ours. Pipeline stages
are merged: torch_dist numbers layers globally; a legacy stage's layers follow the previous
stages'. The vocabulary is cut to the model's vocab_size (each format pads it its own way).

Weights and counters only: the optimizer starts fresh and the RNG streams come from --seed
(Megatron-LM's optimizer states are indexed by its own parameter groups' order, or laid out
in its distributed optimizer's buffers: neither has a counterpart here). Every tensor of the
model must be in the checkpoint with its shape, and every model tensor of the checkpoint must be
used: otherwise MegatronCheckpointError naming the tensors and the flags that set their shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megadomino.interop.megatron import (
    LegacyCheckpoint,
    MegatronCheckpointError,
    megatron_format,
    megatron_names,
)
from megadomino.interop.megatron_dist import DistReader
from megadomino.models.gpt import full_shape, shard_full
from megadomino.tp.layers import unshard_rows

MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
"""Names of model tensors in a Megatron checkpoint (optimizer and RNG entries are others)."""
SHAPE_FLAGS = ("--num-layers, --hidden-size, --ffn-hidden-size, --num-attention-heads, "
               "--num-query-groups, --swiglu, --normalization, --disable-bias-linear, "
               "--untie-embeddings-and-output-weights, --position-embedding-type")


@dataclass(frozen=True)
class MegatronCounters:
    """What of a Megatron-LM checkpoint's training state we resume."""

    format: str
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    unused: frozenset[str] = frozenset()
    """With `part`: the checkpoint's model tensors this part did not take (other stages'
    among them)."""


def load_megatron(iteration_dir: Path, model: torch.nn.Module, dims,
                  part: bool = False) -> MegatronCounters:
    """Put the Megatron-LM checkpoint in `iteration_dir` into `model` (this rank's shards) and
    return its counters. Raises MegatronCheckpointError when the directory holds none, or its
    tensors do not fit the model. `part`: the model is one pipeline stage's part of it (its
    parameters under the whole model's names, `model.config` the whole model's): tensors it does
    not hold are returned in `unused`, for the caller to check that the stages together used
    every one."""
    kind = megatron_format(iteration_dir)
    if kind is None:
        raise MegatronCheckpointError(f"{iteration_dir} holds no Megatron-LM checkpoint")
    params = dict(model.checkpoint_parameters())  # a stage's too: the whole model's names
    if kind == "torch_dist":
        reader = DistReader(iteration_dir)
        used = _load_dist(reader, params, dims, model.config.num_layers)
        present, common = set(reader.tensors), reader.common
        args, iteration = common.get("args"), common.get("iteration", 0)
    else:
        legacy = LegacyCheckpoint.read(iteration_dir)
        used, present = _load_legacy(legacy, params, dims)
        args, iteration = legacy.args, legacy.iteration
    unused = sorted(name for name in present - used if name.startswith(MODEL_PREFIXES)
                    and not name.endswith("_extra_state") and not _tied_copy(name, params))
    if unused and not part:
        raise unused_error(iteration_dir, unused)
    return MegatronCounters(kind, int(iteration), _count(args, "consumed_train_samples"),
                            _count(args, "consumed_valid_samples"), frozenset(unused))


def unused_error(iteration_dir: Path, unused) -> MegatronCheckpointError:
    return MegatronCheckpointError(f"{iteration_dir}: tensors the model does not account for: "
                                   f"{sorted(unused)} (check {SHAPE_FLAGS})")


def _load_dist(reader: DistReader, params: dict[str, torch.Tensor], dims,
               layers: int) -> set[str]:
    """Copy each parameter's shard from the torch_dist checkpoint, reading only its layer of a
    stacked key (of `layers`, the whole model's); the keys used."""
    located = {}
    for name in params:
        found = reader.locate(name)
        if found is None:
            _missing(reader.directory, name)
        located[name] = found
    for key, layer in set(located.values()):
        if layer is not None and reader.shape(key)[0] != layers:
            raise MegatronCheckpointError(
                f"{reader.directory}: {key} holds {reader.shape(key)[0]} layers, the model has "
                f"{layers} (--num-layers)")
    with torch.no_grad():
        for name, (key, layer) in located.items():
            _copy_shard(params[name], reader.read(key, layer), name, reader.directory, dims)
    return {key for key, _ in located.values()}


def _load_legacy(legacy: LegacyCheckpoint, params: dict[str, torch.Tensor],
                 dims) -> tuple[set[str], set[str]]:
    """Copy each parameter's shard from a legacy checkpoint's TP shards; the (global) names
    used and present."""
    located = legacy.global_names()
    used = set()
    with torch.no_grad():
        for name, param in params.items():
            found = next((n for n in megatron_names(name) if n in located), None)
            if found is None:
                _missing(legacy.directory, name)
            stage, local = located[found]
            shards = legacy.shards(stage, local)
            if getattr(param, "tensor_model_parallel", False):
                full = unshard_rows(shards, param.tp_partition_dim, param.tp_stripes)
            else:
                full = shards[0]
            _copy_shard(param, full, name, legacy.directory, dims)
            used.add(found)
    return used, set(located)


def _copy_shard(param: torch.Tensor, full: torch.Tensor, name: str, source: Path, dims) -> None:
    """param <- this rank's shard of `full` (vocabulary padding rows past vocab_size cut)."""
    vocab = getattr(param, "vocab_size", None)
    if vocab is not None and full.shape[0] >= vocab:
        full = full[:vocab]
    expected = full_shape(param, dims)
    if tuple(full.shape) != expected:
        raise MegatronCheckpointError(
            f"{source}: {megatron_names(name)[0]} has shape {tuple(full.shape)}, the model's "
            f"{name} {expected} (check {SHAPE_FLAGS}, --vocab-size or the tokenizer)")
    param.copy_(shard_full(full.to(torch.float32), param, dims))


def _missing(source: Path, name: str) -> None:
    raise MegatronCheckpointError(
        f"{source}: no tensor for the model's {name} (looked for "
        f"{' or '.join(megatron_names(name))}; check {SHAPE_FLAGS})")


def _tied_copy(name: str, params: dict[str, torch.Tensor]) -> bool:
    """The last pipeline stage's copy of a tied embedding (output_layer.weight) is not a
    tensor of its own."""
    return name == "output_layer.weight" and "output_weight" not in params


def _count(args: Any, field: str) -> int:
    return int(getattr(args, field, 0) or 0)
