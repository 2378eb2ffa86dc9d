"""The torch.distributed.checkpoint side of Megatron-LM's `torch_dist` checkpoints
(interop/megatron_dist.py, which imports this module at its first read or write): the index's
tensor entries, one block of a saved tensor read into a tensor of its shape, and a save whose
stacked keys are written as the row runs each writer holds.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
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

Stacked = dict[str, list[tuple[int, torch.Tensor]]]
"""A stacked key's rows this rank holds: (first global layer, the rows of consecutive layers)."""


def tensor_metadata(iteration_dir: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor entry of the directory's index (`.metadata`), by key."""
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    return {key: meta for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}


def read_block(directory: Path, key: str, offsets: list[int], block: torch.Tensor) -> None:
    """Read into `block` the block of saved tensor `key` that starts at `offsets` and has
    `block`'s shape. Not collective: each rank reads alone."""
    with warnings.catch_warnings():  # no_dist is meant: each rank reads what it needs
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: block}, storage_reader=FileSystemReader(str(directory)),
                 planner=_BlockLoadPlanner({key: offsets}), no_dist=True)


def save(tensors: dict[str, torch.Tensor | list], stacked: Stacked, num_layers: int,
         target: Path, writers) -> None:
    """One torch.distributed.checkpoint save of `tensors` (whole) and `stacked` (each key a
    global [num_layers, ...] tensor, of which this writer holds its runs) into `target`;
    `writers`: the group of every writer, None when this rank writes alone."""
    with warnings.catch_warnings():  # no_dist is meant when rank 0 writes alone
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, checkpoint_id=str(target), no_dist=writers is None,
                 process_group=writers, planner=_StagePlanner(stacked, num_layers))


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
