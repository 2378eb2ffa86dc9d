"""Checkpoints in Megatron-LM's layout: one shard per TP rank (per TP x PP rank with pipeline
stages), written atomically, exact resume, and loadable at another TP or pipeline degree.

Layout of `--save DIR`:

    DIR/latest_checkpointed_iteration.txt                 "10", or "release"; written last
    DIR/iter_0000010/mp_rank_00/model_optim_rng.pt        TP rank 0 (mp_rank_00_001 when PP > 1)
    DIR/iter_0000010/mp_rank_01/model_optim_rng.pt        TP rank 1
    DIR/iter_0000010/mp_rank_01/optim_dp_rank_001.pt      with ZeRO: TP rank 1, DP rank 1
    DIR/iter_0000010/mp_rank_01/diloco_dp_rank_001.pt     with DiLoCo: its state (diloco.py)
    DIR/iter_0000010/mp_rank_00_001/codec_dp_rank_000.pt  with a pipeline codec that has state:
                                                          its state (pipeline_codec.py)
    DIR/iter_0000010/manifest.json                        size and CRC-32 of each file above
    DIR/release/mp_rank_00/model_optim_rng.pt             weights only (converters), iteration 0

DP rank 0 of each TP rank writes that rank's shard: its model shard, at ZeRO stage 0 (plain data
parallelism) its optimizer shard (AdamW moments, step and the fp32 masters of bf16/fp16
parameters, keyed by parameter name, the engine's `state_by_parameter()`) and the loss scaler,
the training counters, the ModelConfig, the sharding of every parameter, and the RNG states
(python, numpy, torch CPU, CUDA, the TP tracker) and FP8 scaling states (tp.fp8's FP8State
buffers, per rank) of every DP rank of its TP rank, gathered over DP.

At the sharded stages (--zero-stage 1 or 3) the model shard is the same (at stage 3 the layers
are gathered for it: every rank holds the whole model while saving), so model-only loads
(--finetune, converters) read it as before; its optimizer entry is None and its `zero` entry
names the stage. Each (TP, DP) rank writes its `engine.state_dict()` (AdamW state and fp32
masters of its DP chunk, the loss scaler, the layout) to `optim_dp_rank_YYY.pt`; it loads at the
same stage and degrees only. A checkpoint of one stage resumes a run at another stage with
--no-load-optim or --finetune (weights only); otherwise that is an error naming the flag.

Resuming is two calls, because the engine takes over the parameters it is built on:
`load_checkpoint` puts the weights (the fp32 masters where saved), counters and RNG states into
the model, the engine is built on it, and `load_optimizer_state` loads the engine's state.

Atomicity (`checkpoint_files`): each shard, ZeRO's included, goes to `NAME.tmp`, is fsynced and
`os.replace`d; every rank then agrees (one all-gather of error strings, which is also the barrier)
that all shards are complete, and only then rank 0 writes `manifest.json` (the size and CRC-32 of
every file, computed as it was written) and replaces the iteration file. A run killed during a
save leaves the iteration file naming the previous, complete checkpoint. Every load verifies the
files it reads against the manifest; a checkpoint without one is refused when its model shards
record it (`"manifest"`: it was deleted), and loads unverified with a notice when they do not
(saved before manifests existed).

Loading at the saved TP degree copies each rank's shards; at another degree each rank memory-maps
every saved shard and rebuilds the full (unsharded, unpadded) tensor of each parameter and
optimizer moment from the saved sharding, then keeps its own shard: model and optimizer re-shard
alike. RNG states load only at the saved TP and DP degrees (a stream belongs to a rank).

Pipeline stages: stage p's shards are mp_rank_TT_PPP and hold its parameters under the whole
model's names (`named_parameters`: `decoder.layers.{global index}`; the tied embedding in the
first and the last stage's). At the saved pipeline degree a rank reads its stage's shards; at
another it opens every stage's and takes each parameter (and its stage-0 optimizer entries) from
the stage that holds it, so a run resumes at another PP degree (and TP, at once); RNG states and
sharded (ZeRO 1/3) optimizer state need the saved degrees.
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

from megadomino.distributed import ParallelDims
from megadomino.interop.megatron_dist import write_megatron_dist
from megadomino.models.gpt import shard_full
from megadomino.tp.fp8 import fp8_states
from megadomino.tp.layers import unshard_rows
from megadomino.train.checkpoint.diloco import diloco_files, load_diloco_state
from megadomino.train.checkpoint.files import (
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
from megadomino.train.checkpoint.megatron import detect_megatron, load_megatron_checkpoint
from megadomino.train.checkpoint.pipeline_codec import CodecState, codec_files
from megadomino.train.checkpoint.rng import capture_rng_state, restore_rng_state
from megadomino.train.pad_rows import without_pad_rows, zero_pad_rows_in_zero_state_
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
    """Successful optimizer steps (skipped fp16 steps don't count)."""
    scheduler_samples: int = 0
    """The samples of the successful steps: the LR schedule's position, as Megatron counts it."""

    @classmethod
    def from_saved(cls, saved: dict) -> TrainingState:
        """The counters a checkpoint holds; one saved before the schedule counted samples had
        fixed batches, so its position is its steps times its batch."""
        if "scheduler_samples" not in saved and saved.get("iteration"):
            batch = saved["consumed_train_samples"] // saved["iteration"]
            saved = {**saved, "scheduler_samples": saved.get("scheduler_steps", 0) * batch}
        return cls(**saved)


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
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable ({err}): it should hold the iteration "
                              "number of the latest checkpoint") from None
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number") from None


