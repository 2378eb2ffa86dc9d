"""Checkpoints in Megatron-LM's layout: one shard per TP rank, written atomically, exact resume,
and loadable at another TP degree.

Layout of `--save DIR`:

    DIR/latest_checkpointed_iteration.txt                 "10", or "release"; written last
    DIR/iter_0000010/mp_rank_00/model_optim_rng.pt        TP rank 0 (mp_rank_00_001 when PP > 1)
    DIR/iter_0000010/mp_rank_01/model_optim_rng.pt        TP rank 1
    DIR/release/mp_rank_00/model_optim_rng.pt             weights only (converters), iteration 0

DP rank 0 of each TP rank writes that rank's shard: its model shard, its optimizer shard (AdamW
moments, step and the fp32 masters of bf16/fp16 parameters, keyed by parameter name), the loss
scaler, the training counters, the ModelConfig, the sharding of every parameter and the RNG states
of every DP rank of its TP rank (python, numpy, torch CPU, CUDA, the TP tracker), gathered over DP.
Optimizer state is replicated over DP today; a ZeRO optimizer adds per-DP-rank files beside it,
`mp_rank_XX/optim_dp_rank_YYY.pt`, without changing the shard above.

Atomicity: each shard goes to `NAME.tmp`, is fsynced and `os.replace`d; every rank then agrees
(one all-gather of error strings, which is also the barrier) that all shards are complete, and only
then rank 0 replaces the iteration file. A run killed during a save leaves the iteration file
naming the previous, complete checkpoint.

Loading at the saved TP degree copies each rank's shards; at another degree each rank memory-maps
every saved shard and rebuilds the full (unsharded, unpadded) tensor of each parameter and
optimizer moment from the saved sharding, then keeps its own shard: model and optimizer re-shard
alike. RNG states load only at the saved TP and DP degrees (a stream belongs to a rank).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megadomino.models.gpt import shard_full
from megadomino.parallel import ParallelDims
from megadomino.parallel.layers import unshard_rows
from megadomino.training.optimizer import MixedPrecisionAdamW
from megadomino.training.rng_state import capture_rng_state, restore_rng_state

TRACKER = "latest_checkpointed_iteration.txt"
SHARD = "model_optim_rng.pt"
FORMAT_VERSION = 1
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels", "ffn_hidden_size", "vocab_size", "normalization", "swiglu",
                       "position_embedding_type", "add_bias_linear",
                       "untie_embeddings_and_output_weights")
"""ModelConfig fields a checkpoint's weights are tied to (plus max_position_embeddings with
learned positions); any difference is an error."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded or saved; the message names the file or the field."""


