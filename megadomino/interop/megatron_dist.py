"""Megatron-LM's `torch_dist` checkpoints, read and written with torch.distributed.checkpoint.

An iteration directory of this format holds (megatron-core's dist_checkpointing):

    metadata.json   {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}
    .metadata       torch.distributed.checkpoint's index of every tensor (global shape, chunks)
    __R_W.distcp    the chunks rank R's writer W wrote
    common.pt       what is not a sharded tensor: `iteration`, `args`, `checkpoint_version`

Tensors are global: unsharded, the vocabulary padded as the writing run padded it, and the
layers of a homogeneous block stacked along a new leading dim under `decoder.layers.<name>`
(global layer numbers, so pipeline stages are already merged). `DistReader.read` reads one
layer's slice of a stacked key at a time, so a rank holds at most one full (unsharded) layer
tensor beside the model.

Writing (`save_megatron_dist`, or `write_megatron_dist` into one of our checkpoint directories)
gathers each parameter over TP, and TP rank 0 at DP rank 0 of every pipeline stage writes its
stage's part of the layout megatron-core writes for a GPTModel (at PP 1, global rank 0 writes it
all): its layers' rows of each stacked key at their global offsets, and the whole tensors it
holds (the tied embedding once, from the first stage), through one torch.distributed.checkpoint
save over those writers, whose index (`.metadata`) then covers every tensor whole. The layout:
the Transformer Engine names, layers stacked, the vocabulary padded for the run's TP
degree (megatron-core loads it at a TP degree that pads the vocabulary alike), an empty extra
state per layer and linear (megatron-core's load asks for them), and `common.pt` with
`iteration`, `checkpoint_version` 3.0 and `args` (the architecture and counters in Megatron-LM's
argument names). No optimizer or RNG state is written: Megatron-LM resumes it with
--no-load-optim --no-load-rng (or --finetune).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megadomino.config import ModelConfig
from megadomino.distributed import comm
from megadomino.interop.megatron import (
    DIST_METADATA,
    LAYER_PREFIX,
    MegatronCheckpointError,
    load_pickle,
    megatron_names,
    split_layer,
)
from megadomino.models.gpt import gather_full

if TYPE_CHECKING:
    from megadomino.interop.megatron_dcp import Stacked

COMMON = "common.pt"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "self_attention.core_attention", "mlp.linear_fc1", "mlp.linear_fc2")
"""Per-layer modules whose (Transformer Engine FP8) extra state megatron-core's load asks for,
local and Transformer Engine specs together (a key the loading model lacks is not read)."""
DIST_BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


def _dcp():
    """The torch.distributed.checkpoint side (interop/megatron_dcp.py), imported at its first
    use: importing torch.distributed.checkpoint costs about 0.6 s, which every process that
    imports the training loop would otherwise pay."""
    from megadomino.interop import megatron_dcp
    return megatron_dcp


class DistReader:
    """The tensors of one torch_dist iteration directory, read whole, one key at a time."""

    def __init__(self, iteration_dir: Path):
        self.directory = iteration_dir
        try:
            self.tensors = _dcp().tensor_metadata(iteration_dir)
        except Exception as err:
            raise MegatronCheckpointError(f"{iteration_dir}/.metadata is unreadable: "
                                          f"{err}") from None
        common_path = iteration_dir / COMMON
        self.common = load_pickle(common_path, mmap=False) if common_path.exists() else {}

    def locate(self, ours: str) -> tuple[str, int | None] | None:
        """(key, layer) of our parameter `ours`: layer is its index along a stacked key's
        leading dim, None when the key holds it alone; None when the checkpoint lacks it."""
        for name in megatron_names(ours):
            base, layer = split_layer(name)
            if layer is not None and base in self.tensors:
                return base, layer
            if name in self.tensors:
                return name, None
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The tensor `key` (or its `layer`-th slice along the stacked leading dim), in its
        saved dtype. Only those bytes are read. Not collective: each rank reads alone."""
        meta = self.tensors[key]
        sizes, offsets = list(meta.size), [0] * len(meta.size)
        if layer is not None:
            sizes[0], offsets[0] = 1, layer
        block = torch.empty(sizes, dtype=meta.properties.dtype)
        _dcp().read_block(self.directory, key, offsets, block)
        return block if layer is None else block[0]


def megatron_args(config: ModelConfig, tp: int, iteration: int, consumed_train_samples: int,
                  consumed_valid_samples: int, pp: int = 1) -> argparse.Namespace:
    """The `args` Megatron-LM reads back from a checkpoint (check_checkpoint_args, the consumed
    samples), in its argument names."""
    return argparse.Namespace(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size, num_attention_heads=config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
        seq_length=config.seq_length, max_position_embeddings=config.max_position_embeddings,
        position_embedding_type=config.position_embedding_type,
        add_position_embedding=config.position_embedding_type == "learned_absolute",
        rotary_base=config.rotary_base, normalization=config.normalization,
        norm_epsilon=config.norm_epsilon, swiglu=config.swiglu,
        add_bias_linear=config.add_bias_linear,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        vocab_size=config.vocab_size, padded_vocab_size=config.padded_vocab_size(tp),
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        data_parallel_random_init=False, ckpt_format="torch_dist", iteration=iteration,
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=consumed_valid_samples)


