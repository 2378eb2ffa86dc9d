"""Megatron-LM checkpoints (megadomino.interop.megatron*): a small GPT and a small Llama written
by megatron-core itself (torch_dist, TP=1 and TP=2, a vocabulary that pads) load through --load
into our model at TP 1 and 2 with the same logits (fp32, 1e-5); one we write loads in
megatron-core at TP 1 and 2 with the same logits; a training run resumes a megatron-core
checkpoint's iteration and weights. All megatron-core cases run where it is installed (the `test`
extra).

Without megatron-core, committed fixtures stand for it: the legacy `torch` ones
(tests/fixtures/megatron_legacy, written from megatron-core's model state dicts in Megatron-LM's
layout) and a `torch_dist` one that megatron-core 0.16.1 wrote itself at TP=2
(tests/fixtures/megatron_dist, `python tests/fixtures/megatron_dist/make_fixtures.py`), each with
the logits megatron-core computed. They load at TP 1 and 2 and into PP=2 stages in ranks where
megatron (and Transformer Engine, apex) cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_tp_equivalence import tiny_config

from dist_utils import C, DistSuite, assert_close, free_port
from megadomino.build import build_stage
from megadomino.config import ModelConfig
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.distributed import ParallelDims
from megadomino.interop.megatron import (
    MegatronCheckpointError,
    StandIn,
    load_pickle,
    megatron_format,
    megatron_names,
)
from megadomino.interop.megatron_dist import save_megatron_dist
from megadomino.models.gpt import GPTModel
from megadomino.train.checkpoint import CheckpointError, load_checkpoint

REL = 1e-5
ITERATION = 5
LEGACY = Path(__file__).parent / "fixtures" / "megatron_legacy"
DIST = Path(__file__).parent / "fixtures" / "megatron_dist"
ROOT = Path(__file__).parent.parent


def config_of(family: str):
    """tiny_config with a vocabulary of 500: padded to 504 at TP=1 and 512 at TP=2."""
    return tiny_config(family, vocab_size=500)


def tokens_of(config, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (3, config.seq_length), generator=gen)


def shared_dir(root: str, name: str) -> Path:
    path = Path(root) / name
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return path


def our_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(tokens)


def _case_megatron_writes(family: str, megatron_tp: int, dims_by_tp: dict, root: str) -> None:
    """megatron-core saves torch_dist at `megatron_tp` (with Megatron-LM's common entries);
    --load reads it into our model at TP 1 and 2: same logits, iteration and samples."""
    from megatron.core import dist_checkpointing
    from megatron_reference import build_megatron_gpt, cpu_only, megatron_logits

    config = config_of(family)
    directory = shared_dir(root, f"mcore-{family}-tp{megatron_tp}")
    shared_dir(str(directory), f"iter_{ITERATION:07d}")  # megatron-core saves into it
    theirs = build_megatron_gpt(config, megatron_tp)
    tokens = tokens_of(config)
    expected = megatron_logits(theirs, tokens, config.vocab_size)
    state = {"model": theirs.sharded_state_dict(), "iteration": ITERATION,
             "checkpoint_version": 3.0,
             "args": argparse.Namespace(consumed_train_samples=40, consumed_valid_samples=8)}
    with cpu_only():
        dist_checkpointing.save(state, str(directory / f"iter_{ITERATION:07d}"))
    if dist.get_rank() == 0:
        (directory / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    assert megatron_format(directory / f"iter_{ITERATION:07d}") == "torch_dist"
    for tp, dims in dims_by_tp.items():
        ours = GPTModel(config, dims, "cpu")
        lines = []
        state = load_checkpoint(directory, ours, dims, log=lines.append)
        assert (state.iteration, state.consumed_train_samples, state.consumed_valid_samples,
                state.scheduler_steps) == (ITERATION, 40, 8, ITERATION)
        assert dist.get_rank() or "optimizer and RNG states are not read" in lines[-1], lines
        assert_close(our_logits(ours, tokens), expected, REL,
                     f"{family}: megatron-core TP={megatron_tp} -> ours TP={tp}")


def _case_we_write(family: str, dims: ParallelDims, root: str) -> None:
    """Our model written as torch_dist loads in megatron-core at the same TP (the vocabulary
    padded alike) with the same logits and counters."""
    from megatron_reference import build_megatron_gpt, load_megatron_dist, megatron_logits

    config = config_of(family)
    directory = shared_dir(root, f"ours-{family}-tp{dims.tp}")
    torch.manual_seed(5)
    ours = GPTModel(config, dims, "cpu")
    target = save_megatron_dist(ours, directory, 7, dims, consumed_train_samples=28)
    assert (directory / "latest_checkpointed_iteration.txt").read_text() == "7"
    tokens = tokens_of(config)
    theirs = build_megatron_gpt(config, dims.tp, seed=99)
    common = load_megatron_dist(theirs, str(target))
    assert common["iteration"] == 7 and common["args"].consumed_train_samples == 28
    assert_close(megatron_logits(theirs, tokens, config.vocab_size), our_logits(ours, tokens),
                 REL, f"{family}: ours TP={dims.tp} -> megatron-core TP={dims.tp}")


def _case_resume(dims: ParallelDims, root: str) -> None:
    """A run with --load of megatron-core's GPT checkpoint (TP=2) resumes its iteration and
    weights; with --ckpt-format torch_dist its checkpoint carries torch_dist files that
    megatron-core loads with the weights our own files hold."""
    from megatron_reference import build_megatron_gpt, load_megatron_dist, megatron_logits

    from configs import make_config
    from megadomino.train.loop import train

    config = make_config(config_of("gpt"), micro_batch_size=1, global_batch_size=2,
                         train_iters=ITERATION + 2, lr=1e-3, lr_warmup_iters=0, log_interval=1,
                         mock_data=True, tensor_model_parallel_size=dims.tp,
                         load=f"{root}/mcore-gpt-tp2", save=f"{root}/resumed",
                         ckpt_format="torch_dist")
    lines: list[str] = []
    result = train(config, dims, "gpt", log=lines.append)
    assert len(result["losses"]) == 2, result["losses"]
    assert dist.get_rank() or any(f"(iteration {ITERATION}); notice" in line
                                  for line in lines), lines
    saved = Path(root) / "resumed" / f"iter_{ITERATION + 2:07d}"
    assert megatron_format(saved) is None  # ours first; Megatron-LM reads metadata.json
    ours = GPTModel(config_of("gpt"), dims, "cpu")
    state = load_checkpoint(Path(root) / "resumed", ours, dims, log=lambda line: None)
    assert state.iteration == ITERATION + 2
    theirs = build_megatron_gpt(config_of("gpt"), dims.tp, seed=99)
    common = load_megatron_dist(theirs, str(saved))
    assert common["iteration"] == ITERATION + 2
    assert common["args"].consumed_train_samples == state.consumed_train_samples
    tokens = tokens_of(config_of("gpt"))
    assert_close(megatron_logits(theirs, tokens, config_of("gpt").vocab_size),
                 our_logits(ours, tokens), REL, "--ckpt-format torch_dist -> megatron-core")


def _case_fixture(fixture: Path, dims: ParallelDims) -> None:
    """A committed fixture loads at this TP with the logits megatron-core computed, its
    iteration and (where expected.pt names them) its consumed samples."""
    expected = torch.load(fixture / "expected.pt", weights_only=True)
    config = ModelConfig(**expected["config"])
    model = GPTModel(config, dims, "cpu")
    state = load_checkpoint(fixture, model, dims, log=lambda _line: None)
    assert state.iteration == expected["iteration"]
    for counter in ("consumed_train_samples", "consumed_valid_samples"):
        assert getattr(state, counter) == expected.get(counter, getattr(state, counter)), counter
    assert_close(our_logits(model, expected["tokens"]), expected["logits"], REL,
                 f"{fixture.parent.name}/{fixture.name} -> ours TP={dims.tp}")


def _case_fixture_stages(fixture: Path, dims: ParallelDims, whole_dims: ParallelDims) -> None:
    """A committed fixture loads into pipeline stages (PP=2, uneven where the layers are odd):
    each stage holds exactly the values the whole model gets at PP=1, and the iteration."""
    expected = torch.load(fixture / "expected.pt", weights_only=True)
    config = ModelConfig(**expected["config"])
    whole = GPTModel(config, whole_dims, "cpu")
    load_checkpoint(fixture, whole, whole_dims, log=lambda _line: None)
    first = (config.num_layers + 1) // 2 if config.num_layers % 2 else None
    plan = uniform_plan(config.num_layers, dims.world_size, 1, 2, 1, first)
    stage = build_stage(config, dims, plan, "gpt", device="cpu")
    state = load_checkpoint(fixture, stage, dims, log=lambda _line: None)
    assert state.iteration == expected["iteration"]
    reference, held = dict(whole.named_parameters()), dict(stage.checkpoint_parameters())
    assert held and set(held) < set(reference), sorted(held)
    for parameter, value in held.items():
        assert torch.equal(value, reference[parameter]), parameter


SUITE = DistSuite(worlds=(2,), timeout=300.0)


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("megatron")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    dims = {1: ParallelDims(tp=1), 2: ParallelDims(tp=2)}
    return {"dims": dims, "tp1": dims[1], "tp2": dims[2], "pp2": ParallelDims(tp=1, pp=2),
            "root": root}


for family in ("gpt", "llama"):
    for megatron_tp in (1, 2):
        SUITE.case(f"megatron-writes-{family}-tp{megatron_tp}", _case_megatron_writes, family,
                   megatron_tp, C.dims, C.root, requires="megatron")
    for tp in (1, 2):
        SUITE.case(f"we-write-{family}-tp{tp}", _case_we_write, family,
                   C.tp1 if tp == 1 else C.tp2, C.root, requires="megatron")
SUITE.case("resume", _case_resume, C.tp2, C.root, requires="megatron")

test_megatron_checkpoint = SUITE.test(args_fixture="checkpoint_root")


class RefuseMegatron:
    """A meta path finder under which megatron, Transformer Engine and apex cannot be imported."""

    def find_spec(self, name: str, path=None, target=None) -> None:
        if name.split(".")[0] in ("megatron", "transformer_engine", "apex"):
            raise ImportError(f"{name} is blocked in this test")


FIXTURES = DistSuite(worlds=(2,), timeout=300.0)


@FIXTURES.setup
def _setup_without_megatron(world: int) -> dict:
    """The rank has imported this module, torch and the library: none of it pulled megatron in;
    from here on it cannot be imported."""
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "megatron")
    assert not loaded, loaded
    sys.meta_path.insert(0, RefuseMegatron())
    return {"tp1": ParallelDims(tp=1), "tp2": ParallelDims(tp=2),
            "pp2": ParallelDims(tp=1, pp=2)}


for fixture in (LEGACY / "gpt_tp2", LEGACY / "llama_tp2_pp2", DIST / "gpt_tp2"):
    label = f"{fixture.parent.name.removeprefix('megatron_')}-{fixture.name}"
    for tp in (1, 2):
        FIXTURES.case(f"{label}-at-tp{tp}", _case_fixture, fixture, C.tp1 if tp == 1 else C.tp2)
    FIXTURES.case(f"{label}-at-pp2", _case_fixture_stages, fixture, C.pp2, C.tp1)

test_fixtures_load_without_megatron = FIXTURES.test()


def test_legacy_fixture_pickles_megatron_classes():
    """The fixtures exercise the stand-ins: their args hold megatron-core enums."""
    shard = LEGACY / "gpt_tp2" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    content = load_pickle(shard)
    assert isinstance(content["args"], argparse.Namespace)
    backend = content["args"].attention_backend
    assert isinstance(backend, StandIn) and backend.args == (5,)
    assert type(backend).__module__ == "megatron.core.transformer.enums", type(backend)


def test_names_follow_megatron_core():
    assert megatron_names("word_embeddings.weight") == ("embedding.word_embeddings.weight",)
    assert megatron_names("output_weight") == ("output_layer.weight",)
    assert megatron_names("decoder.layers.3.input_layernorm.bias") == (
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_bias",
        "decoder.layers.3.input_layernorm.bias")
    assert megatron_names("decoder.layers.0.mlp.linear_fc2.weight") == (
        "decoder.layers.0.mlp.linear_fc2.weight",)


def test_other_formats_are_refused(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(MegatronCheckpointError, match="only torch_dist and torch"):
        megatron_format(tmp_path)
    assert megatron_format(tmp_path / "absent") is None
    assert issubclass(CheckpointError, RuntimeError)


class _RunsACommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_restricted_unpickler_runs_nothing(tmp_path):
    """A global the pickle names is never called: os.system becomes an inert StandIn."""
    marker, path = tmp_path / "ran", tmp_path / "model_optim_rng.pt"
    torch.save({"args": argparse.Namespace(lr=1.0), "hook": _RunsACommand(marker)}, path)
    content = load_pickle(path)
    assert isinstance(content["hook"], StandIn) and not marker.exists()
    assert content["args"].lr == 1.0


def test_pretrain_gpt_resumes_a_megatron_checkpoint(tmp_path):
    """`pretrain_gpt.py --load DIR --ckpt-format torch_dist` on 2 gloo ranks at TP=2 resumes the
    legacy GPT fixture at its iteration (3) and trains 4 and 5; its checkpoint carries the
    torch_dist files beside ours."""
    fixture = LEGACY / "gpt_tp2"
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), "--model-preset", "gpt-tiny",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "100",
            "--make-vocab-size-divisible-by", "8", "--mock-data", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "5", "--lr", "1e-3",
            "--log-interval", "1", "--eval-iters", "0", "--tensor-model-parallel-size", "2",
            "--load", str(fixture), "--ckpt-format", "torch_dist", "--save", str(tmp_path)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    ranks = [subprocess.Popen(argv, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank in range(2)]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(outputs)[-4000:]
    log = outputs[0]
    assert "loaded Megatron-LM torch checkpoint" in log and "(iteration 3)" in log, log[-3000:]
    assert not re.search(r"iteration +3/", log) and re.search(r"iteration +5/ +5 \| loss", log)
    assert (tmp_path / "iter_0000005" / "metadata.json").exists()
    assert megatron_format(tmp_path / "iter_0000005") is None  # ours first, for our resume


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("change, message", [
    ({"num_layers": 3}, "no tensor for the model's decoder.layers.2"),
    ({"num_layers": 1}, "tensors the model does not account for: .*decoder.layers.1"),
    ({"vocab_size": 120}, r"embedding.word_embeddings.weight has shape \(112, 32\)"),
    ({"swiglu": True}, r"linear_fc1.weight has shape"),
])
def test_a_checkpoint_of_another_model_is_refused(change, message):
    from megadomino.interop import load_megatron

    expected = torch.load(LEGACY / "gpt_tp2" / "expected.pt", weights_only=True)
    model = GPTModel(ModelConfig(**expected["config"]).replace(**change), ParallelDims(tp=1),
                     "cpu")
    with pytest.raises(MegatronCheckpointError, match=message):
        load_megatron(LEGACY / "gpt_tp2" / "iter_0000003", model, ParallelDims(tp=1))
