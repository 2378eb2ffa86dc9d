"""Nothing is configured by the environment: every module of megadomino/ and kernels/ (parsed,
not imported) leaves the process environment alone, except the launcher, which reads the
launchers' contracts (torchrun, SLURM/srun, the deepspeed launcher); no module names a
MEGADOMINO_ variable; and none rebinds module state (no `global` statement), so behaviour does
not depend on what else ran in the process."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
MODULES = sorted([*ROOT.glob("megadomino/**/*.py"), *ROOT.glob("kernels/**/*.py")])
LAUNCHER = ROOT / "megadomino" / "cli" / "launch.py"
ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environment_uses(tree: ast.AST) -> list[int]:
    """Lines touching os.environ / os.getenv / ..., or importing them from os."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(alias.name in ENVIRONMENT for alias in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_there_are_modules_to_check():
    assert len(MODULES) > 40 and LAUNCHER in MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_launcher_reads_the_environment(path: Path):
    text = path.read_text()
    assert "MEGADOMINO_" not in text, f"{path.relative_to(ROOT)} names a MEGADOMINO_ variable"
    tree = ast.parse(text)
    if path != LAUNCHER:
        uses = _environment_uses(tree)
        assert not uses, (f"{path.relative_to(ROOT)}:{uses[0]} touches the environment: take "
                          "the value as an argument (the launcher reads the environment)")
    rebinds = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Global)]
    assert not rebinds, f"{path.relative_to(ROOT)}:{rebinds[0]} rebinds module state (global)"


def test_the_check_sees_what_it_looks_for():
    caught = _environment_uses(ast.parse("import os\nx = os.environ.get('A')\n"
                                         "from os import getenv\n"))
    assert caught == [2, 3]