def save_megatron_dist(model: torch.nn.Module, directory: str | os.PathLike, iteration: int,
                       dims, *, consumed_train_samples: int = 0,
                       consumed_valid_samples: int = 0) -> Path:
    """Write `model` as Megatron-LM's torch_dist checkpoint DIR/iter_NNNNNNN and make it DIR's
    latest; returns the iteration directory. Collective over the world (see write_megatron_dist):
    it is written into a temporary directory renamed into place before the iteration file names
    it, so a crash leaves the previous checkpoint the latest."""
    target = Path(directory) / f"iter_{iteration:07d}"
    partial = target.with_name(target.name + ".tmp")
    if dims.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    write_megatron_dist(model, partial, iteration, dims,
                        consumed_train_samples=consumed_train_samples,
                        consumed_valid_samples=consumed_valid_samples)
    error = None
    if dims.rank == 0:
        try:
            if target.exists():
                shutil.rmtree(target)
            os.replace(partial, target)
            (target.parent / (TRACKER + ".tmp")).write_text(str(iteration))
            os.replace(target.parent / (TRACKER + ".tmp"), target.parent / TRACKER)
        except OSError as err:
            error = f"could not replace {target} or its {TRACKER}: {err!r}"
    _agree(error)
    return target


def write_megatron_dist(model: torch.nn.Module, target: Path, iteration: int, dims, *,
                        consumed_train_samples: int = 0, consumed_valid_samples: int = 0) -> None:
    """Write the torch_dist files of `model` (`.metadata`, `__R_0.distcp`, `common.pt`,
    `metadata.json`) into the directory `target` (made if missing; other files in it are left
    alone). `model`: a whole model, or at PP > 1 this rank's stage (its `checkpoint_parameters`
    name them as the whole model does). Collective over the world: the TP group at DP rank 0 of
    each stage gathers each parameter, its TP rank 0 writes (module docstring), and every rank
    raises the same OSError when any writer could not. The parameters must be whole (ZeRO
    stage 3 gathers them first)."""
    # PP 1: rank 0 writes alone; PP > 1: every stage's writer, over the world's backend (the
    # tensors are on the CPU, torch.distributed.checkpoint's planning goes through objects)
    writers = dims.stage_writers_group() if dims.pp > 1 else None
    error = None
    if dims.dp_rank == 0:
        tensors, stacked = _megatron_tensors(model, dims)
        if dims.tp_rank == 0:
            common = None
            if dims.rank == 0:
                args = megatron_args(model.config, dims.tp, iteration, consumed_train_samples,
                                     consumed_valid_samples, dims.pp)
                common = {"iteration": iteration, "checkpoint_version": CHECKPOINT_VERSION,
                          "args": args}
            error = _write(tensors, stacked, model.config.num_layers, common, target, writers)
    _agree(error)


def _agree(error: str | None) -> None:
    """Raise, in every rank, the first rank's error (also the barrier)."""
    if dist.is_initialized():
        error = next((e for e in comm.all_gather_object(error) if e is not None), None)
    if error is not None:
        raise OSError(f"torch_dist checkpoint: a writer {error}")


def _megatron_tensors(model: torch.nn.Module,
                      dims) -> tuple[dict[str, torch.Tensor | list], Stacked]:
    """Megatron-core's torch_dist entries of `model` (collective over TP): the full tensors
    held whole (the vocabulary padded to this TP degree; a pipeline's second copy of the tied
    embedding left out) and an empty extra state per held layer and linear; and the stacked
    keys' rows of the held layers, in runs of consecutive layers."""
    layers: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    tensors = {}
    for name, param in model.checkpoint_parameters():
        if getattr(param, "pipeline_duplicate", False):
            continue
        full = gather_full(param.detach(), param, dims).cpu()
        vocab = getattr(param, "vocab_size", None)
        if vocab is not None:  # (vocab, h) -> (padded vocab, h), zero rows as Megatron's
            full = torch.nn.functional.pad(full, (0, 0, 0, param.shape[0] * dims.tp - vocab))
        key, layer = split_layer(megatron_names(name)[0])
        if layer is None:
            tensors[key] = full
        else:
            layers[key][layer] = full
    stacked: Stacked = {key: _runs(rows) for key, rows in layers.items()}
    num_layers = model.config.num_layers
    held = sorted({layer for rows in layers.values() for layer in rows})
    for module in EXTRA_STATE_MODULES:  # (ShardedObject key)/shard_(layer)_(layers)
        for layer in held:
            # torch.distributed.checkpoint torch.saves it: the bytes megatron-core writes for
            # a ShardedObject (torch.save of the list of the objects' data) of no extra state
            tensors[f"{LAYER_PREFIX}{module}._extra_state/shard_{layer}_{num_layers}"] = [None]
    return tensors, stacked


def _runs(rows: dict[int, torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """The rows of consecutive layers stacked: [(first layer, tensor [count, ...])]."""
    runs: list[tuple[int, list[torch.Tensor]]] = []
    for layer in sorted(rows):
        if runs and runs[-1][0] + len(runs[-1][1]) == layer:
            runs[-1][1].append(rows[layer])
        else:
            runs.append((layer, [rows[layer]]))
    return [(first, torch.stack(parts)) for first, parts in runs]


def _write(tensors: dict[str, torch.Tensor | list], stacked: Stacked, num_layers: int,
           common: dict[str, Any] | None, target: Path, writers) -> str | None:
    """Write this writer's part into `target` (with `common`: common.pt and metadata.json
    too); the error as text, None when written. `writers`: the group of every writer, None
    when this rank writes alone."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        _dcp().save(tensors, stacked, num_layers, target, writers)
        if common is not None:
            torch.save(common, target / COMMON)
            (target / DIST_METADATA).write_text(json.dumps(DIST_BACKENDS))
    except Exception as err:  # every rank must hear of it (a writer's CheckpointException too)
        return f"could not write into {target}: {err!r}"
    return None
