"""A run says what it is: the start-up summary's lines (pure), its parameter count against the
dense model's at TP=2 with a padded vocabulary, logged by rank 0 only from train() (2 gloo
ranks), and progress lines for a long phase (a fake clock)."""

from __future__ import annotations

import torch.distributed as dist

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.build import build_model
from megadomino.config import Config, ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train
from megadomino.train.progress import Progress
from megadomino.train.summary import count_parameters, startup_lines


def _lines(config: Config, **grid) -> str:
    world = grid.get("world", 8)
    return "\n".join(startup_lines(
        "llama", config, 123_456, world=world, tp=grid.get("tp", 2), pp=1,
        dp=grid.get("dp", 4), backend="nccl", device="NVIDIA H100",
        global_batch=grid.get("global_batch", 16), micro_batches=grid.get("micro_batches", 2),
        iterations=config.train.schedule.train_iters, data="mock data"))


def _assert_says(text: str, parts: tuple[str, ...]) -> None:
    for part in parts:
        assert part in text, (part, text)


def test_startup_lines_name_what_the_run_is():
    config = make_config(ModelConfig.preset("llama-tiny"), sequence_parallel=True,
                         batch_slices=2, bf16=True, micro_batch_size=2, train_iters=10,
                         mock_data=True, stage=3)
    text = _lines(config)
    assert text.count("\n") == 3 and text.startswith(" model: llama, ")
    _assert_says(text, (
        "llama, 2 layers, hidden 64, 4 heads (2 key/value groups), ffn 176, seq 64, vocab 512 "
        "(padded to 512): 123,456 parameters (123K)",
        "8 ranks = TP 2 x PP 1 x DP 4, nccl on NVIDIA H100",
        "TP overlap: domino 2x1; sequence parallel",
        "ZeRO stage 3 (parameters, gradients, optimizer states and fp32 masters sharded over DP,"
        " units of 200M parameters)", "precision: bf16",
        "data: mock data; global batch 16 = micro-batch 2 x 2 micro-batches x DP 4 (1,024 tokens)",
        "10 iterations"))


def test_startup_lines_name_the_engine_options_and_the_layout():
    layout = dict(tp_comm_overlap=True, sequence_parallel=True, recompute_granularity="full",
                  recompute_method="uniform", recompute_num_layers=1, format="hybrid",
                  micro_batch_size=1, train_iters=1, mock_data=True)
    config = make_config(ModelConfig.preset("llama-tiny"), **layout, stage=1,
                         quantized_gradients=True, gradient_bits=8, layers_per_unit=2)
    text = _lines(config, world=1, tp=1, dp=1, global_batch=1, micro_batches=1)
    _assert_says(text, (
        "1 rank = TP 1 x PP 1 x DP 1", "TP overlap: fused-sp; sequence parallel, recompute full "
        "(uniform, 1 layer)", "ZeRO stage 1 (optimizer states and fp32 masters sharded over DP, "
        "qgZ int8 gradients, blocks of 2048, 2 layers a unit)",
        "precision: fp32, FP8 hybrid (delayed scaling)", "x 1 micro-batch x DP 1 (64 tokens); "
        "1 iteration"))
    plain = _lines(make_config(ModelConfig.preset("llama-tiny"), **layout,
                               bucket_numel=40_000_000))
    assert "ZeRO stage 0 (plain data parallelism: all-reduce in buckets of 40M elements, " \
        "overlapped with backward)" in plain, plain


def test_progress_speaks_only_for_long_phases():
    now = [0.0]
    lines: list[str] = []
    progress = Progress(lines.append, "validation at iteration 5", 100, "batches",
                        clock=lambda: now[0])
    for done in range(1, 100):
        now[0] += 0.5  # 50 s in all
        progress.tick(done)
    assert lines[0] == " validation at iteration 5: 100 batches"
    assert lines[1] == " validation at iteration 5: 10/100 batches in 5 s"
    assert len(lines) == 6 and lines[-1].endswith("90/100 batches in 45 s"), lines
    quiet: list[str] = []
    short = Progress(quiet.append, "x", 3, "batches", clock=lambda: 0.0)
    for done in (1, 2, 3):
        short.tick(done)
    assert quiet == [" x: 3 batches"]
    Progress(None, "other ranks say nothing", 3, "batches").tick(1)


# ---- 2 gloo ranks ------------------------------------------------------------------------------

CONFIG = ModelConfig.preset("gpt-tiny", vocab_size=301, untie_embeddings_and_output_weights=True,
                            seq_length=16)
"""Vocabulary 301: padded rows on one TP rank only; untied: two padded weights."""


def _dense_count(dense: ParallelDims) -> int:
    """The TP=1 model's numel less its vocabulary padding rows (two weights of hidden-size
    rows)."""
    padding = (CONFIG.padded_vocab_size(1) - CONFIG.vocab_size) * CONFIG.hidden_size * 2
    assert padding > 0
    return sum(p.numel() for p in build_model(CONFIG, dense, "gpt").parameters()) - padding


def check_parameter_count(dims: ParallelDims, dense: ParallelDims) -> None:
    assert dist.get_world_size() == 2 and dims.tp == 2
    assert count_parameters(build_model(CONFIG, dims, "gpt"), dims) == _dense_count(dense)


def check_only_rank_0_says_it(dims: ParallelDims, dense: ParallelDims) -> None:
    """train() at TP=2: rank 0 logs the summary with the dense model's count, rank 1 nothing."""
    lines: list[str] = []
    config = make_config(CONFIG, tensor_model_parallel_size=2, micro_batch_size=2,
                         train_iters=1, eval_iters=0, mock_data=True)
    train(config, dims, "gpt", log=lines.append)
    if dims.rank != 0:
        assert lines == [], lines
        return
    model_line = lines[0]
    assert model_line.startswith(" model: gpt, 2 layers, hidden 64"), lines
    assert f": {_dense_count(dense):,} parameters (" in model_line, model_line
    assert lines[1].startswith(" parallelism: 2 ranks = TP 2 x PP 1 x DP 1, gloo on CPU"), lines
    assert lines[3].startswith(" data: mock data; global batch 2 = micro-batch 2 x "), lines


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"tp": ParallelDims(tp=world), "dense": ParallelDims(tp=1)}


SUITE.case("parameter-count", check_parameter_count, C.tp, C.dense)
SUITE.case("only-rank-0", check_only_rank_0_says_it, C.tp, C.dense)

test_run_summary = SUITE.test()
