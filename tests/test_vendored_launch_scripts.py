"""Real launch scripts, only the entry point changed: Megatron-LM's examples (2024 and current),
DeepSpeed-Domino's four scripts and the Llama scripts of Megatron-DeepSpeed and ROCm/Megatron-LM
(their entry point and arguments are transcribed in tests/launch_scripts/argv.json, with the
repository, commit and path of each, and the DeepSpeed JSON a Megatron-DeepSpeed script writes
before it launches), cut to CPU sizes (the shape, batch and length flags get small values, the
JSON's batch sizes the same ones; data and tokenizer flags become --mock-data), run on 2 gloo
ranks in a fresh directory holding the JSON at the path the script passes, under
torchrun's environment and under the deepspeed launcher's (LOCAL_SIZE, not LOCAL_WORLD_SIZE, and
`--local_rank=N` appended to the arguments).

Every script trains: none of their flags is refused (what runs differently here is a notice, one
line a flag, printed once)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {name: entry for name, entry in json.loads(
    (ROOT / "tests" / "launch_scripts" / "argv.json").read_text()).items() if name[0] != "_"}
CPU = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4",
       "--ffn-hidden-size": "128", "--seq-length": "32", "--max-position-embeddings": "32",
       "--kv-channels": "16", "--num-query-groups": "2", "--num-key-value-heads": "2",
       "--micro-batch-size": "1", "--global-batch-size": "2", "--train-iters": "2",
       "--train-samples": "4", "--lr-warmup-iters": "1", "--eval-iters": "1",
       "--eval-interval": "2", "--save-interval": "2", "--log-interval": "1",
       "--tensor-model-parallel-size": "2", "--vocab-size": "1000",
       "--step-batch-size-schedule": "0:1 32:2"}
"""Flags whose values are cut to CPU size (2 ranks: TP=2; a script with pipeline stages runs
PP=2 at TP=1 instead, see `cut`); a stepped batch schedule becomes batch 1, then 2 from the
second sample (32 tokens) on. A negative --eval-iters stays: it is Megatron-LM's "no evaluation",
a meaning rather than a size."""
DATA = ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model",
        "--data-cache-path", "--split")
"""Flags naming data the test does not have, with their values (a blend's weights and paths):
replaced by --mock-data."""
JSON_CPU = {"train_batch_size": "--global-batch-size",
            "train_micro_batch_size_per_gpu": "--micro-batch-size"}
"""A DeepSpeed JSON's batch keys, cut to their flags' CPU sizes: the JSON and the flags keep
agreeing, as they do in the scripts (a micro-batch that differs is an error, and a global batch
that differs loses to the flag, so a JSON left at full size would test the disagreement rules
rather than the script)."""


def write_files(name: str, directory: Path) -> None:
    """The files the script writes before it launches, at CPU size, under `directory`."""
    for path, content in SCRIPTS[name].get("files", {}).items():
        cut_content = {key: int(CPU[JSON_CPU[key]]) if key in JSON_CPU else value
                       for key, value in content.items()}
        (directory / path).parent.mkdir(parents=True, exist_ok=True)
        (directory / path).write_text(json.dumps(cut_content))


def family(name: str) -> str:
    return "llama" if SCRIPTS[name]["entry"] == "pretrain_llama.py" else "gpt"


def cut(argv: list[str]) -> list[str]:
    """`argv` at CPU size, its data replaced by mock data."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in DATA:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
        elif argv[i] in CPU and not (argv[i] == "--eval-iters" and int(argv[i + 1]) < 0):
            out += [argv[i], CPU[argv[i]]]
            i += 2
        else:
            out.append(argv[i])
            i += 1
    if "--pipeline-model-parallel-size" in out:  # 2 ranks: the stages, not TP
        at = out.index("--pipeline-model-parallel-size") + 1
        if out[at] != "1":
            out[at] = "2"
            out[out.index("--tensor-model-parallel-size") + 1] = "1"
    return out + ([] if "--mock-data" in out else ["--mock-data"]) + (
        [] if "--vocab-size" in out else ["--vocab-size", "1000"])


RUNNABLE = sorted(SCRIPTS)


def test_every_transcribed_script_is_accounted_for():
    assert len(SCRIPTS) >= 13
    assert all(SCRIPTS[name]["launcher"] in ("torchrun", "deepspeed") for name in SCRIPTS)


def _launches() -> list:
    """Every runnable script under both launchers; under the launcher other than its own (the
    same environment translation, already run by the scripts transcribed with that launcher) in
    the slow tier."""
    return [pytest.param(name, launcher, marks=() if launcher == SCRIPTS[name]["launcher"]
                         else pytest.mark.slow)
            for name in RUNNABLE for launcher in ("torchrun", "deepspeed")]


def test_both_launchers_run_in_the_default_tier():
    assert {SCRIPTS[name]["launcher"] for name in RUNNABLE} == {"torchrun", "deepspeed"}
    assert {family(name) for name in RUNNABLE} == {"gpt", "llama"}


@pytest.mark.parametrize("name, launcher", _launches())
def test_script_trains_under_both_launchers(name, launcher, tmp_path):
    """2 iterations on 2 gloo ranks, launched as torchrun or the deepspeed launcher would: both
    ranks exit 0 and rank 0 logs both iterations."""
    script = SCRIPTS[name]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("LOCAL_WORLD_SIZE", None)
    write_files(name, tmp_path)
    argv = [sys.executable, str(ROOT / script["entry"]), *cut(script["argv"])]
    ranks = []
    for rank in range(2):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        rank_argv = list(argv)
        if launcher == "deepspeed":
            rank_env["LOCAL_SIZE"] = "2"
            rank_argv.append(f"--local_rank={rank}")
        else:
            rank_env["LOCAL_WORLD_SIZE"] = "2"
        ranks.append(subprocess.Popen(rank_argv, env=rank_env, cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(outputs)[-4000:]
    assert re.search(r"iteration +2/ +2 \| loss", outputs[0]), outputs[0][-3000:]
