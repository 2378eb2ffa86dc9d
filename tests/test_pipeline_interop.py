"""Checkpoint formats of other projects written and read from pipeline stages, on gloo ranks:

- Megatron-LM's torch_dist written at PP 2 (each stage writes its layers, PP2 at world 2 and
  PP2 x TP2 at world 4; 3 layers split 2 + 1, a vocabulary that pads): megatron-core (a whole
  model at the same TP) loads it with the logits of our model without PP of the same weights
  (fp32, 1e-5), and it loads back into us at PP 1 (same logits) and at another split of PP 2
  (each stage's values equal the whole model's); a training run at PP 2 with --ckpt-format
  torch_dist --save writes files megatron-core loads with the weights of our own files.
- Hugging Face Llama at PP 2 (and PP 2 x TP 2): a directory saved from the model without PP
  loads into the stages with every value equal to that model's; the stages save it back (each
  stage its own files, several per stage) with every tensor and config.json equal to the
  directory saved without PP; a training run from it (`hf_model_init`, as --hf-checkpoint)
  gives the losses, grad norms and weights of the same run without PP (1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_megatron_checkpoint import config_of, our_logits, shared_dir, tokens_of

from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_stage
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.distributed import ParallelDims
from megadomino.interop.hf import load_llama_weights, save_llama
from megadomino.interop.megatron_dist import save_megatron_dist
from megadomino.models.gpt import GPTModel
from megadomino.models.llama import LlamaModel
from megadomino.pipeline.stage import stage_full_state
from megadomino.train.checkpoint import load_checkpoint
from megadomino.train.inputs import hf_model_init

REL = 1e-5
SEED = 5
LAYERS = 3


def _stage(config, dims: ParallelDims, family: str, first: int):
    """This rank's stage of `config` at PP 2 (`first` layers on stage 0), the weights of the
    model without PP drawn from SEED."""
    plan = uniform_plan(config.num_layers, dims.world_size, dims.tp, 2, 1, first)
    return build_stage(config, dims, plan, family, device="cpu", init_seed=SEED)


def _case_torch_dist(family: str, dims: ParallelDims, whole_dims: ParallelDims,
                     root: str) -> None:
    from megatron_reference import build_megatron_gpt, load_megatron_dist, megatron_logits

    config = config_of(family).replace(num_layers=LAYERS)
    directory = shared_dir(root, f"pp-{family}-tp{dims.tp}")
    stage = _stage(config, dims, family, 2)
    target = save_megatron_dist(stage, directory, 7, dims, consumed_train_samples=28)
    torch.manual_seed(SEED)
    whole = GPTModel(config, whole_dims, "cpu")
    tokens = tokens_of(config)
    expected = our_logits(whole, tokens)
    theirs = build_megatron_gpt(config, dims.tp, seed=99)
    common = load_megatron_dist(theirs, str(target))
    assert common["iteration"] == 7 and common["args"].consumed_train_samples == 28
    assert common["args"].pipeline_model_parallel_size == 2
    writers = {path.name.split("_")[2] for path in target.glob("*.distcp")}
    assert writers == {"0", "1"}, writers  # both stages wrote their part
    assert_close(megatron_logits(theirs, tokens, config.vocab_size), expected, REL,
                 f"{family}: ours PP2 TP{dims.tp} -> megatron-core TP{dims.tp}")
    reloaded = GPTModel(config, whole_dims, "cpu")
    state = load_checkpoint(directory, reloaded, whole_dims, log=lambda line: None)
    assert state.iteration == 7
    assert_close(our_logits(reloaded, tokens), expected, REL, f"{family}: PP2 -> PP1")
    other = _stage(config, dims, family, 1)
    with torch.no_grad():
        for param in other.parameters():
            param.zero_()
    load_checkpoint(directory, other, dims, log=lambda line: None)
    reference = dict(_stage(config, dims, family, 1).checkpoint_parameters())
    for name, value in other.checkpoint_parameters():
        assert torch.equal(value, reference[name]), name
    dist.barrier()


def _case_train_saves(dims: ParallelDims, whole_dims: ParallelDims, root: str) -> None:
    """A training run at PP 2 with --ckpt-format torch_dist --save: megatron-core loads its
    torch_dist files with the weights our own files of the same checkpoint hold (read at PP
    1)."""
    from megatron_reference import build_megatron_gpt, load_megatron_dist, megatron_logits

    from configs import make_config
    from megadomino.train.loop import train

    config = config_of("gpt").replace(num_layers=LAYERS)
    saved = f"{root}/trained-tp{dims.tp}"
    run = make_config(config, micro_batch_size=1, global_batch_size=4, train_iters=2, lr=1e-3,
                      lr_warmup_iters=0, log_interval=1, mock_data=True,
                      tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=2,
                      decoder_first_pipeline_num_layers=2, save=saved, save_interval=1,
                      ckpt_format="torch_dist")
    train(run, dims, "gpt", log=lambda line: None)
    ours = GPTModel(config, whole_dims, "cpu")
    assert load_checkpoint(saved, ours, whole_dims, log=lambda line: None).iteration == 2
    theirs = build_megatron_gpt(config, dims.tp, seed=99)
    assert load_megatron_dist(theirs, f"{saved}/iter_0000002")["iteration"] == 2
    tokens = tokens_of(config)
    assert_close(megatron_logits(theirs, tokens, config.vocab_size), our_logits(ours, tokens),
                 REL, "--ckpt-format torch_dist at PP2 -> megatron-core")


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in directory.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    return tensors


def _case_hf(dims: ParallelDims, whole_dims: ParallelDims, root: str) -> None:
    config = config_of("llama").replace(num_layers=LAYERS)
    assert config.untie_embeddings_and_output_weights
    source = shared_dir(root, f"hf-whole-tp{dims.tp}")
    torch.manual_seed(SEED)
    whole = LlamaModel(config, whole_dims, "cpu")
    save_llama(whole, str(source))
    stage = _stage(config, dims, "llama", 2)
    with torch.no_grad():
        for param in stage.parameters():
            param.zero_()
    load_llama_weights(stage, str(source))
    reference = dict(whole.named_parameters())
    held = dict(stage.checkpoint_parameters())
    assert held and set(held) < set(reference)
    for name, value in held.items():
        assert torch.equal(value, reference[name]), name
    saved = shared_dir(root, f"hf-stages-tp{dims.tp}")
    save_llama(stage, str(saved), max_shard_bytes=40_000)
    expected, written = _hf_tensors(source), _hf_tensors(saved)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], expected[name]) for name in expected)
    assert json.loads((saved / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text())
    weight_map = json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2, weight_map
    _hf_training(config, dims, whole_dims, str(source))


def _hf_training(config, dims: ParallelDims, whole_dims: ParallelDims, source: str) -> None:
    """Three SGD steps from the HF weights at PP 2 and without PP: the same losses, grad norms
    and weights (1e-5)."""
    from configs import make_config
    from megadomino.train.loop import train

    runs = []
    for run_dims, pipeline in ((whole_dims, {}), (dims, dict(
            pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2))):
        run = make_config(config, micro_batch_size=1, global_batch_size=4, train_iters=3,
                          optimizer="sgd", lr=0.5, lr_warmup_iters=0, log_interval=1,
                          mock_data=True, tensor_model_parallel_size=dims.tp, **pipeline)
        runs.append(train(run, run_dims, "llama", log=lambda line: None,
                          model_init=hf_model_init(source)))
    ref, mine = runs
    for what in ("losses", "grad_norms"):
        for a, b in zip(mine[what], ref[what], strict=True):
            assert abs(a - b) <= REL * abs(b), (what, a, b)
    reference = ref["model"].full_state_dict()
    for name, value in stage_full_state(mine["model"]).items():
        assert_close(value, reference[name], REL, name)


SUITE = DistSuite(worlds=(2, 4), timeout=400.0)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    tp = world // 2
    return {"pp2": ParallelDims(tp=tp, pp=2), "whole": ParallelDims(tp=tp), "root": root}


for family in ("gpt", "llama"):
    SUITE.case(f"torch-dist-{family}", _case_torch_dist, family, C.pp2, C.whole, C.root,
               requires="megatron")
SUITE.case("hugging-face", _case_hf, C.pp2, C.whole, C.root, requires="safetensors")
SUITE.case("train-saves-torch-dist", _case_train_saves, C.pp2, C.whole, C.root,
           requires="megatron", worlds=(2,))


@pytest.fixture(scope="module")
def interop_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("pipeline_interop")),)


test_pipeline_interop = SUITE.test(args_fixture="interop_root")
