"""The iteration log line of pipeline runs (train/report.py), through the training loop: beside
the four phases (rank 0's stage's forward and backward compute, measured inside the schedule,
never a whole step filed under one phase and `backward 0.0`) it reports every stage's compute
and wait per iteration, gathered from every rank, for PP2 under 1F1B and the interleaved
schedule (world 2), PP3 with uneven stages and a --pipeline-plan of a TP=2 stage feeding a TP=1
stage (world 3). Compute is positive on every stage; so is wait (the last stage waits for the
first activation, the first for the first gradient); compute + wait fits in the iteration. A
run without PP keeps its line: the four phases, nothing after them."""

from __future__ import annotations

import re
from pathlib import Path

from test_tp_equivalence import tiny_config

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.config.pipeline_plan import read_plan
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train

PLAN = Path(__file__).parent / "fixtures" / "pipeline_plan_tp2_tp1.json"  # 3 layers, 3 ranks
ITERS = 4
LINE = re.compile(r"iteration +\d+/ +\d+ \|.*\| ([\d.]+) ms/iter \|.*\| time \(ms\): "
                  r"data ([\d.]+) forward ([\d.]+) backward ([\d.]+) optimizer ([\d.]+)(.*)$")
STAGE = re.compile(r"stage (\d+) compute ([\d.]+) wait ([\d.]+)")
SLACK = 1.05, 2.0  # compute + wait <= ms/iter x 1.05 + 2 ms: the ranks' intervals differ a little


def iteration_lines(dims, layers: int, **changes) -> tuple[list[re.Match], dict]:
    """Rank 0's parsed iteration lines (none elsewhere) and the run's history: 4 AdamW steps of
    a tiny GPT, 4 micro-batches of 2 a step, a line every 2 steps."""
    config = make_config(tiny_config("gpt", num_layers=layers, vocab_size=331,
                                     untie_embeddings_and_output_weights=True),
                         micro_batch_size=2, global_batch_size=8, train_iters=ITERS, lr=1e-3,
                         log_interval=2, eval_iters=0, mock_data=True, **changes)
    lines: list[str] = []
    history = train(config, dims, "gpt", log=lines.append)
    matches = [LINE.search(line) for line in lines if "ms/iter" in line]
    assert dims.rank != 0 or (len(matches) == ITERS // 2 and all(matches)), lines
    return matches, history


def check_pipeline_line(dims, layers: int, **changes) -> None:
    matches, history = iteration_lines(dims, layers, pipeline_model_parallel_size=dims.pp,
                                       **changes)
    stages = history["metrics"]["stage_ms"]  # every rank holds the gathered figures
    assert len(stages) == dims.pp and all(compute > 0 for compute, _ in stages), stages
    for match in matches:
        ms_per_iter, _, forward, backward, _ = (float(match[i]) for i in range(1, 6))
        assert forward > 0 and backward > 0, match[0]
        printed = STAGE.findall(match[6])
        assert [int(stage) for stage, _, _ in printed] == list(range(dims.pp)), match[0]
        for stage, compute, wait in printed:
            assert float(compute) > 0 and float(wait) > 0, (stage, match[0])
            assert float(compute) + float(wait) <= ms_per_iter * SLACK[0] + SLACK[1], match[0]
        if len(dims.stages[0][0]) == 1:  # stage 0 is rank 0 alone: its compute is F + B
            assert abs(float(printed[0][1]) - forward - backward) <= 0.15, match[0]


def check_plain_line(dims) -> None:
    matches, history = iteration_lines(dims, 2)
    assert "stage_ms" not in history["metrics"]
    for match in matches:
        assert float(match[4]) > 0 and match[6] == "", match[0]


SUITE = DistSuite(worlds=(2, 3), timeout=300.0)


@SUITE.setup
def _setup(world: int) -> dict:
    if world == 2:
        return {"pp2": ParallelDims(pp=2), "dp2": ParallelDims()}
    return {"pp3": ParallelDims(pp=3), "tp2_tp1": ParallelDims(plan=read_plan(str(PLAN), 3))}


SUITE.case("pp2-1f1b", check_pipeline_line, C.pp2, 4, pipeline_schedule="1f1b", worlds=(2,))
SUITE.case("pp2-interleaved", check_pipeline_line, C.pp2, 4, pipeline_schedule="interleaved",
           virtual_pipeline_model_parallel_size=2, worlds=(2,))
SUITE.case("dp2-no-pp", check_plain_line, C.dp2, worlds=(2,))
SUITE.case("pp3-uneven", check_pipeline_line, C.pp3, 5, pipeline_schedule="eager-1f1b",
           decoder_first_pipeline_num_layers=1, worlds=(3,))
SUITE.case("plan-tp2-tp1", check_pipeline_line, C.tp2_tp1, 3, pipeline_plan=str(PLAN),
           pipeline_schedule="1f1b", worlds=(3,))

test_pipeline_log_line = SUITE.test()
