"""Checkpoints in Megatron-LM's layout: one shard per TP rank, written atomically, exact resume,
and loadable at another TP degree.

Layout of `--save DIR`:

    DIR/latest_checkpointed_iteration.txt                 "10", or "release"; written last
    DIR/iter_0000010/mp_rank_00/model_optim_rng.pt        TP rank 0 (mp_rank_00_001 when PP > 1)
    DIR/iter_0000010/mp_rank_01/model_optim_rng.pt        TP rank 1
    DIR/iter_0000010/mp_rank_01/optim_dp_rank_001.pt      with ZeRO: TP rank 1, DP rank 1
    DIR/iter_0000010/manifest.json                        size and CRC-32 of each file above
    DIR/release/mp_rank_00/model_optim_rng.pt             weights only (converters), iteration 0

DP rank 0 of each TP rank writes that rank's shard: its model shard, its optimizer shard (AdamW
moments, step and the fp32 masters of bf16/fp16 parameters, keyed by parameter name), the loss
scaler, the training counters, the ModelConfig, the sharding of every parameter, and the RNG states
(python, numpy, torch CPU, CUDA, the TP tracker) and FP8 scaling states (parallel.fp8's FP8State
buffers, per rank) of every DP rank of its TP rank, gathered over DP.

With a ZeRO engine (--zero-stage) the model shard is the same (at stage 3 the layers are gathered
for it: every rank holds the whole model while saving), so model-only loads (--finetune,
converters) read it as before; its optimizer entry is None and its `zero` entry names the stage.
Each (TP, DP) rank writes its `engine.state_dict()` (AdamW state and fp32 masters of its DP chunk,
the loss scaler, the layout) to `optim_dp_rank_YYY.pt`; it loads at the same stage and degrees
only (`load_zero_state`). A ZeRO checkpoint resumes a run without ZeRO, and the reverse, with
--no-load-optim or --finetune (weights only); otherwise that is an error naming the flag.

Atomicity (`checkpoint_files`): each shard, ZeRO's included, goes to `NAME.tmp`, is fsynced and
`os.replace`d; every rank then agrees (one all-gather of error strings, which is also the barrier)
that all shards are complete, and only then rank 0 writes `manifest.json` (the size and CRC-32 of
every file, computed as it was written) and replaces the iteration file. A run killed during a
save leaves the iteration file naming the previous, complete checkpoint. Every load verifies the
files it reads against the manifest (a checkpoint without one loads with a notice).

Loading at the saved TP degree copies each rank's shards; at another degree each rank memory-maps
every saved shard and rebuilds the full (unsharded, unpadded) tensor of each parameter and
optimizer moment from the saved sharding, then keeps its own shard: model and optimizer re-shard
alike. RNG states load only at the saved TP and DP degrees (a stream belongs to a rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megadomino.models.gpt import shard_full
from megadomino.parallel import ParallelDims
from megadomino.parallel.fp8 import fp8_states
from megadomino.parallel.layers import unshard_rows
from megadomino.training.checkpoint_files import (
    FORMAT_VERSION,
    MANIFEST,
    TRACKER,
    CheckpointError,
    Manifest,
    agree,
    atomic_save,
    compact,
    compact_all,
    gather_all,
    gather_over_dp,
    open_shard,
    write_manifest,
    write_tracker,
)
from megadomino.training.optimizer import MixedPrecisionAdamW
from megadomino.training.pad_rows import without_pad_rows, zero_pad_rows_in_zero_state_
from megadomino.training.rng_state import capture_rng_state, restore_rng_state
from megadomino.zero import ZeroPlusPlus
from megadomino.zero.optimizer import layout_mismatch

SHARD = "model_optim_rng.pt"
ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                       "kv_channels", "ffn_hidden_size", "vocab_size", "normalization", "swiglu",
                       "position_embedding_type", "add_bias_linear",
                       "untie_embeddings_and_output_weights")
"""ModelConfig fields a checkpoint's weights are tied to (plus max_position_embeddings with
learned positions); any difference is an error."""


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


def zero_shard_path(iteration_dir: Path, dims: ParallelDims) -> Path:
    """This rank's ZeRO optimizer shard, beside its TP rank's model shard."""
    return (shard_path(iteration_dir, dims.tp_rank, dims.pp_rank, dims.pp).parent
            / f"optim_dp_rank_{dims.dp_rank:03d}.pt")


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
                    optimizer: MixedPrecisionAdamW | ZeroPlusPlus | None, dims: ParallelDims, *,
                    save_rng: bool = True, release: bool = False,
                    save_optim: bool = True, promote: bool = True) -> Path:
    """Write the checkpoint of `state.iteration` (or a weights-only 'release' one) and return its
    directory. Collective over the world. `optimizer` None or `save_optim` False leaves the
    optimizer out; a ZeRO engine is needed for the weights at stage 3 either way. `promote`
    False leaves the iteration file as it is: the training loop promotes a checkpoint
    (`promote_checkpoint`) only once its weights gave a finite loss."""
    iteration = "release" if release else state.iteration
    target = checkpoint_dir(directory, iteration)
    rng = gather_over_dp(capture_rng_state(dims), dims) if save_rng else None
    states = fp8_states(model)
    fp8 = gather_over_dp({name: {key: value.cpu() for key, value in state.state_dict().items()}
                          for name, state in states.items()}, dims) if states else None
    engine = optimizer if isinstance(optimizer, ZeroPlusPlus) else None
    zero = {"stage": engine.config.stage} if engine is not None and save_optim else None
    error, written = None, {}
    with _whole_weights(engine):
        if dims.dp_rank == 0:
            try:
                shard = {
                    "format": FORMAT_VERSION,
                    "model_config": dataclasses.asdict(model.config),
                    "parallel": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp},
                    "state": dataclasses.asdict(state),
                    "model": {name: compact(p) for name, p in model.named_parameters()},
                    "sharding": {name: _sharding(p) for name, p in model.named_parameters()},
                    "optimizer": _optimizer_shard(optimizer, model)
                    if save_optim and optimizer is not None and engine is None else None,
                    "zero": zero,
                    "rng": rng,
                    "fp8": fp8,
                }
                path = shard_path(target, dims.tp_rank, dims.pp_rank, dims.pp)
                written[path.relative_to(target).as_posix()] = atomic_save(shard, path)
            except Exception as err:  # every rank must hear of it, or they wait on the tracker
                error = f"rank {dims.rank} could not write its shard: {err!r}"
    if zero is not None:
        path = zero_shard_path(target, dims)
        try:
            written[path.relative_to(target).as_posix()] = atomic_save(
                {"format": FORMAT_VERSION, "zero": compact_all(engine.state_dict())}, path)
        except Exception as err:
            error = error or f"rank {dims.rank} could not write {path}: {err!r}"
    agree(error)
    files = {name: entry for entries in gather_all(written) for name, entry in entries.items()}
    if dims.rank == 0:
        try:
            write_manifest(target, files)
        except OSError as err:
            error = f"rank 0 could not write {target / MANIFEST}: {err!r}"
    agree(error)
    if promote:
        promote_checkpoint(directory, iteration, dims)
    return target


def promote_checkpoint(directory: str | os.PathLike, iteration: int | str,
                       dims: ParallelDims) -> None:
    """Make DIR's iteration file name `iteration` (saved complete with promote=False): rank 0
    replaces it atomically; collective over the world."""
    error = None
    if dims.rank == 0:
        try:
            write_tracker(Path(directory), iteration)
        except OSError as err:
            error = f"rank 0 could not write {Path(directory) / TRACKER}: {err!r}"
    agree(error)


@contextlib.contextmanager
def _whole_weights(engine: ZeroPlusPlus | None) -> Iterator[None]:
    """ZeRO stage 3: the model's parameters gathered (exactly, not quantized) inside; collective
    over DP. Otherwise they are whole already."""
    if engine is None or engine.config.stage == 1:
        yield
        return
    engine.params.materialize()
    try:
        yield
    finally:
        engine.params.release_all()


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
        entry = {key: compact(value) for key, value in optimizer.adamw.state[master].items()}
        if param is not master:
            entry["master"] = compact(master)
        params[names[id(param)]] = entry
    scaler = optimizer.loss_scaler
    return {"params": params, "loss_scaler": None if scaler is None else scaler.state_dict()}


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
    reader, manifest, error = None, None, None
    try:
        manifest = Manifest.read(source)
        reader = _ShardReader(source, dims, model, manifest)
    except CheckpointError as err:
        error = str(err)
    agree(error)
    if manifest is None and dims.rank == 0:
        log(f" notice: {source} has no {MANIFEST} (saved before checkpoints carried checksums, "
            "or not by megadomino): its files load unverified")
    try:
        state = reader.load(model, optimizer,
                            load_optim and optimizer is not None and not only_weights)
        rng_note = None
        if load_rng and not only_weights:
            rng_note = reader.load_rng()
    except CheckpointError as err:
        error = str(err)
    agree(error)
    _notice_zeroed_pad_rows(reader.zeroed_pad_rows, source, log)
    if dims.rank == 0:
        log(f" loaded checkpoint {source} (iteration {iteration})"
            + (" as weights only" if only_weights else "") + (f"; {rng_note}" if rng_note else ""))
    return TrainingState() if only_weights else state


def load_zero_state(directory: str | os.PathLike, iteration: int, engine: ZeroPlusPlus,
                    dims: ParallelDims, log: Callable[[str], None] = print) -> None:
    """Load this rank's optim_dp_rank file of checkpoint `iteration` into `engine` (built on the
    model load_checkpoint put the weights into). Collective over the world; every rank raises the
    same CheckpointError for a checkpoint saved without ZeRO (or its optimizer), at another
    stage or degrees, or whose file is missing or unreadable."""
    state, error = None, None
    try:
        source = checkpoint_dir(directory, iteration)
        manifest = Manifest.read(source)
        head_path = shard_path(source, dims.tp_rank, dims.pp_rank, dims.pp)
        head = open_shard(head_path, manifest)
        zero, saved = head.get("zero"), head["parallel"]
        if zero is None:
            raise CheckpointError(
                f"{head_path} holds no ZeRO optimizer state (saved without --zero-stage, or with "
                "--no-save-optim): resume it without --zero-stage / --use-distributed-optimizer, "
                "or load the weights only with --no-load-optim or --finetune")
        if (zero["stage"], saved["tp"], saved["dp"]) != (engine.config.stage, dims.tp, dims.dp):
            raise CheckpointError(
                f"{head_path}: saved with --zero-stage {zero['stage']} at tensor-parallel "
                f"{saved['tp']} x data-parallel {saved['dp']}, this run has --zero-stage "
                f"{engine.config.stage} at {dims.tp} x {dims.dp}: ZeRO optimizer shards load at "
                "the same stage and degrees only (--no-load-optim loads the weights)")
        path = zero_shard_path(source, dims)
        if not path.exists():
            raise CheckpointError(f"checkpoint shard missing: {path} (--zero-stage "
                                  f"{zero['stage']} saves one per data-parallel rank)")
        if manifest is not None:
            manifest.verify(path)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)["zero"]
        except Exception as err:
            raise CheckpointError(f"{path} is unreadable (truncated or corrupt?): {err}") from None
        mine = engine.state_dict()["layout"]
        if state["layout"] != mine:
            raise CheckpointError(f"{path}: " + layout_mismatch(state["layout"], mine))
    except CheckpointError as err:
        error = str(err)
    agree(error)  # before the load, whose parameter refresh is collective
    zeroed = ["ZeRO optimizer state"] if zero_pad_rows_in_zero_state_(engine, state,
                                                                       dims.tp_rank) else []
    _notice_zeroed_pad_rows(zeroed, source, log)
    engine.load_state_dict(state)


class _ShardReader:
    """The shards of one checkpoint directory, opened (memory-mapped) as this rank needs them."""

    def __init__(self, source: Path, dims: ParallelDims, model: nn.Module,
                 manifest: Manifest | None):
        self.source, self.dims = source, dims
        first = shard_path(source, 0, dims.pp_rank, dims.pp)
        head = open_shard(first, manifest)
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
        self.shards = [head if p == first else open_shard(p, manifest) for p in self.paths]
        self.zeroed_pad_rows: list[str] = []
        """Names of saved tensors whose vocabulary padding rows were not zero (and are now)."""

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
        saved_optimizer, zero = own["optimizer"], own.get("zero")
        if load_optim and zero is not None:
            raise CheckpointError(
                f"{self.paths[0]} was saved with --zero-stage {zero['stage']}: its optimizer state "
                "is sharded over the data-parallel ranks. Resume it with --zero-stage "
                f"{zero['stage']} at tensor-parallel {self.saved_tp} x data-parallel "
                f"{self.saved_dp}, or load the weights only with --no-load-optim or --finetune")
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
        self._load_fp8(model)
        return TrainingState(**own["state"])

    def _load_fp8(self, model: nn.Module) -> None:
        """The delayed-FP8 scaling state of this rank, where the checkpoint has one for it (saved
        at the same TP and DP degrees: the state is per rank); else it starts fresh, and its
        scales are rebuilt within --fp8-amax-history-len steps."""
        saved = self.shards[0].get("fp8")
        if saved is None or not self.same_layout or self.saved_dp != self.dims.dp:
            return
        mine = saved[self.dims.dp_rank]
        for name, state in fp8_states(model).items():
            if name in mine:
                state.load_state_dict(mine[name])

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
        nonzero_pad = False
        if self.same_layout or sharding is None or key == "step":
            local, nonzero_pad = without_pad_rows(saved(self.shards[0]), param, self.dims.tp_rank)
        else:
            full = unshard_rows([saved(s) for s in self.shards], sharding["dim"],
                                sharding["stripes"])
            if sharding["vocab_size"] is not None:
                nonzero_pad = bool(full[sharding["vocab_size"]:].count_nonzero())
                full = full[:sharding["vocab_size"]]
            local = shard_full(full, param, self.dims)
        if nonzero_pad:
            self.zeroed_pad_rows.append(name if key is None else f"{name} {key}")
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


def _notice_zeroed_pad_rows(zeroed: list[str], source: Path, log: Callable[[str], None]) -> None:
    """One line on rank 0 if any rank zeroed padding rows (collective over the world)."""
    names = sorted({name for names in gather_all(zeroed) for name in names})
    if names and dist.get_rank() == 0:
        log(f" notice: {source}: the padded vocabulary rows of {', '.join(names)} were not zero "
            "(saved before the loss left padding out): loaded as zero")


def _check_config(path: Path, saved: dict, current: dict) -> None:
    fields = ARCHITECTURE_FIELDS
    if current["position_embedding_type"] == "learned_absolute":
        fields += ("max_position_embeddings",)
    for field in fields:
        if saved.get(field) != current[field]:
            raise CheckpointError(f"{path}: the checkpoint's {field}={saved.get(field)!r} differs "
                                  f"from this run's {current[field]!r} (--"
                                  f"{field.replace('_', '-')})")