# ---- saving ---------------------------------------------------------------------------------


def save_checkpoint(directory: str | os.PathLike, state: TrainingState, model: nn.Module,
                    engine: ZeroPlusPlus | None, dims: ParallelDims, *,
                    save_rng: bool = True, release: bool = False,
                    save_optim: bool = True, promote: bool = True,
                    megatron_dist: bool = False, codec: CodecState | None = None) -> Path:
    """Write the checkpoint of `state.iteration` (or a weights-only 'release' one) and return its
    directory. Collective over the world. `engine` None or `save_optim` False leaves the
    optimizer out; the engine is needed for the weights at stage 3 either way. `promote`
    False leaves the iteration file as it is: the training loop promotes a checkpoint
    (`promote_checkpoint`) only once its weights gave a finite loss. `megatron_dist`
    (--ckpt-format torch_dist): the directory also gets Megatron-LM's torch_dist files of the
    weights and counters (interop.megatron_dist), which Megatron-LM loads. `codec`: the
    pipeline runtime's codecs, whose state a training checkpoint holds (pipeline_codec.py)."""
    target, files, error = checkpoint_files(directory, state, model, engine, dims,
                                            save_rng=save_rng, release=release,
                                            save_optim=save_optim, megatron_dist=megatron_dist,
                                            codec=codec)
    written, write_error = write_files(target, files, dims)
    publish(directory, target, written, error or write_error, dims,
            promote="release" if release else state.iteration if promote else None)
    return target


def checkpoint_files(directory: str | os.PathLike, state: TrainingState, model: nn.Module,
                     engine: ZeroPlusPlus | None, dims: ParallelDims, *, save_rng: bool = True,
                     release: bool = False, save_optim: bool = True, megatron_dist: bool = False,
                     codec: CodecState | None = None
                     ) -> tuple[Path, dict[Path, dict], str | None]:
    """(the checkpoint's directory, the files this rank writes, path -> object, the error that
    kept one from being made). Collective over the world (RNG and FP8 states gathered over DP;
    stage 3 gathers the weights; `megatron_dist` writes the torch_dist files here, collectively).
    The objects hold references to the live tensors (compact copies only where a tensor is a
    view): write or copy them before the next step."""
    iteration = "release" if release else state.iteration
    target = checkpoint_dir(directory, iteration)
    rng = gather_over_dp(capture_rng_state(dims), dims) if save_rng else None
    states = fp8_states(model)
    fp8 = gather_over_dp({name: {key: value.cpu() for key, value in state.state_dict().items()}
                          for name, state in states.items()}, dims) if states else None
    save_optim = save_optim and engine is not None
    zero = {"stage": engine.config.stage} if save_optim and engine.sharded else None
    error, files = None, {}
    with _whole_weights(engine):
        if dims.dp_rank == 0:
            try:
                files[shard_path(target, dims.tp_rank, dims.pp_rank, dims.pp)] = {
                    "format": FORMAT_VERSION,
                    "manifest": MANIFEST,
                    "model_config": dataclasses.asdict(model.config),
                    "parallel": {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp,
                                 "stages": [[list(r), tp] for r, tp in dims.stages]},
                    "state": dataclasses.asdict(state),
                    "model": {name: compact(p) for name, p in named_parameters(model)},
                    "sharding": {name: _sharding(p) for name, p in named_parameters(model)},
                    "optimizer": _optimizer_shard(engine, model)
                    if save_optim and not engine.sharded else None,
                    "zero": zero,
                    "rng": rng,
                    "fp8": fp8,
                }
            except (OSError, MemoryError, torch.OutOfMemoryError) as err:
                # every rank must hear of it, or they wait on the tracker; our own bug (any other
                # exception) keeps its traceback
                error = f"rank {dims.rank} could not write its shard: {err!r}"
        if megatron_dist and not release:
            write_megatron_dist(model, target, state.iteration, dims,
                                consumed_train_samples=state.consumed_train_samples,
                                consumed_valid_samples=state.consumed_valid_samples)
    if zero is not None:
        files[zero_shard_path(target, dims)] = {"format": FORMAT_VERSION,
                                                "zero": compact_all(engine.state_dict())}
    if save_optim and not release:  # DiLoCo's outer state and the other sites' inner state
        files.update(diloco_files(shard_path(target, dims.tp_rank, dims.pp_rank, dims.pp),
                                  engine, dims))
    if not release:  # the pipeline codecs' settings and residuals, every rank's
        files.update(codec_files(shard_path(target, dims.tp_rank, dims.pp_rank, dims.pp),
                                 codec, dims))
    return target, files, error


