"""The declared dependency ranges: the oldest-dependencies job installs exactly setup.py's lower
bounds, and the test extra brings everything the default tier needs (triton for the kernels); and
setup.py installs every package of megadomino/ and kernels/."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_keywords(*names: str) -> dict:
    """setup()'s keyword arguments `names`, read from setup.py's AST (never executed)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg in names}


def setup_requirements() -> dict[str, list[Requirement]]:
    """setup.py's install_requires and extras_require."""
    keywords = setup_keywords("install_requires", "extras_require")
    groups = {"install": keywords["install_requires"], **keywords["extras_require"]}
    return {name: [Requirement(line) for line in lines] for name, lines in groups.items()}


def lower_bound(requirement: Requirement) -> str | None:
    bounds = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    return bounds[0] if bounds else None


def oldest_pins() -> dict[str, Version]:
    pins = {}
    for line in open(os.path.join(ROOT, "tests", "oldest-requirements.txt")):
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line}: the oldest job pins exact versions"
            pins[requirement.name] = Version(spec.version)
    return pins


def test_oldest_job_pins_exactly_the_declared_lower_bounds():
    bounded = {req.name: Version(lower_bound(req)) for group in (setup_requirements()["install"],
                                                         setup_requirements()["test"])
               for req in group if lower_bound(req)}
    assert oldest_pins() == bounded


def test_the_test_extra_brings_triton_where_a_wheel_exists():
    (triton,) = [req for req in setup_requirements()["test"] if req.name == "triton"]
    assert triton.marker.evaluate({"platform_system": "Linux", "platform_machine": "x86_64"})
    assert not triton.marker.evaluate({"platform_system": "Darwin", "platform_machine": "arm64"})
    assert lower_bound(triton) == "3.6"  # what torch 2.11, the oldest torch, pins
    assert "triton" not in setup_requirements()  # one mechanism: no separate triton extra


def test_setup_installs_every_package():
    keywords = setup_keywords("packages", "package_dir")
    on_disk = set()
    for folder, installed_as in (("megadomino", "megadomino"), ("kernels", "megadomino.kernels")):
        for init in (Path(ROOT) / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(Path(ROOT) / folder).parts
            if not init.parent.is_relative_to(Path(ROOT) / "megadomino" / "kernels"):
                on_disk.add(".".join([installed_as, *relative]))
    assert keywords["package_dir"] == {"megadomino.kernels": "kernels"}
    assert sorted(keywords["packages"]) == sorted(on_disk)
