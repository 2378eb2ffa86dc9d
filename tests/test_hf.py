"""HF Llama interop against `transformers` itself: a tiny random LlamaForCausalLM with GQA (8 heads,
4 key/value heads) and an odd vocabulary (509, padded), saved with save_pretrained as one
safetensors file and as several, is loaded with load_llama at TP=1 and TP=2 (2 gloo ranks, one
spawn): logits equal HF's within 1e-4 relative in fp32. save_llama writes it back (from TP=2, one
file and sharded) and transformers re-loads tensors identical to the original. Config parsing
(old and new RoPE keys, refusals) and error messages run in-process."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil

import pytest
import torch

from dist_utils import C, DistSuite, assert_close, check_result
from megadomino.config import ConfigError
from megadomino.distributed import ParallelDims
from megadomino.interop.hf import SafetensorsReader, load_llama, read_hf_config, save_llama
from megadomino.interop.hf_config import hf_config_from, model_config_from_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL = 1e-4
ROPE_THETA = 5000.0  # not the default, so that a dropped key shows in the logits
SHARD_BYTES = 40_000  # several files for the tiny model


def _load_converter():
    spec = importlib.util.spec_from_file_location(
        "convert_hf_llama", os.path.join(REPO, "scripts", "convert_hf_llama.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert_hf_llama = _load_converter()


def _transformers():
    """transformers, imported where a test needs it: not at module level, so that the spawned
    ranks (which import this module) do not pay for it; skips the test without it."""
    return pytest.importorskip("transformers")


def tiny_hf_model():
    transformers = _transformers()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=509, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA, tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # HF inits norms to 1: make a swap visible
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory) -> dict:
    """The HF model, its two directories (one file, sharded), sample tokens with the HF logits,
    and the output directories (one under a file, so that writing there fails)."""
    root = tmp_path_factory.mktemp("hf")
    model = tiny_hf_model()
    single, sharded = str(root / "single"), str(root / "sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size=SHARD_BYTES)
    tokens = torch.randint(0, 509, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    out = {"single": str(root / "out_single"), "sharded": str(root / "out_sharded"),
           "checkpoint": str(root / "checkpoint_tp2"), "blocked": str(root / "a_file" / "hf")}
    (root / "a_file").write_text("not a directory")
    return {"model": model, "inputs": (single, sharded, tokens, logits, out)}


@pytest.fixture(scope="module")
def hf_inputs(hf_files) -> tuple:
    return hf_files["inputs"]


@pytest.fixture(scope="module")
def hf_setup(hf_files, hf_inputs):
    """The HF model, its directories, the output directories and the spawned cases' results."""
    single, sharded, _, _, out = hf_inputs
    return hf_files["model"], single, sharded, out, SUITE.results(2, *hf_inputs)


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int, single: str, sharded: str, tokens: torch.Tensor, logits: torch.Tensor,
           out: dict[str, str]) -> dict:
    return {"dims": {1: ParallelDims(tp=1), 2: ParallelDims(tp=2)}, "models": {},
            "tokens": tokens, "logits": logits, "out": out, "single": single, "sharded": sharded}


def _parity(ctx: dict, kind: str, tp: int) -> None:
    """Load the HF directory `kind` at TP=tp (kept for the save cases) and compare logits."""
    ctx["models"][tp] = load_llama(ctx[kind], ctx["dims"][tp]).eval()
    with torch.no_grad():
        assert_close(ctx["models"][tp](ctx["tokens"]), ctx["logits"], REL,
                     f"logits at TP={tp} from {ctx[kind]}")


def _save(ctx: dict, kind: str, **kwargs) -> None:
    save_llama(ctx["models"][2], ctx["out"][kind], **kwargs)


def _save_fails_on_every_rank(ctx: dict) -> None:
    with pytest.raises(OSError, match="rank 0 could not write into .*a_file"):
        save_llama(ctx["models"][2], ctx["out"]["blocked"])


def _convert_tp2(ctx: dict) -> None:
    convert_hf_llama.hf_to_megadomino(ctx["sharded"], ctx["out"]["checkpoint"], ctx["dims"][2],
                                      "float32")


for tp in (1, 2):
    for kind in ("single", "sharded"):
        SUITE.case(f"parity_tp{tp}_{kind}", _parity, C.all, kind, tp)
SUITE.case("save_single", _save, C.all, "single")
SUITE.case("save_sharded", _save, C.all, "sharded", max_shard_bytes=SHARD_BYTES)
SUITE.case("save_error", _save_fails_on_every_rank, C.all)
SUITE.case("convert_tp2", _convert_tp2, C.all)

