"""The pipeline boundary codecs' state in a checkpoint (--pipeline-codec, pipeline/codec_rate.py),
one file per rank beside its TP and pipeline rank's model shard:

    DIR/iter_0000010/mp_rank_00_001/codec_dp_rank_000.pt     stage 1, TP rank 0, DP rank 0

Every rank whose codecs have state (adaptive: --pipeline-codec-interval > 0 or auto; or
--pipeline-codec-error-feedback) writes its `CodecRate.state_dict()`: each link's setting, the
steps since the last decision and what they measured, and this rank's error-feedback residuals
(they differ by rank), with the flags and layout the state belongs to (`CodecRate.identity`,
the TP x PP x DP degrees). The files are written atomically with the others and listed in the
manifest; a load verifies them against it.

Loading is all or nothing over the world: both ends of a link must hold the same setting, and
every rank takes the decision collective at the same steps, so the state loads on every rank or
on none. It loads when every rank finds its file saved with this run's codec flags, degrees and
boundary shape (rank 0 then prints the settings it resumes with); the resumed run then repeats
the uninterrupted one exactly (given the same decisions: they are timed). Otherwise, as a resume
at another layout does with the RNG states, every rank's codecs start afresh, as at a run's
first step (the most compression the flags allow for --pipeline-codec-interval steps, no
residuals), and rank 0 says why in one line, naming the flag that differs: a resume takes this
run's flags, as Megatron's does. A missing file the manifest lists, or a corrupt one, is a
CheckpointError on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint.files import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    Manifest,
    agree,
    gather_all,
    open_shard,
)

FLAGS = {"codec": "--pipeline-codec", "density": "--pipeline-codec-density",
         "values": "--pipeline-codec-values", "grad_topk": "--pipeline-codec-grad-topk",
         "error_feedback": "--pipeline-codec-error-feedback",
         "interval": "--pipeline-codec-interval"}
"""CodecRate.identity's keys that a flag sets, and the flag."""
ABSENT = "absent"


class CodecState(Protocol):
    """What a checkpoint needs of the pipeline codecs: pipeline/codec_rate.py's CodecRate,
    which the pipeline runtime holds as its `codec`."""

    @property
    def stateful(self) -> bool: ...

    def describe(self) -> str: ...

    def identity(self) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def codec_path(model_shard: Path, dims: ParallelDims) -> Path:
    """This rank's codec state file, beside its TP and pipeline rank's model shard."""
    return model_shard.parent / f"codec_dp_rank_{dims.dp_rank:03d}.pt"


def _layout(dims: ParallelDims) -> dict:
    return {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp}


def codec_files(model_shard: Path, codec: CodecState | None,
                dims: ParallelDims) -> dict[Path, dict]:
    """{path: object} of this rank's codec state file ({} without a codec that has state): CPU
    copies, taken now."""
    if codec is None or not codec.stateful:
        return {}
    return {codec_path(model_shard, dims): {"format": FORMAT_VERSION,
                                            "identity": codec.identity(),
                                            "layout": _layout(dims),
                                            "state": codec.state_dict()}}


def load_codec_state(source: Path, model_shard: Path, codec: CodecState | None,
                     dims: ParallelDims, log: Callable[[str], None] = print) -> None:
    """This rank's codec state from checkpoint directory `source` (`model_shard`: this rank's
    TP and pipeline rank's shard path there), on every rank or none (module docstring).
    Collective over the world when any rank has a codec with state (the flags make that the
    same on every rank); without one, rank 0 notes a checkpoint's codec state it leaves."""
    if codec is None or not codec.stateful:
        if dims.rank == 0 and next(source.glob("mp_rank_*/codec_dp_rank_*.pt"), None):
            log(f" notice: {source} holds pipeline codec state, which this run (without an "
                "adaptive codec or --pipeline-codec-error-feedback) does not use")
        return
    path = codec_path(model_shard, dims)
    saved, reason, error = None, None, None
    try:
        manifest = Manifest.read(source)
        if path.exists():
            saved = open_shard(path, manifest)
            reason = _mismatch(saved, codec, dims)
        elif manifest is not None and path.relative_to(source).as_posix() in manifest.files:
            raise CheckpointError(f"checkpoint shard missing: {path} (listed in "
                                  f"{source / MANIFEST})")
        else:
            reason = ABSENT
    except CheckpointError as err:
        error = str(err)
    agree(error)
    reasons = gather_all(reason)
    if all(r is None for r in reasons):
        codec.load_state_dict(saved["state"])
        if dims.rank == 0:  # the start-up line named the settings before the load
            log(f" {codec.describe()} (resumed)")
        return
    if dims.rank == 0:
        log(" notice: " + _fresh_start_line(source, reasons))


def _fresh_start_line(source: Path, reasons: list[str | None]) -> str:
    """Why the codecs start afresh (rank 0's line): a mismatch some rank found, else the
    checkpoint's lack of codec state."""
    found = [r for r in reasons if r not in (None, ABSENT)]
    if found:
        why = found[0]
    elif all(r == ABSENT for r in reasons):
        why = ("holds no pipeline codec state (saved without --pipeline-codec, or with a fixed "
               "codec without --pipeline-codec-error-feedback)")
    else:
        why = "holds pipeline codec state for only some of this run's ranks"
    return (f"{source} {why}: the pipeline codecs start afresh, as at a run's first step "
            "(resume with the codec flags and degrees it was saved with to continue exactly)")


def _flag(key: str, value) -> str:
    flag = FLAGS[key]
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


def _mismatch(saved: dict, codec: CodecState, dims: ParallelDims) -> str | None:
    """Why this rank's saved codec state does not belong to this run, or None."""
    theirs, mine = saved["identity"], codec.identity()
    for key in FLAGS:
        if theirs[key] != mine[key]:
            return (f"holds pipeline codec state saved with {_flag(key, theirs[key])}, this "
                    f"run has {_flag(key, mine[key])}")
    if saved["layout"] != _layout(dims):
        was, now = saved["layout"], _layout(dims)
        return (f"holds pipeline codec state saved at tensor-parallel {was['tp']} x "
                f"pipeline-parallel {was['pp']} x data-parallel {was['dp']}, this run is at "
                f"{now['tp']} x {now['pp']} x {now['dp']}")
    if theirs != mine:
        return (f"holds pipeline codec state of boundary activations {theirs['shape']} "
                f"{theirs['dtype']} (stage {theirs['stage']} of {theirs['stages']}), this "
                f"run's are {mine['shape']} {mine['dtype']} (stage {mine['stage']} of "
                f"{mine['stages']}; --seq-length, --micro-batch-size, --sequence-parallel, the "
                "precision flags)")
    return None
