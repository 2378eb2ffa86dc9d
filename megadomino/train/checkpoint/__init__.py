"""Checkpoints in Megatron-LM's layout: `shards` saves and loads each rank's shards (the layout,
resume, loading at another TP degree), `files` writes them atomically and verifies them against
the manifest, `rng` captures and restores every random generator of a rank, `async_save` writes
them from a background thread (--async-save), `diloco` adds DiLoCo's outer state and each site's
own inner state, `pipeline_codec` the pipeline boundary codecs' state of every rank."""

from megadomino.train.checkpoint.async_save import AsyncCheckpointer
from megadomino.train.checkpoint.files import TRACKER, CheckpointError, Manifest
from megadomino.train.checkpoint.pipeline_codec import CodecState, load_codec_state
from megadomino.train.checkpoint.shards import (
    SHARD,
    TrainingState,
    checkpoint_dir,
    latest_iteration,
    load_checkpoint,
    load_optimizer_state,
    promote_checkpoint,
    save_checkpoint,
    shard_path,
)

__all__ = [
    "SHARD",
    "AsyncCheckpointer",
    "CodecState",
    "TRACKER",
    "CheckpointError",
    "Manifest",
    "TrainingState",
    "checkpoint_dir",
    "latest_iteration",
    "load_checkpoint",
    "load_codec_state",
    "load_optimizer_state",
    "promote_checkpoint",
    "save_checkpoint",
    "shard_path",
]