def write_files(target: Path, files: dict[Path, dict],
                dims: ParallelDims) -> tuple[dict[str, dict], str | None]:
    """Write `files` atomically, in order: (their manifest entries, keyed by path relative to
    `target`; the first error, after which nothing more is written). No collective: the
    background writer of an asynchronous save runs it too."""
    written = {}
    for path, obj in files.items():
        try:
            written[path.relative_to(target).as_posix()] = atomic_save(obj, path)
        except Exception as err:
            what = "its shard" if path.name == SHARD else str(path)
            return written, f"rank {dims.rank} could not write {what}: {err!r}"
    return written, None


def publish(directory: str | os.PathLike, target: Path, written: dict[str, dict],
            error: str | None, dims: ParallelDims, promote: int | str | None = None) -> None:
    """Once every rank wrote its files: all agree there was no error (or raise the first on
    every rank), rank 0 writes the manifest of all of them, and the iteration file names
    iteration `promote` unless it is None. Collective over the world."""
    agree(error)
    files = {name: entry for entries in gather_all(written) for name, entry in entries.items()}
    if dims.rank == 0:
        try:
            write_manifest(target, files)
        except OSError as err:
            error = f"rank 0 could not write {target / MANIFEST}: {err!r}"
    agree(error)
    if promote is not None:
        promote_checkpoint(directory, promote, dims)


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
    """The model's parameters whole inside (stage 3 gathers them, exactly, not quantized:
    collective over DP; at stages 0 and 1 they are whole already)."""
    if engine is None:
        yield
        return
    engine.params.materialize()
    try:
        yield
    finally:
        engine.params.release_all()


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) as checkpoints key them: the whole model's names (the model's, or a
    pipeline stage's, `checkpoint_parameters`: layers by global index, so a stage's shard holds
    `decoder.layers.{global index}` and loads at another pipeline degree)."""
    return model.checkpoint_parameters()


def saved_pipeline_size(source: Path) -> int:
    """The pipeline degree a checkpoint directory was saved at (mp_rank_TT or mp_rank_TT_PPP)."""
    if (source / "mp_rank_00").is_dir():
        return 1
    return len(list(source.glob("mp_rank_00_*"))) or 1


def _sharding(param: torch.Tensor) -> dict | None:
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return {"dim": param.tp_partition_dim, "stripes": param.tp_stripes,
            "vocab_size": getattr(param, "vocab_size", None)}


def _optimizer_shard(engine: ZeroPlusPlus, model: nn.Module) -> dict:
    """Stage 0: AdamW state and fp32 masters by parameter name (this rank's TP shards) and the
    loss scaler."""
    entries = engine.state_by_parameter()
    params = {name: {key: compact(value) for key, value in entries[id(p)].items()}
              for name, p in named_parameters(model) if id(p) in entries}
    scaler = engine.loss_scaler
    return {"params": params, "kind": engine.optimizer_kind,
            "loss_scaler": None if scaler is None else scaler.state_dict()}


# ---- loading --------------------------------------------------------------------------------


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, dims: ParallelDims, *,
                    load_rng: bool = True, finetune: bool = False,
                    log: Callable[[str], None] = print) -> TrainingState | None:
    """Load the checkpoint DIR's iteration file names into `model` (the saved fp32 masters where
    there are some: they are exact; and the RNGs) and return its TrainingState; None when DIR has
    no iteration file. Collective over the world. Build the engine on the model afterwards, then
    `load_optimizer_state`.

    finetune, or a release checkpoint: weights only, and a fresh TrainingState. Otherwise the
    RNG states unless `load_rng` is False (or the TP or DP degree changed: then the run keeps its
    --seed streams and says so on rank 0). Every rank raises the same CheckpointError for a
    missing, truncated or mismatched shard.
    """
    iteration = latest_iteration(directory)
    if iteration is None:
        return None
    source = checkpoint_dir(directory, iteration)
    only_weights = finetune or iteration == "release"
    if detect_megatron(source) is not None:
        counters = load_megatron_checkpoint(source, model, dims, only_weights=only_weights,
                                            log=log)
        return TrainingState() if only_weights else TrainingState(
            counters.iteration, counters.consumed_train_samples,
            counters.consumed_valid_samples, scheduler_steps=counters.iteration)
    reader, manifest, error = None, None, None
    try:
        manifest = Manifest.read(source)
        reader = _ShardReader(source, dims, model, manifest)
    except CheckpointError as err:
        error = str(err)
    agree(error)
    if manifest is None and dims.rank == 0:
        log(f" notice: {source} has no {MANIFEST} (saved before checkpoints carried checksums, "
            "or not by megadomino: its shards record no manifest): its files load unverified")
    try:
        state = reader.load(model)
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


def load_optimizer_state(directory: str | os.PathLike, iteration: int, engine: ZeroPlusPlus,
                         dims: ParallelDims, log: Callable[[str], None] = print) -> None:
    """Load the engine's state from checkpoint `iteration` (the engine built on the model that
    load_checkpoint put the weights into): stage 0 from the model shards' optimizer entries (at
    any TP degree, re-sharded as the weights are), stages 1 and 3 from this rank's
    optim_dp_rank file (same stage and degrees only). Collective over the world; every rank
    raises the same CheckpointError for a checkpoint saved at another stage or without its
    optimizer, or whose file is missing or unreadable."""
    source = checkpoint_dir(directory, iteration)
    if detect_megatron(source) is not None:  # load_checkpoint's notice said so
        return
    state, reader, error = None, None, None
    try:
        manifest = Manifest.read(source)
        saved_pp = saved_pipeline_size(source)
        head_path = shard_path(source, dims.tp_rank, dims.pp_rank, dims.pp) \
            if saved_pp == dims.pp else shard_path(source, 0, 0, saved_pp)
        head = open_shard(head_path, manifest)
        zero, saved = head.get("zero"), head["parallel"]
        saved_stage = zero["stage"] if zero is not None else (
            0 if head["optimizer"] is not None else None)
        if saved_stage is None:
            raise CheckpointError(f"{head_path} holds no optimizer state (saved with "
                                  "--no-save-optim): pass --no-load-optim or --finetune")
        if saved_stage != engine.config.stage:
            raise CheckpointError(
                f"{head_path} was saved at --zero-stage {saved_stage} (0: plain data parallelism)"
                f", this run has --zero-stage {engine.config.stage}: resume it at --zero-stage "
                f"{saved_stage}" + (f" at tensor-parallel {saved['tp']} x data-parallel "
                                    f"{saved['dp']}" if saved_stage else "")
                + ", or load the weights only with --no-load-optim or --finetune")
        if engine.sharded:
            state = _read_sharded_state(source, head_path, saved, engine, dims, manifest)
            kind = state.get("kind", "AdamW")
        else:
            reader = _ShardReader(source, dims, engine.model, manifest)
            state = reader.optimizer_entries(engine.model)
            kind = head["optimizer"].get("kind", "AdamW")
        if kind != engine.optimizer_kind:  # checkpoints before --optimizer sgd hold AdamW's
            raise CheckpointError(
                f"{head_path} holds {kind} state, this run's optimizer is "
                f"{engine.optimizer_kind}: resume with the --optimizer it was saved with, or "
                "load the weights only with --no-load-optim")
    except CheckpointError as err:
        error = str(err)
    agree(error)  # before the load, whose parameter refresh is collective
    if engine.sharded:
        zeroed = ["ZeRO optimizer state"] if zero_pad_rows_in_zero_state_(
            engine, state, dims.tp_rank) else []
        engine.load_state_dict(state)
    else:  # load_checkpoint named the weights whose padding rows it zeroed: one notice
        zeroed = []
        engine.load_state_by_parameter(*state)
    _notice_zeroed_pad_rows(zeroed, source, log)
    load_diloco_state(shard_path(source, dims.tp_rank, dims.pp_rank, dims.pp), engine, dims, log)


def _read_sharded_state(source: Path, head_path: Path, saved: dict, engine: ZeroPlusPlus,
                        dims: ParallelDims, manifest: Manifest | None) -> dict:
    """This rank's optim_dp_rank state, checked against the engine's degrees and layout."""
    stage = engine.config.stage
    if (saved["tp"], saved["dp"], saved["pp"]) != (dims.tp, dims.dp, dims.pp):
        raise CheckpointError(
            f"{head_path}: saved with --zero-stage {stage} at tensor-parallel {saved['tp']} x "
            f"data-parallel {saved['dp']} x pipeline-parallel {saved['pp']}, this run is at "
            f"{dims.tp} x {dims.dp} x {dims.pp}: sharded optimizer state loads at the same "
            "degrees only (--no-load-optim loads the weights)")
    path = zero_shard_path(source, dims)
    if not path.exists():
        raise CheckpointError(f"checkpoint shard missing: {path} (--zero-stage {stage} saves one "
                              "per data-parallel rank)")
    if manifest is not None:
        manifest.verify(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)["zero"]
    except Exception as err:
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt?): {err}") from None
    mine = engine.state_dict()["layout"]
    if state["layout"] != mine:
        raise CheckpointError(f"{path}: " + layout_mismatch(state["layout"], mine))
    return state


class _ShardReader:
    """The shards of one checkpoint directory, opened (memory-mapped) as this rank needs them."""

    def __init__(self, source: Path, dims: ParallelDims, model: nn.Module,
                 manifest: Manifest | None):
        self.source, self.dims = source, dims
        saved_pp = saved_pipeline_size(source)
        own_stage = dims.pp_rank if saved_pp == dims.pp else 0
        first = shard_path(source, 0, own_stage, saved_pp)
        head = open_shard(first, manifest)
        saved = head["parallel"]
        _check_config(first, head["model_config"], dataclasses.asdict(model.config))
        # This rank's stage saved with the same layers: its shards alone. Else (another pipeline
        # degree or plan) every stage's, each at the TP degree it was saved at.
        names = {name for name, _ in named_parameters(model)}
        same_pp = saved_pp == dims.pp and set(head["model"]) == names
        stages = [own_stage] if same_pp else list(range(saved_pp))
        heads = {p: head if p == own_stage else open_shard(shard_path(source, 0, p, saved_pp),
                                                             manifest) for p in stages}
        self.saved_tps = {p: heads[p]["parallel"]["tp"] for p in stages}
        paths = {(t, p): shard_path(source, t, p, saved_pp)
                 for p in stages for t in range(self.saved_tps[p])}
        missing = [str(p) for p in paths.values() if not p.exists()]
        if missing:
            raise CheckpointError(f"checkpoint shard missing: {', '.join(missing)} (saved at "
                                  f"tensor-parallel size {saved['tp']}, pipeline-parallel size "
                                  f"{saved_pp})")
        self.saved_tp, self.saved_dp = saved["tp"], saved["dp"]
        self.same_tp = self.saved_tp == dims.tp
        self.same_layout = self.same_tp and same_pp
        self.head = head
        self.paths = {p: [paths[t, p] for t in ([dims.tp_rank] if self.saved_tps[p] == dims.tp
                                                else range(self.saved_tps[p]))] for p in stages}
        self.stages = {p: [heads[p] if path == paths[0, p] else open_shard(path, manifest)
                           for path in self.paths[p]] for p in stages}
        self.own = self.stages[dims.pp_rank][0] if self.same_layout else head
        """This rank's own shard at the saved layout (its RNG and FP8 states), else the head."""
        self.where: dict[str, int] = {}
        """The saved stage whose shards hold each parameter (the first, for a tied one)."""
        for p in stages:
            for name in self.stages[p][0]["model"]:
                self.where.setdefault(name, p)
        self.zeroed_pad_rows: list[str] = []
        """Names of saved tensors whose vocabulary padding rows were not zero (and are now)."""

    def _shards(self, name: str) -> list[dict]:
        return self.stages[self.where[name]]

    def load(self, model: nn.Module) -> TrainingState:
        """Weights (from the saved fp32 masters where there are some: they are exact)."""
        own = self.own
        params = dict(named_parameters(model))
        missing = sorted(set(params) - set(self.where))
        unexpected = sorted(set(own["model"]) - set(params)) if self.same_layout else []
        if missing or unexpected:
            where = next(iter(self.paths.values()))[0]
            raise CheckpointError(f"{where}: parameters differ from the model's: missing "
                                  f"{missing}, unexpected {unexpected}")
        with torch.no_grad():
            for name, param in params.items():
                saved_optimizer = self._shards(name)[0]["optimizer"]
                saved_params = saved_optimizer["params"] if saved_optimizer is not None else {}
                key = "master" if "master" in saved_params.get(name, {}) else None
                param.copy_(self._tensor(name, param, key))
        self._load_fp8(model)
        return TrainingState.from_saved(own["state"])

    def _load_fp8(self, model: nn.Module) -> None:
        """The delayed-FP8 scaling state of this rank, where the checkpoint has one for it (saved
        at the same TP and DP degrees: the state is per rank); else it starts fresh, and its
        scales are rebuilt within --fp8-amax-history-len steps."""
        saved = self.own.get("fp8")
        if saved is None or not self.same_layout or self.saved_dp != self.dims.dp:
            return
        mine = saved[self.dims.dp_rank]
        for name, state in fp8_states(model).items():
            if name in mine:
                state.load_state_dict(mine[name])

    def load_rng(self) -> str | None:
        """Set this rank's generators; the reason when they cannot be (None when loaded)."""
        own = self.own
        if own["rng"] is None:
            return "the checkpoint has no RNG state (--no-save-rng): keeping the --seed streams"
        if not self.same_layout or self.saved_dp != self.dims.dp:
            return (f"RNG states not loaded: saved at TP={self.saved_tp} x DP={self.saved_dp} x "
                    f"PP={own['parallel']['pp']}, running at TP={self.dims.tp} x "
                    f"DP={self.dims.dp} x PP={self.dims.pp}")
        restore_rng_state(own["rng"][self.dims.dp_rank], self.dims)
        return None

    def _tensor(self, name: str, param: torch.Tensor, key: str | None) -> torch.Tensor:
        """This rank's shard of the saved model weight (key None) or optimizer entry `key`."""
        def saved(shard: dict) -> torch.Tensor:
            return shard["model"][name] if key is None else shard["optimizer"]["params"][name][key]

        shards = self._shards(name)
        sharding = shards[0]["sharding"][name]
        nonzero_pad = False
        if self.saved_tps[self.where[name]] == self.dims.tp or sharding is None \
                or key == "step":
            local, nonzero_pad = without_pad_rows(saved(shards[0]), param, self.dims.tp_rank)
        else:
            full = unshard_rows([saved(s) for s in shards], sharding["dim"],
                                sharding["stripes"])
            if sharding["vocab_size"] is not None:
                nonzero_pad = bool(full[sharding["vocab_size"]:].count_nonzero())
                full = full[:sharding["vocab_size"]]
            local = shard_full(full, param, self.dims)
        if nonzero_pad:
            self.zeroed_pad_rows.append(name if key is None else f"{name} {key}")
        if local.ndim and tuple(local.shape) != tuple(param.shape):
            raise CheckpointError(f"{self.paths[self.where[name]][0]}: "
                                  f"{name}{'' if key is None else ' ' + key} has "
                                  f"shape {tuple(local.shape)}, the model's shard "
                                  f"{tuple(param.shape)}")
        return local

    def optimizer_entries(self, model: nn.Module) -> tuple[dict[int, dict], dict | None]:
        """Stage 0's state as the engine's load_state_by_parameter takes it: per parameter (by
        id) its saved AdamW entries and fp32 master, this rank's shards (copies: torch keeps CPU
        state tensors as given, and these map the shard file); and the loss scaler's state."""
        entries = {}
        for name, param in named_parameters(model):
            keys = self._shards(name)[0]["optimizer"]["params"].get(name, {})
            if keys:
                entries[id(param)] = {key: self._tensor(name, param, key).clone() for key in keys}
        return entries, self.head["optimizer"]["loss_scaler"]


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
            source = f"--{field.replace('_', '-')}"
            if field == "vocab_size":  # with --tokenizer-type the tokenizer sets it
                source = ("--vocab-size, or the tokenizer's vocabulary: was the checkpoint "
                          "trained with another tokenizer?")
            raise CheckpointError(f"{path}: the checkpoint's {field}={saved.get(field)!r} differs "
                                  f"from this run's {current[field]!r} ({source})")
