"""Checkpoints that load as saved, or not at all: the committed format-1 fixture loads and
resumes bit-exactly at every format change; every file a save writes is in its manifest with its
CRC-32, and a flipped byte is an error naming the file on every load path (resume, --finetune,
another TP degree, ZeRO shards, the HF converter); a checkpoint becomes the latest only once its
weights gave a finite loss."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from configs import make_config, with_leaves
from dist_utils import C, DistSuite, shared_copy
from megadomino.build import build_model
from megadomino.config import Config, ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.train.checkpoint import (
    CheckpointError,
    TrainingState,
    latest_iteration,
    load_checkpoint,
    load_optimizer_state,
    save_checkpoint,
)
from megadomino.train.loop import train
from megadomino.train.report import NonFiniteLossError
from megadomino.zero import ZeroConfig, ZeroPlusPlus
from megadomino.zero.optimizer import build_engine

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1"
PRE_ENGINE = Path(__file__).parent / "fixtures" / "checkpoint_pre_engine"
FIXTURES = {"plain": FIXTURE, "zero1": FIXTURE, "plain_bf16": PRE_ENGINE, "zero3": PRE_ENGINE}
"""Each committed checkpoint and the fixture directory holding it (see fixtures/README.md)."""


def _leaf(name: str) -> str:
    """The tree's leaf for a flat field name the fixtures' expected.json was written with."""
    for prefix in ("domino_", "fp8_", "zero_"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return {"fp8": "format"}.get(name, name)


def fixture_configs(kind: str, **overrides) -> tuple[Config, list[float]]:
    """The config the fixture `kind` was written with, and its run's losses."""
    expected = json.loads((FIXTURES[kind] / "expected.json").read_text())
    model_fields = dict(expected["model_config"])
    layers = {name: model_fields.pop(name) for name in list(model_fields)
              if name not in ModelConfig.__dataclass_fields__}
    if layers.get("fp8") is None:  # FP8 off: its recipe fields were defaults
        layers = {name: value for name, value in layers.items() if not name.startswith("fp8")}
    fields = dict(expected[kind]["train_config"])
    fields["zero_stage"] = fields["zero_stage"] or 0  # written before stage 0 had a number
    fields.setdefault("lr_decay_style", "cosine")  # written when Python's default was cosine
    leaves = {_leaf(name): value for name, value in {**layers, **fields}.items()}
    config = make_config(ModelConfig(**model_fields), **leaves, log_interval=1,
                         eval_interval=0, eval_iters=0, mock_data=True)
    return with_leaves(config, **overrides), expected[kind]["losses"]


def check_fixture_resumes(kind: str, root: str) -> None:
    """The fixture's iteration-2 checkpoint resumed at its TP=2 x DP=2 gives the loss of
    iteration 3 of the run that wrote it bit for bit (the restored weights, data position and
    RNG), and iteration 4's within 1e-6: the step between them clips inside fused AdamW now
    (gradients divided by 1 / the coefficient as the kernel reads them), which rounds the update
    otherwise than the multiply of the code that wrote the fixture."""
    directory = shared_copy(FIXTURES[kind] / kind, f"{root}/resume-{kind}")
    config, losses = fixture_configs(kind, tensor_model_parallel_size=2, load=directory)
    lines: list[str] = []
    history = train(config, ParallelDims(tp=2), "gpt", log=lines.append)
    assert history["losses"][0] == losses[2], (history["losses"], losses)
    assert abs(history["losses"][1] - losses[3]) <= 1e-6 * abs(losses[3]), (history, losses)
    notices = [line for line in lines if "manifest.json (saved before checkpoints" in line]
    has_manifest = (FIXTURES[kind] / kind / "iter_0000002" / "manifest.json").exists()
    assert len(notices) == (dist.get_rank() == 0 and not has_manifest), lines


def check_fixture_other_tp(root: str) -> None:
    """The plain fixture loads at TP=1 x DP=4 (weights and AdamW state re-sharded) and trains on
    with finite losses near the original run's."""
    directory = shared_copy(FIXTURE / "plain", f"{root}/tp1")
    config, losses = fixture_configs("plain", load=directory)
    history = train(config, ParallelDims(tp=1), "gpt", log=lambda line: None)
    assert all(math.isfinite(loss) for loss in history["losses"]), history["losses"]
    assert abs(history["losses"][-1] - losses[-1]) < 0.05, (history["losses"], losses)


SMALL = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                    max_position_embeddings=8, vocab_size=96, make_vocab_size_divisible_by=8)


def flip_byte(path: Path) -> None:
    """Invert one byte in the middle of `path` (rank 0 only; every rank sees it on return)."""
    if dist.get_rank() == 0:
        flip_local(path)
    dist.barrier()


