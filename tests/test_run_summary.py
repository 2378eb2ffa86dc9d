"""A run says what it is: the start-up summary's lines (pure: the grid, a uniform and a
heterogeneous pipeline plan's table, the LR schedule, seed, paths, sample counts, CPU threads),
its parameter count against the dense model's at TP=2 with a padded vocabulary, logged by rank 0
only from train() (2 gloo ranks), which ends with the end-of-run line (and a pretrain_gpt.py run
stopped by --exit-interval with it, naming its checkpoint), and progress lines for a long phase
(a fake clock)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.build import build_model
from megadomino.config import Config, ModelConfig
from megadomino.config.pipeline_plan import PipelinePlan, read_plan, uniform_plan
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train
from megadomino.train.progress import Progress
from megadomino.train.report import Reporter
from megadomino.train.summary import count_parameters, startup_lines

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "tests" / "fixtures" / "pipeline_plan_tp2_tp1.json"


def _lines(config: Config, plan: PipelinePlan | None = None, threads: int | None = None,
           **grid) -> str:
    world = grid.get("world", 8)
    return "\n".join(startup_lines(
        "llama", config, 123_456, world=world, tp=grid.get("tp", 2), pp=grid.get("pp", 1),
        dp=grid.get("dp", 4), backend="nccl", device="NVIDIA H100",
        global_batch=grid.get("global_batch", 16), micro_batches=grid.get("micro_batches", 2),
        iterations=config.train.schedule.train_iters, data="mock data", plan=plan,
        threads=threads))


def _assert_says(text: str, parts: tuple[str, ...]) -> None:
    for part in parts:
        assert part in text, (part, text)


def test_startup_lines_name_what_the_run_is():
    config = make_config(ModelConfig.preset("llama-tiny"), sequence_parallel=True,
                         batch_slices=2, bf16=True, micro_batch_size=2, train_iters=10,
                         mock_data=True, stage=3)
    text = _lines(config)
    assert text.count("\n") == 5 and text.startswith(" model: llama, ")
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


def test_a_uniform_pipeline_prints_its_grid_and_table():
    config = make_config(ModelConfig.preset("llama-tiny"), tensor_model_parallel_size=2,
                         pipeline_model_parallel_size=2, micro_batch_size=2, train_iters=10,
                         mock_data=True)
    lines = _lines(config, uniform_plan(2, 8, 2, 2), pp=2, dp=2, global_batch=8).splitlines()
    assert lines[1].startswith(" parallelism: 8 ranks = TP 2 x PP 2 x DP 2, nccl on NVIDIA H100"
                               "; TP overlap: none; pipeline schedule "), lines
    assert lines[2:4] == [" pipeline stage 0: ranks [0, 1, 2, 3] tp 2 layers [0, 1)",
                          " pipeline stage 1: ranks [4, 5, 6, 7] tp 2 layers [1, 2)"], lines
    assert "global batch 8 = micro-batch 2 x 2 micro-batches x DP 2 (512 tokens)" in lines[5]


def test_a_heterogeneous_plan_claims_no_uniform_grid():
    config = make_config(ModelConfig.preset("gpt-tiny", num_layers=3), micro_batch_size=3,
                         pipeline_model_parallel_size=2, pipeline_plan=str(PLAN), train_iters=5,
                         global_batch_size=6, mock_data=True)
    plan = read_plan(config.parallel.pipeline_plan, 3)
    lines = _lines(config, plan, world=3, tp=2, pp=2, dp=1, global_batch=6).splitlines()
    assert lines[1].startswith(" parallelism: 3 ranks in a pipeline plan of 2 stages "
                               "(--pipeline-plan): stage 0 TP 2 x DP 1 on ranks 0-1, stage 1 "
                               "TP 1 x DP 1 on rank 2, nccl on NVIDIA H100;"), lines
    assert "TP 2 x PP 2" not in "\n".join(lines)
    assert lines[2:4] == [" pipeline stage 0: ranks [0, 1] tp 2 layers [0, 2)",
                          " pipeline stage 1: ranks [2] tp 1 layers [2, 3)"], lines
    assert "global batch 6 = micro-batch 3 x 2 micro-batches (each stage splits them over its " \
        "DP ranks) (384 tokens)" in lines[5], lines


def test_schedule_seed_paths_and_samples_lines():
    common = dict(micro_batch_size=2, global_batch_size=16, eval_interval=25, eval_iters=2,
                  lr=3e-4, min_lr=3e-5)
    config = make_config(ModelConfig.preset("llama-tiny"), **common, train_iters=100,
                         mock_data=True, lr_warmup_iters=10, lr_decay_iters=80,
                         lr_decay_style="cosine", seed=7, save="ckpt", save_interval=50,
                         load="old", tensorboard_dir="tb")
    lines = _lines(config).splitlines()
    assert lines[4:] == [
        " samples: train 1,600, validation 160, test not read; mock data, generated as read",
        " schedule: lr warmup over 10 iterations to 3.000E-04, cosine decay to 3.000E-05 at "
        "iteration 80; seed 7",
        " paths: --save ckpt (every 50 iterations and at the end), --load old, "
        "--tensorboard-dir tb"], lines
    by_samples = make_config(ModelConfig.preset("llama-tiny"), **common, train_samples=3200,
                             lr_warmup_samples=0, lr_decay_style="WSD",
                             lr_wsd_decay_samples=800, lr_wsd_decay_style="linear",
                             decoupled_lr=1e-3, save="ckpt", data_path=["corpus"])
    lines = _lines(by_samples).splitlines()
    assert lines[4:] == [
        " samples: train 3,200, validation 288, test not read",
        " schedule: lr 3.000E-04, held until sample 2,400, linear decay to 3.000E-05 at sample "
        "3,200 (embedding and output layer: 1.000E-03 to 3.000E-05); seed 1234",
        " paths: --save ckpt (at the end)"], lines
    constant = make_config(ModelConfig.preset("llama-tiny"), micro_batch_size=2, train_iters=4,
                           global_batch_size=16, eval_iters=0, mock_data=True,
                           lr_decay_style="constant")
    lines = _lines(constant).splitlines()
    assert len(lines) == 6 and lines[4].startswith(" samples: train 64, validation 0 (no "
                                                    "evaluation), test not read"), lines
    assert lines[5].startswith(" schedule: lr ") and lines[5].endswith(", then constant; "
                                                                      "seed 1234"), lines


def test_a_cpu_run_says_its_intra_op_threads():
    config = make_config(ModelConfig.preset("llama-tiny"), micro_batch_size=2, train_iters=1,
                         mock_data=True)
    assert "nccl on NVIDIA H100 (4 intra-op threads a rank); TP overlap" in _lines(config,
                                                                                  threads=4)
    assert "(1 intra-op thread a rank)" in _lines(config, threads=1)
    assert "intra-op" not in _lines(config)


def test_a_run_stopped_by_exit_interval_ends_with_the_end_of_run_line(tmp_path):
    """pretrain_gpt.py, one process: --exit-interval stops it at iteration 3 of 6; its last line
    names the stop, the last log line's loss, the last validation and the checkpoint saved."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), "--model-preset", "gpt-tiny",
         "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
         "6", "--lr", "1e-3", "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
         "--exit-interval", "3", "--save", "ckpt"], cwd=tmp_path, capture_output=True, text=True,
        timeout=300, env=dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    logged = re.findall(r"iteration +(\d+)/ +6 \| loss (\S+)", done.stdout)
    assert [step for step, _ in logged] == ["2", "3"], done.stdout[-3000:]
    assert re.fullmatch(
        r" run ended: iterations 1-3 of 6 in [\d.]+ s, \d+ tokens/s \| stopped early: "
        r"--exit-interval=3 reached at iteration 3 \| train loss " + re.escape(logged[-1][1])
        + r" \| validation loss \S+ \(iteration 2\) \| checkpoint ckpt/iter_0000003",
        lines[-1]), lines[-3:]
    assert (tmp_path / "ckpt" / "iter_0000003").is_dir()


