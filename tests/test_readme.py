"""The documentation works as written: README.md, docs/*.md and the commands in the entry
scripts' docstrings (pretrain_gpt.py, pretrain_llama.py, finetune_llama.py, scripts/*.py).

A block that launches an entry script, in README.md as in docs/ and the docstrings, runs, as
written, in an empty directory (CPU, gloo), unless a `# needs ...` comment in it says what it
needs that CPU tests lack (GPUs, nodes, SLURM, root, a checkpoint). Every other shell command,
in a bash block, a docstring's indented block or inline in the prose, names files that exist,
with the entry scripts' flags parsing and validating for the world the command launches. Every
Python block runs (one process, gloo without CUDA), or, marked `# needs ...` as its first line,
compiles."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port
from megadomino.cli.arguments import parse_args
from megadomino.config import ModelConfig
from megadomino.config.validate import validate
from megadomino.interop.hf_config import hf_config_from

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ENTRY_POINTS = {"pretrain_gpt.py": ("gpt", False), "pretrain_llama.py": ("llama", False),
                "finetune_llama.py": ("llama", True)}
MARKDOWN = ["README.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))]
SCRIPTS = [*ENTRY_POINTS, *sorted(f"scripts/{path.name}"
                                  for path in (ROOT / "scripts").glob("*.py"))]
NEEDS = re.compile(r"^# needs ", re.M)


def _blocks(language: str, source: str = "README.md") -> list[str]:
    text = (ROOT / source).read_text()
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def _docstring_blocks(source: str) -> list[str]:
    """The indented paragraphs of a script's docstring that hold commands, dedented."""
    docstring = ast.get_docstring(ast.parse((ROOT / source).read_text()), clean=False) or ""
    blocks = []
    for paragraph in re.split(r"\n[ \t]*\n", docstring):
        lines = paragraph.strip("\n").splitlines()
        if lines and all(line.startswith("    ") for line in lines) and re.match(
                r"(torchrun|python3?|bash|#) ", lines[0].strip()):
            blocks.append("\n".join(line[4:] for line in lines))
    return blocks


def _shell_blocks(source: str) -> list[str]:
    return _blocks("bash", source) if source.endswith(".md") else _docstring_blocks(source)


def _words(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # VAR=value prefixes
    return words


def _block_commands(block: str) -> list[list[str]]:
    """The words of each command of a shell block that runs a script."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = _words(line)
        if words and (words[0] in ("torchrun", "python", "python3", "bash")
                      or any(word.endswith((".py", ".sh")) for word in words)):
            commands.append(words)
    return commands


def _commands(source: str) -> list[list[str]]:
    """Each command of the source's shell blocks that runs a script (continuations joined,
    comments dropped); then, in Markdown, each inline one of the prose that runs a script
    (`torchrun ... pretrain_gpt.py ...`)."""
    commands = [words for block in _shell_blocks(source) for words in _block_commands(block)]
    if source.endswith(".md"):
        prose = re.sub(r"^```.*?^```$", "", (ROOT / source).read_text(), flags=re.M | re.S)
        for span in re.findall(r"`((?:torchrun|python3?|bash) [^`]+)`", prose):
            words = _words(" ".join(span.split()))
            if any(word.endswith((".py", ".sh")) for word in words):
                commands.append(words)
    return commands


def _all_commands() -> list[tuple[str, list[str]]]:
    """(source, words) of every command but those of the blocks that run (they may need the
    files their block makes first)."""
    run = [words for _, block in _runnable_blocks() for words in _block_commands(block)]
    return [(source, words) for source in MARKDOWN + SCRIPTS for words in _commands(source)
            if words not in run]


def _runnable_blocks() -> list[tuple[str, str]]:
    """(source, block) of every block that launches an entry script and is not marked
    `# needs ...`."""
    return [(source, block) for source in MARKDOWN + SCRIPTS
            for block in _shell_blocks(source)
            if not NEEDS.search(block) and any(name in block for name in ENTRY_POINTS)]


def test_the_docs_have_code_to_check():
    assert len(_blocks("python")) >= 1 and len(_commands("README.md")) >= 5
    assert all(_docstring_blocks(script) for script in ENTRY_POINTS)
    assert len(_runnable_blocks()) >= 4  # the CPU examples of the entry scripts and pipeline.md


PYTHON_BLOCKS = [(source, block) for source in MARKDOWN for block in _blocks("python", source)]


def _clean_env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("source, block", PYTHON_BLOCKS, ids=lambda value: value[:40])
def test_python_blocks_run(source, block, tmp_path):
    if NEEDS.match(block):
        compile(block, source, "exec")
        return
    script = tmp_path / "block.py"
    script.write_text(block)
    # a free port: the block's own default may be taken by a run beside this one
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT,
                          env={**_clean_env(), "MASTER_PORT": str(free_port())},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.parametrize("source, block", _runnable_blocks(), ids=lambda value: value[:40])
def test_cpu_blocks_run_as_written(source, block, tmp_path):
    """The block runs in an empty directory that sees the entry scripts and tests/ (its
    fixtures) where the repository root would; every run it launches ends."""
    for name in (*ENTRY_POINTS, "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    # --standalone: a free port, so that runs beside this one (other tests) do not collide
    torchrun = f'torchrun() {{ "{sys.executable}" -m torch.distributed.run --standalone "$@"; }}\n'
    done = subprocess.run(["bash", "-ec", torchrun + block], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{source}:\n{block}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    launches = sum(name in line for line in block.replace("\\\n", " ").splitlines()
                   for name in ENTRY_POINTS)
    assert done.stdout.count("run ended:") == launches, done.stdout[-3000:]


def _torchrun_world(words: list[str]) -> tuple[int, int]:
    """(world size, processes per node) of a torchrun command line."""
    options = dict(zip(words[1::2], words[2::2]))
    per_node = int(options.get("--nproc_per_node", options.get("--nproc-per-node", 1)))
    return int(options.get("--nnodes", 1)) * per_node, per_node


@functools.cache
def _help(script: str) -> tuple[int, str]:
    """(exit status, stderr's tail) of `script --help`, once per script."""
    helped = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=_clean_env())
    return helped.returncode, helped.stderr[-2000:]


def _with_hf_checkpoint(words: list[str], directory: Path) -> list[str]:
    """`words` with a missing --hf-checkpoint directory replaced by `directory`, which gets a
    Llama-2 7B config.json (the architecture parse_args reads from it)."""
    if "--hf-checkpoint" not in words:
        return words
    hf_dir = words[words.index("--hf-checkpoint") + 1]
    if Path(hf_dir).is_dir():
        return words
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_from(
        ModelConfig.preset("llama2-7b"))))
    return [word.replace(hf_dir, str(directory)) for word in words]


@pytest.mark.parametrize("source, words", _all_commands(),
                         ids=lambda value: value if isinstance(value, str)
                         else " ".join(value)[:60])
def test_shell_commands_name_real_files_and_parse(source, words, tmp_path, monkeypatch):
    words = _with_hf_checkpoint(words, tmp_path / "hf")
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
        status, stderr = _help(script)
        assert status == 0, stderr
        return
    family, finetune = ENTRY_POINTS[name]
    monkeypatch.chdir(tmp_path)  # --save / --load directories are checked writable
    argv = words[words.index(script) + 1:]
    config, _ = parse_args(argv, family, finetune)
    if words[0] == "torchrun":
        world, per_node = _torchrun_world(words[:words.index(script)])
        validate(config, world, per_node, finetune=finetune)
