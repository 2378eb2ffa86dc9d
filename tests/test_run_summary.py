"""A run says what it is: the start-up summary's lines (pure), its parameter count against the
dense model's at TP=2 with a padded vocabulary (2 gloo ranks), and progress lines for a long
phase (a fake clock)."""

from __future__ import annotations

import torch.distributed as dist

from dist_utils import C, DistSuite
from megadomino.config import ModelConfig, TrainConfig
from megadomino.models import build_model
from megadomino.parallel import ParallelDims
from megadomino.training.progress import Progress
from megadomino.training.summary import count_parameters, startup_lines
from megadomino.zero import ZeroConfig


def test_startup_lines_name_what_the_run_is():
    model = ModelConfig.preset("llama-tiny", sequence_parallel=True, domino_batch_slices=2)
    train = TrainConfig(bf16=True, micro_batch_size=2, train_iters=10, mock_data=True)
    lines = startup_lines("llama", model, train, 123_456, world=8, tp=2, pp=1, dp=4,
                          backend="nccl", device="NVIDIA H100", zero=ZeroConfig(stage=3),
                          global_batch=16, micro_batches=2, iterations=10, data="mock data")
    text = "\n".join(lines)
    for part in ("llama, 2 layers, hidden 64", "(padded to 512)", "123.46K parameters",
                 "8 ranks = TP 2 x PP 1 x DP 4, nccl on NVIDIA H100",
                 "TP overlap: domino 2x1, sequence parallel", "ZeRO stage 3", "precision: bf16",
                 "global batch 16 = micro-batch 2 x 2 micro-batches x DP 4 (1024 tokens)",
                 "10 iterations"):
        assert part in text, (part, text)


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


def check_parameter_count(dims: ParallelDims, dense: ParallelDims) -> None:
    """At TP=2 with vocabulary 301 (padded rows on one rank) and an untied output layer, the
    count equals the TP=1 model's numel less its vocabulary padding rows (two weights of
    hidden-size rows)."""
    config = ModelConfig.preset("gpt-tiny", vocab_size=301,
                                untie_embeddings_and_output_weights=True)
    padding = (config.padded_vocab_size(1) - 301) * config.hidden_size * 2
    assert padding > 0
    want = sum(p.numel() for p in build_model(config, dense, "gpt").parameters()) - padding
    assert count_parameters(build_model(config, dims, "gpt"), dims) == want
    assert dist.get_world_size() == 2


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"tp": ParallelDims(tp=world), "dense": ParallelDims(tp=1)}


SUITE.case("parameter-count", check_parameter_count, C.tp, C.dense)

test_run_summary = SUITE.test()
