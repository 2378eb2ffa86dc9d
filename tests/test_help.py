"""--help lists the implemented and our own flags by subject, each with its default;
--help-all lists every row. --grad-reduce-in-bf16 maps to the engine's bf16 reduce. A flag error
of a multi-rank launch is printed once per node."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port
from megadomino.cli.arguments import build_parser, parse_args
from megadomino.cli.flag_help import HELP_GROUPS, help_group, shown_by_default
from megadomino.cli.flags import ALIAS, FINETUNE_FLAGS, FLAGS

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10"]
CASES = [("gpt", False), ("llama", False), ("llama", True)]


def _listed(parser: argparse.ArgumentParser) -> dict[str, tuple[str, str]]:
    """Each listed option string: (its group's title, its help)."""
    listed = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS:
                continue
            for name in action.option_strings:
                assert name not in listed, name
                listed[name] = (group.title, action.help)
    return listed


@pytest.mark.parametrize("family, finetune", CASES)
def test_help_lists_implemented_and_ours_grouped_with_defaults(family, finetune):
    flags = FLAGS + FINETUNE_FLAGS if finetune else FLAGS
    listed = _listed(build_parser(family, finetune))
    targets = {flag.name: flag for flag in flags}
    for flag in flags:
        shown = targets[flag.alias_of] if flag.policy == ALIAS else flag
        if not shown_by_default(shown):
            assert flag.name not in listed, flag.name
            continue
        title, text = listed[flag.name]
        assert title == help_group(shown), flag.name
        assert "default" in text.lower() or "required" in text, (flag.name, text)
    assert set(listed) - set(targets) == {"-h", "--help", "--help-all"}
    text = build_parser(family, finetune).format_help()
    assert "[notice]" not in text and "[refused]" not in text
    titles = [title for _, title in HELP_GROUPS]
    assert all(title in titles for title, _ in listed.values() if title != "options")


@pytest.mark.parametrize("family, finetune", CASES)
def test_help_all_lists_every_row(family, finetune):
    flags = FLAGS + FINETUNE_FLAGS if finetune else FLAGS
    listed = _listed(build_parser(family, finetune, show_all=True))
    assert {flag.name for flag in flags} <= set(listed)
    for flag in flags:
        if flag.policy != ALIAS:
            title, text = listed[flag.name]
            assert title == help_group(flag) and flag.text[:40] in text, flag.name


def test_defaults_are_the_config_defaults():
    listed = _listed(build_parser("llama"))
    assert listed["--normalization"][1].endswith("(default: RMSNorm)")
    assert listed["--hidden-dropout"][1].endswith("(default: 0.0)")  # Llama's, not GPT's 0.1
    assert listed["--seed"][1].endswith("(default: 1234)")
    assert listed["--swiglu"][1].endswith("(default: off)")
    assert "default 4 x hidden" in listed["--ffn-hidden-size"][1]
    assert listed["--num-layers"][1].endswith("(required unless --model-preset gives it)")


@pytest.mark.parametrize("option", ["--help", "--help-all"])
def test_help_exits_0_before_anything_else(option, tmp_path):
    """Under a 2-rank torchrun environment whose master nobody serves: help needs no group."""
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), option], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("--wandb-project" in done.stdout) == (option == "--help-all")
    assert "--num-layers" in done.stdout and not done.stderr


def test_grad_reduce_in_bf16_maps_to_the_engine_reduce():
    config, notices = parse_args([*BASE, "--zero-stage", "3", "--grad-reduce-in-bf16"], "gpt")
    assert config.parallel.zero.reduce_dtype == "bfloat16" and notices == []
    config, notices = parse_args([*BASE, "--grad-reduce-in-bf16"], "gpt")
    assert config.parallel.zero.reduce_dtype == "float32"
    assert notices == ["--grad-reduce-in-bf16: at --zero-stage 0 gradients are reduced in fp32; "
                       "with --use-distributed-optimizer they are reduced in bf16"]


def test_llama3_8b_fp8_script_reduces_in_bf16():
    script = json.loads((ROOT / "tests" / "launch_scripts" / "argv.json").read_text())[
        "megatron-llama3-8b-fp8"]
    argv = script["argv"]
    assert "--grad-reduce-in-bf16" in argv and "--use-distributed-optimizer" in argv
    config, notices = parse_args(argv, "llama")
    assert config.parallel.zero.reduce_dtype == "bfloat16"
    assert not any(notice.startswith("--grad-reduce-in-bf16") for notice in notices)


def test_flag_error_prints_once_per_node(tmp_path):
    """Both ranks of one node exit 2; local rank 0 alone prints the `error:` line."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, "--no-such-flag"]
    ranks = [subprocess.Popen(argv, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for rank in range(2)]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], outputs
    errors = [[line for line in output.splitlines() if line.startswith("error:")]
              for output in outputs]
    assert len(errors[0]) == 1 and errors[1] == [], outputs
    assert errors[0][0].startswith("error: unknown flag --no-such-flag"), errors
