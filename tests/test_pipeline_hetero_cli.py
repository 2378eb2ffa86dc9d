"""`pretrain_gpt.py --pipeline-plan FILE` on 3 ranks (a TP=2 stage feeding a TP=1 stage): five
AdamW steps whose logged losses, grad norms and validation loss equal the run without PP on the
same global batches (DP 3) within 1e-5; and a bad plan file is one `error:` line naming it,
exit 2, before any process group."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "tests" / "fixtures" / "pipeline_plan_tp2_tp1.json"
COMMON = ["--model-preset", "gpt-tiny", "--num-layers", "3", "--vocab-size", "331",
          "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--mock-data", "--train-iters", "5",
          "--global-batch-size", "6", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "2",
          "--eval-interval", "5"]
LOG_LINE = re.compile(r"iteration +(\d+)/ +\d+ \| loss (\S+) .*\| grad norm (\S+)")
VALIDATION = re.compile(r"validation at iteration \d+ \| loss (\S+)")


def launch(world: int, args: list[str], cwd: Path) -> list[subprocess.Popen]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), *args]
    return [subprocess.Popen(argv, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=cwd,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for rank in range(world)]


def rank0_log(args: list[str], cwd: Path) -> str:
    ranks = launch(3, args, cwd)
    outputs = [rank.communicate(timeout=400)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0, 0], "\n".join(outputs)[-4000:]
    return outputs[0]


def test_cli_training_with_a_plan_equals_no_pp(tmp_path):
    mine = rank0_log([*COMMON, "--pipeline-model-parallel-size", "2", "--pipeline-plan",
                      str(PLAN), "--micro-batch-size", "3"], tmp_path)
    ref = rank0_log([*COMMON, "--micro-batch-size", "1"], tmp_path)
    steps = [LOG_LINE.findall(log) for log in (mine, ref)]
    assert len(steps[0]) == 5 and len(steps[1]) == 5, (mine[-2000:], ref[-2000:])
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(*steps, strict=True):
        for a, b in ((loss, ref_loss), (norm, ref_norm)):
            assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b)), (step, a, b)
    (a,), (b,) = VALIDATION.findall(mine), VALIDATION.findall(ref)
    assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b)), ("validation", a, b)


def test_cli_refuses_a_bad_plan_before_any_process_group(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"stages": [{"ranks": [0, 1], "tp": 2, "layers": [0, 2]},'
                   ' {"ranks": [2], "tp": 1, "layers": [1, 3]}]}')
    (rank,) = launch(1, [*COMMON, "--pipeline-model-parallel-size", "2", "--pipeline-plan",
                         str(bad), "--micro-batch-size", "3"], tmp_path)
    output = rank.communicate(timeout=120)[0]
    assert rank.returncode == 2, output[-2000:]
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert lines == [f"error: --pipeline-plan {bad}: stage 1 starts at layer 1, not 2: the "
                     "layer ranges must be contiguous from 0"], output[-2000:]