def test_the_end_of_run_line_says_only_what_the_run_did():
    """A run resumed at its last iteration ran none: no loss, no tokens/s, no checkpoint
    claimed; one that ran names its mean tokens/s, validation and TensorBoard directory."""
    lines: list[str] = []
    history = {"losses": [], "lrs": [], "eval": [], "metrics": {}, "exit_reason": None}
    engine = SimpleNamespace(comm=SimpleNamespace(reset=lambda: None))
    reporter = Reporter(history, SimpleNamespace(rank=0), torch.device("cpu"), lines.append, 10,
                        1.0, 4, 16, None, None, None, engine)
    reporter.finish(10, "ckpt", "tb")
    assert re.fullmatch(r" run ended: no iteration left at 10 of 10 in [\d.]+ s \| "
                        r"TensorBoard events in tb", lines[-1]), lines
    history.update(losses=[3.0, 2.5], metrics={"loss": 2.5},
                   eval=[{"iteration": 2, "loss": 2.75, "ppl": 15.6}])
    reporter.timed_seconds, reporter.timed_tokens = 2.0, 1000
    line = reporter.end_line(2, None, None)
    assert re.fullmatch(r" run ended: iterations 1-2 of 10 in [\d.]+ s, 500 tokens/s "
                        r"\| train loss 2.500000E\+00 \| validation loss 2.750000E\+00 "
                        r"\(iteration 2\)", line), line
    reporter.dims = SimpleNamespace(rank=1)
    reporter.finish(2, None, None)
    assert len(lines) == 1, lines


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
    """train() at TP=2: rank 0 logs the summary with the dense model's count and its CPU
    threads, and ends with the end-of-run line (the last log interval's mean loss: iteration 3
    alone); rank 1 says nothing."""
    lines: list[str] = []
    config = make_config(CONFIG, tensor_model_parallel_size=2, micro_batch_size=2,
                         train_iters=3, log_interval=2, eval_iters=0, mock_data=True)
    history = train(config, dims, "gpt", log=lines.append)
    if dims.rank != 0:
        assert lines == [], lines
        return
    model_line = lines[0]
    assert model_line.startswith(" model: gpt, 2 layers, hidden 64"), lines
    assert f": {_dense_count(dense):,} parameters (" in model_line, model_line
    threads = torch.get_num_threads()
    assert lines[1].startswith(" parallelism: 2 ranks = TP 2 x PP 1 x DP 1, gloo on CPU "
                               f"({threads} intra-op thread"), lines
    assert lines[3].startswith(" data: mock data; global batch 2 = micro-batch 2 x "), lines
    end = re.fullmatch(r" run ended: iterations 1-3 of 3 in [\d.]+ s, \d+ tokens/s \| "
                       r"train loss (\S+)", lines[-1])
    assert end is not None, lines[-1]
    assert history["metrics"]["loss"] == history["losses"][-1]
    assert end[1] == f"{history['losses'][-1]:.6E}", (end[1], history["losses"])
    assert sum(line.startswith(" run ended") for line in lines) == 1, lines


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"tp": ParallelDims(tp=world), "dense": ParallelDims(tp=1)}


SUITE.case("parameter-count", check_parameter_count, C.tp, C.dense)
SUITE.case("only-rank-0", check_only_rank_0_says_it, C.tp, C.dense)

test_run_summary = SUITE.test()