def expect_error(pattern: str, load, *args, **kwargs) -> None:
    with pytest.raises(CheckpointError, match=pattern):
        load(*args, **kwargs)


def converter():
    path = Path(__file__).parent.parent / "scripts" / "convert_hf_llama.py"
    spec = importlib.util.spec_from_file_location("convert_hf_llama", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_manifest_and_corruption(tp: ParallelDims, dense: ParallelDims, root: str) -> None:
    """The manifest lists each shard with its true size and CRC-32; a flipped byte in one shard
    fails every load path with an error naming that shard; so does a corrupt manifest."""
    model = build_model(SMALL, tp)
    optimizer = build_engine(model, tp, make_config(SMALL, lr=1e-2))
    target = save_checkpoint(f"{root}/good", TrainingState(iteration=3), model, optimizer, tp)
    files = json.loads((target / "manifest.json").read_text())["files"]
    shards = [f"mp_rank_0{rank}/model_optim_rng.pt" for rank in range(2)]
    assert sorted(files) == shards, files
    for name in shards:
        data = (target / name).read_bytes()
        assert files[name] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert load_checkpoint(f"{root}/good", model, tp).iteration == 3

    bad = shared_copy(Path(f"{root}/good"), f"{root}/flipped")
    flip_byte(Path(bad) / "iter_0000003" / shards[1])
    named = f"{shards[1]} is corrupt: its CRC-32 is"
    expect_error(named, load_checkpoint, bad, model, tp)
    expect_error(named, load_checkpoint, bad, model, tp, finetune=True)
    fresh = build_model(SMALL, dense)
    expect_error(named, load_checkpoint, bad, fresh, dense)
    if dist.get_rank() == 0:  # the converter reads TP rank 0's shard first
        flipped_head = shutil.copytree(f"{root}/good", f"{root}/flipped-head")
        flip_local(Path(flipped_head) / "iter_0000003" / shards[0])
        expect_error(f"{shards[0]} is corrupt", converter().saved_model_config, flipped_head)

    garbled = shared_copy(Path(f"{root}/good"), f"{root}/garbled")
    if dist.get_rank() == 0:
        (Path(garbled) / "iter_0000003" / "manifest.json").write_text("{not json")
    dist.barrier()
    expect_error("manifest.json is unreadable", load_checkpoint, garbled, model, tp)


def flip_local(path: Path) -> None:
    """Invert one byte in the middle of `path`."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def check_zero_shard_corruption(dims: ParallelDims, root: str) -> None:
    """A flipped byte in a ZeRO optimizer shard fails load_optimizer_state naming it."""
    factory = functools.partial(torch.optim.AdamW, lr=1e-2)
    model = build_model(SMALL, dims)
    engine = ZeroPlusPlus(model, dims, factory, ZeroConfig(stage=1))
    target = save_checkpoint(f"{root}/zero", TrainingState(iteration=2), model, engine, dims)
    files = json.loads((target / "manifest.json").read_text())["files"]
    zero_file = "mp_rank_00/optim_dp_rank_001.pt"
    assert zero_file in files, files
    flip_byte(target / zero_file)
    fresh = build_model(SMALL, dims)
    state = load_checkpoint(f"{root}/zero", fresh, dims)
    expect_error(f"{zero_file} is corrupt", load_optimizer_state, f"{root}/zero", state.iteration,
                 ZeroPlusPlus(fresh, dims, factory, ZeroConfig(stage=1)), dims)


def check_diverged_step_is_not_latest(dims: ParallelDims, root: str) -> None:
    """--lr 1e35 --save-interval 1: the step's own loss is finite, the weights it writes are not;
    the run stops and the iteration file still names the last good checkpoint, which resumes to
    finite losses. From scratch, no checkpoint is named at all."""
    config = make_config(SMALL, micro_batch_size=1, global_batch_size=dims.dp, lr=1e-3,
                         log_interval=1, eval_interval=0, eval_iters=0, mock_data=True,
                         save_interval=1, tensor_model_parallel_size=dims.tp)

    def run(**overrides) -> dict:
        return train(with_leaves(config, **overrides), dims, "gpt", log=lambda line: None)

    directory = f"{root}/diverge"
    run(train_iters=3, save=directory)
    assert latest_iteration(directory) == 3
    with pytest.raises(NonFiniteLossError, match="weights saved at iteration 4 give the loss "
                                                 ".* still names iteration 3"):
        run(train_iters=6, lr=1e35, save=directory, load=directory)
    assert latest_iteration(directory) == 3
    resumed = run(train_iters=5, save=directory, load=directory)
    assert len(resumed["losses"]) == 2 and all(map(math.isfinite, resumed["losses"]))
    assert latest_iteration(directory) == 5

    with pytest.raises(NonFiniteLossError, match="still names no checkpoint"):
        run(train_iters=3, lr=1e35, save=f"{root}/diverge-at-once")
    assert latest_iteration(f"{root}/diverge-at-once") is None


CORRUPTION = DistSuite(worlds=(2,))


@CORRUPTION.setup
def _corruption_setup(world: int, root: str) -> dict:
    return {"tp": ParallelDims(tp=2), "dense": ParallelDims(tp=1), "root": root}


CORRUPTION.case("manifest-and-corruption", check_manifest_and_corruption, C.tp, C.dense, C.root)
CORRUPTION.case("zero-shard-corruption", check_zero_shard_corruption, C.dense, C.root)
CORRUPTION.case("diverged-step-is-not-latest", check_diverged_step_is_not_latest, C.tp, C.root)


SUITE = DistSuite(worlds=(4,))


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"root": root}


for kind in FIXTURES:
    SUITE.case(f"fixture-resumes-{kind}", check_fixture_resumes, kind, C.root)
SUITE.case("fixture-other-tp", check_fixture_other_tp, C.root)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("integrity")),)


test_checkpoint_integrity = SUITE.test(args_fixture="root")
test_checkpoint_corruption = CORRUPTION.test(args_fixture="root")


def test_disk_full_names_the_file_and_the_cause(tmp_path, monkeypatch):
    """A save onto a full disk fails with the file, the cause and the free space, not torch's
    "unexpected pos"; nothing is left under the final name."""
    import errno
    import io

    from megadomino.train.checkpoint import files as checkpoint_files

    class Full(io.BytesIO):
        def write(self, data) -> int:
            if self.tell() + len(memoryview(data).cast("B")) > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

        def fileno(self) -> int:
            raise AssertionError("the write failed first")

    monkeypatch.setattr(checkpoint_files, "open", lambda path, mode: Full(), raising=False)
    target = tmp_path / "mp_rank_00" / "model_optim_rng.pt"
    with pytest.raises(CheckpointError, match=r"could not write .*model_optim_rng.pt.tmp \(No "
                       r"space left on device; [\d.]+ GiB free"):
        checkpoint_files.atomic_save({"weights": torch.zeros(10_000)}, target)
    assert not target.exists()


def test_a_bug_while_building_a_shard_keeps_its_traceback(tmp_path, monkeypatch):
    """A full disk or exhausted memory while a shard is built becomes the save's CheckpointError
    (every rank must hear of it); our own bug there (a KeyError) is raised as itself, with its
    traceback, not dressed up as a failed write."""
    from dist_utils import free_port
    from megadomino.train.checkpoint import shards

    def raising(error: Exception):
        def compact(tensor):
            raise error
        return compact

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        dims = ParallelDims(tp=1)
        model = build_model(ModelConfig.preset("gpt-tiny"), dims)
        for error, expected in ((KeyError("our bug"), KeyError),
                                (OSError(28, "No space left on device"), CheckpointError),
                                (MemoryError(), CheckpointError)):
            monkeypatch.setattr(shards, "compact", raising(error))
            with pytest.raises(expected, match="our bug|No space left|MemoryError"):
                save_checkpoint(tmp_path / type(error).__name__, TrainingState(iteration=1),
                                model, None, dims)
    finally:
        dist.destroy_process_group()


def test_a_deleted_manifest_is_refused_unless_the_shards_predate_manifests(tmp_path):
    """A shard records the manifest it is listed in: with that manifest deleted the checkpoint is
    refused naming it; a shard without the record (saved before manifests existed) loads
    unverified, with a notice, as before."""
    from dist_utils import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        dims = ParallelDims(tp=1)
        model = build_model(SMALL, dims)
        target = save_checkpoint(tmp_path, TrainingState(iteration=2), model, None, dims)
        (target / "manifest.json").unlink()
        with pytest.raises(CheckpointError, match=f"^{target / 'manifest.json'} is missing: "):
            load_checkpoint(tmp_path, model, dims)
        shard_file = target / "mp_rank_00" / "model_optim_rng.pt"
        shard = torch.load(shard_file, weights_only=True)
        del shard["manifest"]
        torch.save(shard, shard_file)
        lines: list[str] = []
        assert load_checkpoint(tmp_path, model, dims, log=lines.append).iteration == 2
        assert any("manifest.json (saved before checkpoints" in line for line in lines), lines
    finally:
        dist.destroy_process_group()
