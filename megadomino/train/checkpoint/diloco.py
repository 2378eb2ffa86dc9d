"""DiLoCo's state in a checkpoint (zero/diloco.py), beside each TP rank's model shard:

    DIR/iter_0000010/mp_rank_00/diloco_dp_rank_003.pt     DP rank 3 of TP rank 0

Every rank writes its file: the outer state of its chunk of the masters (the global parameters
of the last outer step, the Nesterov momentum, the inner steps since), and at ZeRO stage 0 on the
ranks of site 1 and up also the site's inner state (`engine.state_dict()`: its fp32 masters,
which are its weights, its optimizer's moments and its loss scaler). Between two outer steps the
sites train apart, and the model shards (DP rank 0 writes them, a rank of site 0) hold site 0's
weights and stage 0's optimizer state: loading puts each other site's own state back over them,
so that a resumed run repeats the uninterrupted one exactly. At stages 1 and 3 every rank's
optim_dp_rank file holds its own inner state already. The files go into the manifest with the
others (written atomically, verified on load). At stage 0 each DP rank of a site beyond site 0
writes its site's whole inner state (the same on every DP rank of the site).

A checkpoint without DiLoCo files (saved by a run without DiLoCo) starts the outer state from
the loaded weights, with a notice: DiLoCo may continue a data-parallel run. One saved at
another site count or layout is refused, naming --no-load-optim.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint.files import (
    FORMAT_VERSION,
    CheckpointError,
    Manifest,
    agree,
    compact_all,
    gather_all,
    open_shard,
)
from megadomino.zero import ZeroPlusPlus
from megadomino.zero.optimizer import layout_mismatch


def diloco_path(model_shard: Path, dims: ParallelDims) -> Path:
    """This rank's DiLoCo file, beside its TP (and pipeline) rank's model shard."""
    return model_shard.parent / f"diloco_dp_rank_{dims.dp_rank:03d}.pt"


def diloco_files(model_shard: Path, engine: ZeroPlusPlus,
                 dims: ParallelDims) -> dict[Path, dict]:
    """{path: object} of this rank's DiLoCo file ({} without DiLoCo): references to the live
    tensors, written before the next step."""
    if engine.outer is None:
        return {}
    inner = compact_all(engine.state_dict()) if dims.site > 0 and not engine.sharded else None
    return {diloco_path(model_shard, dims): {"format": FORMAT_VERSION,
                                             "outer": compact_all(engine.outer.state_dict()),
                                             "site": dims.site, "inner": inner}}


def load_diloco_state(model_shard: Path, engine: ZeroPlusPlus, dims: ParallelDims,
                      log: Callable[[str], None] = print) -> None:
    """After the model shards' weights and optimizer state went into the engine: this rank's
    outer state and (stage 0, site 1 and up) its site's inner state, from the file beside
    `model_shard` (this rank's TP and pipeline rank's). Collective over the world: every rank
    raises the same CheckpointError for a missing, corrupt or mismatched file."""
    if engine.outer is None:
        return
    path = diloco_path(model_shard, dims)
    found = gather_all(path.exists())
    if not any(found):
        engine.outer.reset()
        if dims.rank == 0:
            log(f" {model_shard.parents[1]} holds no DiLoCo state: the outer optimizer starts "
                "from the loaded weights")
        return
    saved, error = None, None
    try:
        saved = open_shard(path, Manifest.read(model_shard.parents[1]))
        problem = _mismatch(saved, engine, dims)
        if problem is not None:
            raise CheckpointError(f"{path}: {problem}: resume at the DiLoCo sites and layout it "
                                  "was saved with, or load the weights only with --no-load-optim")
    except CheckpointError as err:
        error = str(err)
    agree(error)  # before the loads, whose parameter refresh is collective
    engine.outer.load_state_dict(saved["outer"])
    if saved["inner"] is not None:
        engine.load_state_dict(saved["inner"])


def _mismatch(saved: dict, engine: ZeroPlusPlus, dims: ParallelDims) -> str | None:
    """Why this rank cannot load `saved` (a DiLoCo file), or None."""
    outer = saved["outer"]
    if (saved["site"], outer["sites"]) != (dims.site, dims.sites):
        return (f"saved by site {saved['site']} of {outer['sites']} DiLoCo sites, this rank is "
                f"in site {dims.site} of {dims.sites}")
    shapes = [tuple(t.shape) for t in outer["snapshot"]]
    if shapes != [tuple(m.shape) for m in engine.outer.masters]:
        return f"its outer state's chunks {shapes} are not this engine's"
    if saved["inner"] is not None and saved["inner"]["layout"] != engine.state_dict()["layout"]:
        return layout_mismatch(saved["inner"]["layout"], engine.state_dict()["layout"])
    return None
