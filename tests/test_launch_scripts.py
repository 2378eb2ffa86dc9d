"""Launching: srun-direct environment translation (slurm_env), and the SLURM / local scripts, run
with DRY_RUN=1 outside SLURM (a stub `scontrol` on PATH stands in for SLURM's): every script
parses, prints the expected srun + torchrun line, and its flags are accepted by the entry point's
parser for the world size it would launch."""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from megadomino.cli.arguments import parse_args
from megadomino.cli.slurm_env import apply_slurm_env, expand_tasks_per_node, first_host
from megadomino.config import ModelConfig
from megadomino.config.validate import validate
from megadomino.interop.hf_config import hf_config_from

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = {"pretrain_gpt3_6.7b": ("pretrain_gpt.py", "gpt"),
          "pretrain_llama2_7b": ("pretrain_llama.py", "llama"),
          "finetune_llama2_7b": ("finetune_llama.py", "llama")}

SRUN_STEP = {"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
             "SLURM_STEP_NUM_TASKS": "11", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",
             "SLURM_STEP_NODELIST": "gpu[07-09]", "SLURM_JOB_NODELIST": "gpu[01-09]",
             "SLURM_JOB_ID": "123456", "SLURM_NTASKS": "11"}


def test_srun_step_sets_torch_distributed_env():
    environ = dict(SRUN_STEP)
    apply_slurm_env(environ)
    assert {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                    "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "9", "WORLD_SIZE": "11", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(15000 + 123456 % 20000)}


def test_slurm_env_leaves_torchrun_and_batch_shell_and_explicit_values_alone():
    under_torchrun = dict(SRUN_STEP, RANK="3")
    apply_slurm_env(under_torchrun)
    assert under_torchrun == dict(SRUN_STEP, RANK="3")
    batch_shell = {k: v for k, v in SRUN_STEP.items() if not k.startswith("SLURM_STEP")}
    apply_slurm_env(batch_shell)
    assert "RANK" not in batch_shell and "WORLD_SIZE" not in batch_shell
    explicit = dict(SRUN_STEP, MASTER_ADDR="10.0.0.5", MASTER_PORT="29501")
    apply_slurm_env(explicit)
    assert (explicit["MASTER_ADDR"], explicit["MASTER_PORT"], explicit["RANK"]) == \
        ("10.0.0.5", "29501", "9")


@pytest.mark.parametrize("nodelist, first", [
    ("node17", "node17"), ("gpu[07-12,20],cpu3", "gpu07"), ("gpu[3,5-6]", "gpu3"),
    ("a1,b[2-3]", "a1"), ("rack[1-2]-n[003-004]", "rack1-n003"), (" dgx-a100-[010-012] ",
                                                                  "dgx-a100-010")])
def test_first_host(nodelist, first):
    assert first_host(nodelist) == first


def test_tasks_per_node():
    assert expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert expand_tasks_per_node("8") == [8] and expand_tasks_per_node("") == []
    with pytest.raises(ValueError, match="x2"):
        expand_tasks_per_node("4x2")


def test_entry_point_started_by_srun_directly():
    """Two tasks as `srun --ntasks 2 python pretrain_gpt.py` starts them (SLURM's variables, no
    RANK): they form one TP=2 group and train."""
    from dist_utils import free_port

    step = dict(os.environ, SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="2",
                SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="localhost",
                SLURM_JOB_ID="99", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        step.pop(name, None)
    args = ["--model-preset", "gpt-tiny", "--tensor-model-parallel-size", "2", "--mock-data",
            "--train-iters", "2", "--micro-batch-size", "2", "--log-interval", "1"]
    tasks = [subprocess.Popen([sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *args],
                              env=dict(step, SLURM_PROCID=str(task), SLURM_LOCALID=str(task)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for task in range(2)]
    try:
        outputs = [task.communicate(timeout=180)[0] for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                task.kill()
    assert [task.returncode for task in tasks] == [0, 0], outputs
    assert "iteration        2/       2" in outputs[0], outputs[0]


def all_scripts() -> list[str]:
    patterns = ("scripts/slurm/*.sbatch", "scripts/slurm/*.sh", "scripts/local/*.sh",
                "scripts/finetune/*.sh", "scripts/*.sh", "benchmarks/*.sh")
    return sorted(path for pattern in patterns for path in glob.glob(os.path.join(REPO, pattern)))


def test_every_script_parses():
    scripts = all_scripts()
    assert len(scripts) >= 10, scripts
    for path in scripts:
        checked = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, f"{path}: {checked.stderr}"


@pytest.fixture
def slurm_env(tmp_path):
    """A DRY_RUN environment as sbatch would give on 2 nodes, with a stub scontrol whose answer
    ('nodeA') differs from the node list's own first host, to show which one was asked."""
    stub = tmp_path / "bin" / "scontrol"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "nodeA\\nnodeB\\n"\n')
    stub.chmod(0o755)
    hf_dir = tmp_path / "Llama-2-7b-hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(hf_config_from(ModelConfig.preset("llama2-7b"))))
    return dict(os.environ, DRY_RUN="1", PATH=f"{stub.parent}:{os.environ['PATH']}",
                SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_ID="4242",
                SLURM_SUBMIT_DIR=REPO, HF_DIR=str(hf_dir), SFT_DATA="a.jsonl b.jsonl",
                OUTPUT_DIR=str(tmp_path / "sft"))


def dry_run(script: str, env: dict, *args: str) -> list[str]:
    done = subprocess.run(["bash", os.path.join(REPO, script), *args], env=env, cwd="/",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


def entry_args(words: list[str], entry: str) -> list[str]:
    assert entry in words, words
    return words[words.index(entry) + 1:]


@pytest.mark.parametrize("name", sorted(SBATCH))
def test_sbatch_dry_run_prints_torchrun_per_node(name, slurm_env):
    entry, family = SBATCH[name]
    words = dry_run(f"scripts/slurm/{name}.sbatch", slurm_env, "--seed", "7")
    assert words[:words.index(entry) + 1] == [
        "srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "torchrun", "--nnodes", "2", "--nproc_per_node", "8", "--rdzv_id", "4242",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "nodeA:29500", entry]
    args = entry_args(words, entry)
    assert args[-2:] == ["--seed", "7"]
    config, _ = parse_args(args, family, entry == "finetune_llama.py")
    validate(config, 16)


def test_finetune_flags_carry_template_and_data(slurm_env):
    args = entry_args(dry_run("scripts/slurm/finetune_llama2_7b.sbatch", slurm_env),
                      "finetune_llama.py")
    template = args[args.index("--prompt-template") + 1]
    assert template == "[INST] {prompt} [/INST]"
    assert args[args.index("--data-path") + 1:args.index("--data-path") + 3] == \
        ["a.jsonl", "b.jsonl"]


def test_pretrain_with_data_and_checkpoints(slurm_env):
    env = dict(slurm_env, DATA_PATH="0.3 /d/web 0.7 /d/books", VOCAB_FILE="v.json",
               MERGE_FILE="m.txt", CHECKPOINT_DIR="/ckpt", GPUS_PER_NODE="4", TP="2")
    words = dry_run("scripts/slurm/pretrain_gpt3_6.7b.sbatch", env)
    assert words[words.index("--nproc_per_node") + 1] == "4"
    args = entry_args(words, "pretrain_gpt.py")
    config, _ = parse_args(args, "gpt")
    assert config.train.data.data_path == ["0.3", "/d/web", "0.7", "/d/books"]
    checkpoint = config.train.checkpoint
    assert (checkpoint.save, checkpoint.load) == ("/ckpt", "/ckpt")
    assert config.parallel.tensor_model_parallel_size == 2 and "--mock-data" not in args
    validate(config, 8)


def test_first_node_without_scontrol(slurm_env):
    if shutil.which("scontrol"):
        pytest.skip("a real scontrol is installed: the fallback is not used here")
    env = dict(slurm_env, PATH=os.environ["PATH"])
    words = dry_run("scripts/slurm/pretrain_llama2_7b.sbatch", env)
    assert words[words.index("--rdzv_endpoint") + 1] == "gpu07:29500"


def test_srun_direct_launcher(slurm_env):
    words = dry_run("scripts/slurm/pretrain_llama2_7b.sbatch", dict(slurm_env, LAUNCHER="srun"))
    assert words[:6] == ["srun", "--nodes=2", "--ntasks-per-node=8", "--kill-on-bad-exit=1",
                         "python3", "pretrain_llama.py"]


@pytest.mark.parametrize("name", sorted(SBATCH))
def test_local_scripts_run_the_sbatch_recipe_on_one_node(name, slurm_env):
    entry, _ = SBATCH[name]
    local = dry_run(f"scripts/local/{name}.sh", slurm_env)
    assert local[:5] == ["torchrun", "--standalone", "--nproc_per_node", "8", entry]
    sbatch = dry_run(f"scripts/slurm/{name}.sbatch", slurm_env)
    assert entry_args(local, entry) == entry_args(sbatch, entry)


def test_launch_refusals(slurm_env):
    script = os.path.join(REPO, "scripts/slurm/pretrain_llama2_7b.sbatch")
    no_slurm = {k: v for k, v in slurm_env.items() if k != "SLURM_NNODES"}
    done = subprocess.run(["bash", script], env=no_slurm, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "SLURM_NNODES" in done.stderr
    done = subprocess.run(["bash", script], env=dict(slurm_env, LAUNCHER="mpirun"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "LAUNCHER=mpirun is unknown" in done.stderr


def test_sft_recipe_dry_run_steps(slurm_env, tmp_path):
    """The recipe runs the one-node fine-tune with the recipe's flags, extra flags last (they win
    in the parser), then exports WORK_DIR/checkpoint to WORK_DIR/hf with the tokenizer."""
    env = dict(slurm_env, WORK_DIR=str(tmp_path / "work"), GPUS_PER_NODE="2", TP="2")
    done = subprocess.run(["bash", os.path.join(REPO, "scripts/finetune/llama2_7b_sft.sh"),
                           "--lr", "1e-5"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    steps = [shlex.split(line) for line in done.stdout.splitlines()]
    assert [step[0] for step in steps] == ["torchrun", "python3", "cp"], steps
    args = entry_args(steps[0], "finetune_llama.py")
    config, _ = parse_args(args, "llama", True)
    assert config.train.schedule.lr == 1e-5
    save = config.train.checkpoint.save
    assert save == os.path.join(env["WORK_DIR"], "checkpoint")
    assert args[args.index("--tokenizer-model") + 1] == os.path.join(env["HF_DIR"],
                                                                     "tokenizer.model")
    assert steps[1][1:] == ["scripts/convert_hf_llama.py", "megadomino-to-hf", "--load",
                            save, "--hf-dir", os.path.join(env["WORK_DIR"], "hf")]


def test_sft_recipe_demo_builds_its_inputs_first(slurm_env, tmp_path):
    env = dict(slurm_env, WORK_DIR=str(tmp_path / "work"), DEMO="1")
    done = subprocess.run(["bash", os.path.join(REPO, "scripts/finetune/llama2_7b_sft.sh")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    scripts = [shlex.split(line)[1] for line in done.stdout.splitlines()[1:4]]
    assert scripts == ["scripts/finetune/make_demo_inputs.py", "scripts/train_tokenizer.py",
                       "scripts/finetune/make_demo_inputs.py"]
    assert f"--hf-checkpoint {env['WORK_DIR']}/demo_hf" in done.stdout


@pytest.mark.slow
def test_sft_recipe_demo_runs_end_to_end_on_cpu(tmp_path):
    """DEMO=1 with the tiny Llama shape on 2 CPU ranks at TP=2: the inputs are built, the loss
    falls, and WORK_DIR/hf holds an HF directory of the fine-tuned weights with its tokenizer."""
    from safetensors import safe_open

    from megadomino.interop.hf import hf_shapes, read_hf_config
    from megadomino.interop.hf_config import model_config_from_hf

    work = tmp_path / "work"
    env = dict(os.environ, DEMO="1", DEMO_PRESET="llama-tiny", DEMO_LAYERS="2",
               WORK_DIR=str(work), GPUS_PER_NODE="2", TP="2", ITERS="20")
    done = subprocess.run(
        ["bash", os.path.join(REPO, "scripts/finetune/llama2_7b_sft.sh"), "--micro-batch-size",
         "4", "--global-batch-size", "8", "--log-interval", "5", "--eval-interval", "20",
         "--eval-iters", "1", "--lr", "1e-3", "--min-lr", "1e-4"],
        env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(line.split("| loss ")[1].split()[0]) for line in done.stdout.splitlines()
              if line.lstrip().startswith("iteration")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, losses
    hf_dir = str(work / "hf")
    assert sorted(os.listdir(hf_dir)) == ["config.json", "model.safetensors", "tokenizer.model"]
    config = model_config_from_hf(read_hf_config(hf_dir))
    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as tensors:
        assert {name: tuple(tensors.get_slice(name).get_shape()) for name in tensors.keys()} \
            == hf_shapes(config)
