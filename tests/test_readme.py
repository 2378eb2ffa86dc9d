"""The README works as written: every Python block runs (one process, gloo without CUDA), and
every shell command, in a bash block or inline in the prose, names files that exist, with the
entry scripts' flags parsing and validating for the world the command launches (no training)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megadomino.cli.arguments import parse_args
from megadomino.config.validate import validate

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ENTRY_POINTS = {"pretrain_gpt.py": ("gpt", False), "pretrain_llama.py": ("llama", False),
                "finetune_llama.py": ("llama", True)}


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README, re.M | re.S)


def _words(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # VAR=value prefixes
    return words


def _commands() -> list[list[str]]:
    """Each shell command of the bash blocks, continuations joined, comments dropped; then each
    inline one of the prose that runs a script (`torchrun ... pretrain_gpt.py ...`)."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if words := _words(line):
                commands.append(words)
    prose = re.sub(r"^```.*?^```$", "", README, flags=re.M | re.S)
    for span in re.findall(r"`((?:torchrun|python3?|bash) [^`]+)`", prose):
        words = _words(" ".join(span.split()))
        if any(word.endswith((".py", ".sh")) for word in words):
            commands.append(words)
    return commands


def test_the_readme_has_code_to_check():
    assert len(_blocks("python")) >= 1 and len(_commands()) >= 5


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_blocks_run(index, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(_blocks("python")[index])
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _torchrun_world(words: list[str]) -> tuple[int, int]:
    """(world size, processes per node) of a torchrun command line."""
    options = dict(zip(words[1::2], words[2::2]))
    per_node = int(options.get("--nproc_per_node", options.get("--nproc-per-node", 1)))
    return int(options.get("--nnodes", 1)) * per_node, per_node


@pytest.mark.parametrize("words", _commands(), ids=lambda words: " ".join(words)[:60])
def test_shell_commands_name_real_files_and_parse(words, tmp_path, monkeypatch):
    scripts = [word for word in words if word.endswith((".py", ".sh"))]
    assert scripts, f"no script in {' '.join(words)}"
    script = scripts[0]
    assert (ROOT / script).is_file(), f"{script} does not exist"
    if script.endswith(".sh"):
        check = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, check.stderr
        return
    name = Path(script).name
    if name not in ENTRY_POINTS:
        helped = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT,
                                capture_output=True, text=True, timeout=120,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert helped.returncode == 0, helped.stderr[-2000:]
        return
    family, finetune = ENTRY_POINTS[name]
    monkeypatch.chdir(tmp_path)  # --save / --load directories are checked writable
    argv = words[words.index(script) + 1:]
    config, _ = parse_args(argv, family, finetune)
    if words[0] == "torchrun":
        world, per_node = _torchrun_world(words[:words.index(script)])
        validate(config, world, per_node, finetune=finetune)