@dataclasses.dataclass
class TrainingState:
    """The training counters a checkpoint carries."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    scheduler_steps: int = 0
    """Successful optimizer steps: the LR schedule's position (skipped fp16 steps don't count)."""


def checkpoint_dir(directory: str | os.PathLike, iteration: int | str) -> Path:
    """DIR/iter_0000010, or DIR/release for iteration 'release'."""
    name = "release" if iteration == "release" else f"iter_{iteration:07d}"
    return Path(directory) / name


def shard_path(iteration_dir: Path, tp_rank: int, pp_rank: int, pp: int) -> Path:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return iteration_dir / name / SHARD


def latest_iteration(directory: str | os.PathLike) -> int | str | None:
    """The iteration named by DIR's iteration file ('release' for a release checkpoint), or None
    when there is no file."""
    path = Path(directory) / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number") from None


# ---- saving ---------------------------------------------------------------------------------


def save_checkpoint(directory: str | os.PathLike, state: TrainingState, model: nn.Module,
                    optimizer: MixedPrecisionAdamW | None, dims: ParallelDims, *,
                    save_rng: bool = True, release: bool = False) -> Path:
    """Write the checkpoint of `state.iteration` (or a weights-only 'release' one) and return its
    directory. Collective over the world; `optimizer` None leaves the optimizer out."""
    iteration = "release" if release else state.iteration
    target = checkpoint_dir(directory, iteration)
    rng = _gather_over_dp(capture_rng_state(dims), dims) if save_rng else None
    error = None
    if dims.dp_rank == 0:
        try:
            shard = {
                "format": FORMAT_VERSION,
                "model_config": dataclasses.asdict(model.config),
                "parallel": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp},
                "state": dataclasses.asdict(state),
                "model": {name: _compact(p) for name, p in model.named_parameters()},
                "sharding": {name: _sharding(p) for name, p in model.named_parameters()},
                "optimizer": None if optimizer is None else _optimizer_shard(optimizer, model),
                "rng": rng,
            }
            _atomic_save(shard, shard_path(target, dims.tp_rank, dims.pp_rank, dims.pp))
        except Exception as err:  # every rank must hear of it, or they wait on the tracker
            error = f"rank {dims.rank} could not write its shard: {err!r}"
    _agree(error)
    if dims.rank == 0:
        try:
            _write_tracker(Path(directory), iteration)
        except OSError as err:
            error = f"rank 0 could not write {Path(directory) / TRACKER}: {err!r}"
    _agree(error)
    return target


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its bytes (torch.save writes a view's whole storage)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _sharding(param: torch.Tensor) -> dict | None:
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return {"dim": param.tp_partition_dim, "stripes": param.tp_stripes,
            "vocab_size": getattr(param, "vocab_size", None)}


def _optimizer_shard(optimizer: MixedPrecisionAdamW, model: nn.Module) -> dict:
    """AdamW state and fp32 masters by parameter name (this rank's shards) and the loss scaler."""
    names = {id(p): name for name, p in model.named_parameters()}
    params = {}
    for param, master in zip(optimizer.params, optimizer.masters):
        entry = {key: _compact(value) for key, value in optimizer.adamw.state[master].items()}
        if param is not master:
            entry["master"] = _compact(master)
        params[names[id(param)]] = entry
    scaler = optimizer.loss_scaler
    return {"params": params, "loss_scaler": None if scaler is None else scaler.state_dict()}


def _atomic_save(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def _write_tracker(directory: Path, iteration: int | str) -> None:
    temporary = directory / (TRACKER + ".tmp")
    with open(temporary, "w") as file:
        file.write(f"{iteration}\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, directory / TRACKER)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _gather_over_dp(obj: dict, dims: ParallelDims) -> list[dict]:
    if dims.dp == 1:
        return [obj]
    gathered: list = [None] * dims.dp
    dist.all_gather_object(gathered, obj, group=dims.dp_group)
    return gathered


def _agree(error: str | None) -> None:
    """Raise on every rank the first rank's error, if any rank has one (a barrier otherwise)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


# ---- loading --------------------------------------------------------------------------------


def load_checkpoint(directory: str | os.PathLike, model: nn.Module,
                    optimizer: MixedPrecisionAdamW | None, dims: ParallelDims, *,
                    load_optim: bool = True, load_rng: bool = True, finetune: bool = False,
                    log: Callable[[str], None] = print) -> TrainingState | None:
    """Load the checkpoint DIR's iteration file names into `model` (and `optimizer`, the RNGs)
    and return its TrainingState; None when DIR has no iteration file. Collective over the world.

    finetune, or a release checkpoint: weights only, and a fresh TrainingState. Otherwise the
    optimizer unless `load_optim` is False, the RNG states unless `load_rng` is False (or the TP or
    DP degree changed: then the run keeps its --seed streams and says so on rank 0). Every rank
    raises the same CheckpointError for a missing, truncated or mismatched shard.
    """
    iteration = latest_iteration(directory)
    if iteration is None:
        return None
    source = checkpoint_dir(directory, iteration)
    only_weights = finetune or iteration == "release"
    reader, error = None, None
    try:
        reader = _ShardReader(source, dims, model)
    except CheckpointError as err:
        error = str(err)
    _agree(error)
    try:
        state = reader.load(model, optimizer,
                            load_optim and optimizer is not None and not only_weights)
        rng_note = None
        if load_rng and not only_weights:
            rng_note = reader.load_rng()
    except CheckpointError as err:
        error = str(err)
    _agree(error)
    if dims.rank == 0:
        log(f" loaded checkpoint {source} (iteration {iteration})"
            + (" as weights only" if only_weights else "") + (f"; {rng_note}" if rng_note else ""))
    return TrainingState() if only_weights else state


class _ShardReader:
    """The shards of one checkpoint directory, opened (memory-mapped) as this rank needs them."""

    def __init__(self, source: Path, dims: ParallelDims, model: nn.Module):
        self.source, self.dims = source, dims
        first = shard_path(source, 0, dims.pp_rank, dims.pp)
        head = _open_shard(first)
        saved = head["parallel"]
        if saved["pp"] != dims.pp:
            raise CheckpointError(f"{first}: saved with pipeline-parallel size {saved['pp']}, "
                                  f"this run has {dims.pp}")
        _check_config(first, head["model_config"], dataclasses.asdict(model.config))
        paths = [shard_path(source, t, dims.pp_rank, dims.pp) for t in range(saved["tp"])]
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise CheckpointError(f"checkpoint shard missing: {', '.join(missing)} (saved at "
                                  f"tensor-parallel size {saved['tp']})")
        self.saved_tp, self.saved_dp = saved["tp"], saved["dp"]
        self.same_layout = self.saved_tp == dims.tp
        self.paths = [paths[dims.tp_rank]] if self.same_layout else paths
        self.shards = [head if p == first else _open_shard(p) for p in self.paths]

    def load(self, model: nn.Module, optimizer: MixedPrecisionAdamW | None,
             load_optim: bool) -> TrainingState:
        """Weights (from the saved fp32 masters where there are some: they are exact), the
        optimizer's masters, and its AdamW state and loss scaler if `load_optim`."""
        own = self.shards[0]
        params = dict(model.named_parameters())
        missing = sorted(set(params) - set(own["model"]))
        unexpected = sorted(set(own["model"]) - set(params))
        if missing or unexpected:
            raise CheckpointError(f"{self.paths[0]}: parameters differ from the model's: missing "
                                  f"{missing}, unexpected {unexpected}")
        saved_optimizer = own["optimizer"]
        if load_optim and saved_optimizer is None:
            raise CheckpointError(f"{self.paths[0]} holds no optimizer state (saved with "
                                  "--no-save-optim): pass --no-load-optim or --finetune")
        saved_params = saved_optimizer["params"] if saved_optimizer is not None else {}
        masters = {} if optimizer is None else {
            id(p): m for p, m in zip(optimizer.params, optimizer.masters)}
        with torch.no_grad():
            for name, param in params.items():
                key = "master" if "master" in saved_params.get(name, {}) else None
                weights = self._tensor(name, param, key)
                param.copy_(weights)
                master = masters.get(id(param))
                if master is not None and master is not param:
                    master.copy_(weights)
        if load_optim:
            self._load_optimizer(optimizer, model, saved_optimizer)
        return TrainingState(**own["state"])

    def load_rng(self) -> str | None:
        """Set this rank's generators; the reason when they cannot be (None when loaded)."""
        own = self.shards[0]
        if own["rng"] is None:
            return "the checkpoint has no RNG state (--no-save-rng): keeping the --seed streams"
        if not self.same_layout or self.saved_dp != self.dims.dp:
            return (f"RNG states not loaded: saved at TP={self.saved_tp} x DP={self.saved_dp}, "
                    f"running at TP={self.dims.tp} x DP={self.dims.dp}")
        restore_rng_state(own["rng"][self.dims.dp_rank], self.dims)
        return None

    def _tensor(self, name: str, param: torch.Tensor, key: str | None) -> torch.Tensor:
        """This rank's shard of the saved model weight (key None) or optimizer entry `key`."""
        def saved(shard: dict) -> torch.Tensor:
            return shard["model"][name] if key is None else shard["optimizer"]["params"][name][key]

        sharding = self.shards[0]["sharding"][name]
        if self.same_layout or sharding is None or key == "step":
            local = saved(self.shards[0])
        else:
            full = unshard_rows([saved(s) for s in self.shards], sharding["dim"],
                                sharding["stripes"])
            if sharding["vocab_size"] is not None:
                full = full[:sharding["vocab_size"]]
            local = shard_full(full, param, self.dims)
        if local.ndim and tuple(local.shape) != tuple(param.shape):
            raise CheckpointError(f"{self.paths[0]}: {name}{'' if key is None else ' ' + key} has "
                                  f"shape {tuple(local.shape)}, the model's shard "
                                  f"{tuple(param.shape)}")
        return local

    def _load_optimizer(self, optimizer: MixedPrecisionAdamW, model: nn.Module,
                        saved: dict) -> None:
        """AdamW state through torch's own load_state_dict (it puts `step` where the fused or
        foreach kernels want it) and the loss scaler."""
        names = {id(p): name for name, p in model.named_parameters()}
        index = {id(m): i for i, m in enumerate(
            m for group in optimizer.adamw.param_groups for m in group["params"])}
        torch_state = optimizer.adamw.state_dict()
        torch_state["state"] = {}
        for param, master in zip(optimizer.params, optimizer.masters):
            name = names[id(param)]
            # Copies: torch keeps CPU state tensors as given, and these map the shard file.
            entry = {key: self._tensor(name, param, key).clone()
                     for key in saved["params"].get(name, {}) if key != "master"}
            if entry:
                torch_state["state"][index[id(master)]] = entry
        optimizer.adamw.load_state_dict(torch_state)
        if optimizer.loss_scaler is not None and saved["loss_scaler"] is not None:
            optimizer.loss_scaler.load_state_dict(saved["loss_scaler"])


def _open_shard(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"checkpoint shard missing: {path}")
    try:
        shard = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt?): {err}") from None
    if not isinstance(shard, dict) or shard.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a megadomino checkpoint shard of format "
                              f"{FORMAT_VERSION}")
    return shard


def _check_config(path: Path, saved: dict, current: dict) -> None:
    fields = ARCHITECTURE_FIELDS
    if current["position_embedding_type"] == "learned_absolute":
        fields += ("max_position_embeddings",)
    for field in fields:
        if saved.get(field) != current[field]:
            raise CheckpointError(f"{path}: the checkpoint's {field}={saved.get(field)!r} differs "
                                  f"from this run's {current[field]!r} (--"
                                  f"{field.replace('_', '-')})")