test_load_parity_save_and_convert_at_tp1_and_tp2 = SUITE.test(args_fixture="hf_inputs")


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_saved_back_reloads_identical(hf_setup, kind):
    original, *_, out, results = hf_setup
    check_result(results, f"save_{kind}")
    files = sorted(os.listdir(out[kind]))
    if kind == "sharded":
        assert "model.safetensors.index.json" in files and len(files) > 3, files
    else:
        assert files == ["config.json", "model.safetensors"], files
    reloaded = _transformers().LlamaForCausalLM.from_pretrained(out[kind]).float()
    # transformers 5 reads the base from rope_parameters, 4.x from rope_theta: both are written
    rope = getattr(reloaded.config, "rope_parameters", None) or {}
    assert rope.get("rope_theta", getattr(reloaded.config, "rope_theta", None)) == ROPE_THETA
    assert reloaded.config.num_key_value_heads == 4
    expected, actual = original.state_dict(), reloaded.state_dict()
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def hf_dict(**changes) -> dict:
    config = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, max_position_embeddings=64, vocab_size=509)
    config.update(changes)
    return config


@pytest.mark.parametrize("rope_keys", [
    {"rope_theta": 500000.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    {"rope_scaling": {"rope_type": "default", "rope_theta": 500000.0}},
    {"rope_theta": 1.0, "rope_parameters": {"rope_theta": 500000.0}},
])
def test_rope_theta_old_and_new_keys(rope_keys):
    assert model_config_from_hf(hf_dict(**rope_keys)).rotary_base == 500000.0


def test_config_defaults_and_round_trip():
    config = model_config_from_hf(hf_dict(rms_norm_eps=1e-6), seq_length=32)
    assert config.num_query_groups == 8  # no num_key_value_heads: multi-head attention
    assert config.rotary_base == 10000.0
    assert (config.seq_length, config.max_position_embeddings) == (32, 64)
    assert config.norm_epsilon == 1e-6 and config.ffn_hidden_size == 96
    assert model_config_from_hf(hf_config_from(config), seq_length=32) == config


@pytest.mark.parametrize("changes, message", [
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral"}, "mistral"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_unsupported_configs_refused(changes, message):
    config = {k: v for k, v in hf_dict(**changes).items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(config)


def test_missing_files_and_tensors_named(hf_setup, tmp_path):
    _, single, sharded, *_ = hf_setup
    with pytest.raises(ConfigError, match="config.json"):
        load_llama(str(tmp_path), dims=None)
    broken = shutil.copytree(sharded, tmp_path / "no_shard")
    with open(broken / "model.safetensors.index.json") as f:
        first_file = sorted(set(json.load(f)["weight_map"].values()))[0]
    os.remove(broken / first_file)
    with pytest.raises(ConfigError, match=first_file):
        load_llama(str(broken), dims=None)
    with pytest.raises(ConfigError, match=r"missing .*model\.layers\.2\."):
        load_llama(single, dims=None, num_layers=3)
    with pytest.raises(ConfigError, match=r"gate_proj\.weight has shape \(96, 64\) .* \(128, 64\)"):
        load_llama(single, dims=None, ffn_hidden_size=128)


def test_converter_round_trip_through_a_tp2_checkpoint(hf_setup, tmp_path):
    """HF -> release checkpoint written at TP=2 (2 ranks) -> HF at TP=1 (re-sharded on load):
    the safetensors hold the original tensors."""
    from safetensors.torch import load_file

    original, single, _, out, results = hf_setup
    check_result(results, "convert_tp2")
    assert os.path.exists(os.path.join(out["checkpoint"], "release", "mp_rank_01"))
    hf_dir = str(tmp_path / "hf")
    assert convert_hf_llama.main(["megadomino-to-hf", "--load", out["checkpoint"],
                                  "--hf-dir", hf_dir]) == 0
    expected = load_file(os.path.join(single, "model.safetensors"))
    actual = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_converter_refuses_a_directory_without_checkpoint(tmp_path, capsys):
    code = convert_hf_llama.main(["megadomino-to-hf", "--load", str(tmp_path),
                                  "--hf-dir", str(tmp_path / "hf")])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(error) == 1 and error[0].startswith("error: "), error
    assert "not a megadomino" in error[0], error


def test_converter_reads_a_config_with_fields_it_does_not_know(tmp_path):
    """A checkpoint from a newer writer may carry run options this version lacks."""
    config = model_config_from_hf(hf_dict())
    shard = tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt"
    shard.parent.mkdir(parents=True)
    torch.save({"format": 1,
                "model_config": dict(dataclasses.asdict(config), some_future_option=True)}, shard)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert convert_hf_llama.saved_model_config(str(tmp_path)) == config


def test_broken_hf_files_are_named(hf_files, tmp_path):
    """A config.json that is not JSON and a truncated safetensors file are errors naming the
    file (raw JSONDecodeError / SafetensorError tracebacks otherwise)."""
    single = hf_files["inputs"][0]
    broken = tmp_path / "broken"
    shutil.copytree(single, broken)
    (broken / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON \(.* line 1"):
        read_hf_config(str(broken))
    shutil.copy(os.path.join(single, "config.json"), broken / "config.json")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ConfigError, match="model.safetensors is not a readable safetensors"):
        SafetensorsReader(str(broken))
