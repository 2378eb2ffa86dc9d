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
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

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

COMMON = "common.pt"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "self_attention.core_attention", "mlp.linear_fc1", "mlp.linear_fc2")
"""Per-layer modules whose (Transformer Engine FP8) extra state megatron-core's load asks for,
local and Transformer Engine specs together (a key the loading model lacks is not read)."""
DIST_BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


class DistReader:
    """The tensors of one torch_dist iteration directory, read whole, one key at a time."""

    def __init__(self, iteration_dir: Path):
        self.directory = iteration_dir
        try:
            metadata = FileSystemReader(str(iteration_dir)).read_metadata()
        except Exception as err:
            raise MegatronCheckpointError(f"{iteration_dir}/.metadata is unreadable: "
                                          f"{err}") from None
        self.tensors = {key: meta for key, meta in metadata.state_dict_metadata.items()
                        if isinstance(meta, TensorStorageMetadata)}
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
        state = {key: torch.empty(sizes, dtype=meta.properties.dtype)}
        with warnings.catch_warnings():  # no_dist is meant: each rank reads what it needs
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=FileSystemReader(str(self.directory)),
                     planner=_BlockLoadPlanner({key: offsets}), no_dist=True)
        return state[key] if layer is None else state[key][0]


class _BlockLoadPlanner(DefaultLoadPlanner):
    """Reads into each destination tensor the block of the saved tensor that starts at
    `offsets[key]` and has the destination's shape (DefaultLoadPlanner reads whole tensors)."""

    def __init__(self, offsets: dict[str, list[int]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, tensor in self.state_dict.items():
            block = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]),
                                         sizes=tensor.shape)
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key],
                                                      [block])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        # the destination is the block itself; the read item's offsets are relative to it
        return self.state_dict[index.fqn]


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


Stacked = dict[str, list[tuple[int, torch.Tensor]]]
"""A stacked key's rows this rank holds: (first global layer, the rows of consecutive layers)."""


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


class _StagePlanner(DefaultSavePlanner):
    """Saves every whole entry as the default planner does (unflattened), and each stacked
    key as the runs of rows this rank holds, chunks of the global tensor [num_layers, ...] at
    their layer offsets; the coordinator's global plan checks the chunks of all the writers
    tile each tensor."""

    def __init__(self, stacked: Stacked, num_layers: int):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.stacked, self.num_layers = stacked, num_layers

    def create_local_plan(self) -> SavePlan:
        items = [self._whole(key, value) for key, value in self.state_dict.items()]
        for key, runs in self.stacked.items():
            for first, rows in runs:
                offsets = torch.Size((first,) + (0,) * (rows.dim() - 1))
                items.append(WriteItem(
                    index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=rows.shape),
                        properties=TensorProperties.create_from_tensor(rows),
                        size=torch.Size((self.num_layers,) + tuple(rows.shape[1:])))))
        self.plan = SavePlan(items)
        return self.plan

    @staticmethod
    def _whole(key: str, value: Any) -> WriteItem:
        if not isinstance(value, torch.Tensor):
            return WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
        zeros = torch.Size((0,) * value.dim())
        return WriteItem(index=MetadataIndex(key, zeros), type=WriteItemType.TENSOR,
                         tensor_data=TensorWriteData(
                             chunk=ChunkStorageMetadata(offsets=zeros, sizes=value.shape),
                             properties=TensorProperties.create_from_tensor(value),
                             size=value.shape))

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.stacked:
            return next(rows for first, rows in self.stacked[index.fqn]
                        if first == index.offset[0])
        return super().lookup_object(index)


def _write(tensors: dict[str, torch.Tensor | list], stacked: Stacked, num_layers: int,
           common: dict[str, Any] | None, target: Path, writers) -> str | None:
    """Write this writer's part into `target` (with `common`: common.pt and metadata.json
    too); the error as text, None when written. `writers`: the group of every writer, None
    when this rank writes alone."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # no_dist is meant when rank 0 writes alone
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, checkpoint_id=str(target), no_dist=writers is None,
                     process_group=writers, planner=_StagePlanner(stacked, num_layers))
        if common is not None:
            torch.save(common, target / COMMON)
            (target / DIST_METADATA).write_text(json.dumps(DIST_BACKENDS))
    except Exception as err:  # every rank must hear of it (a writer's CheckpointException too)
        return f"could not write into {target}: {err!r}"
    return None
