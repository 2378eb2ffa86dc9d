"""The documents hold together: every relative link of every Markdown file in the repository
resolves (the file exists; a `#section` names a heading of the target), every raw result a
benchmark document names by file exists, and every raw result in benchmarks/results/ is cited by
BENCHMARKS.md or a dated report (an uncited one is either listed there or deleted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```$", re.M | re.S)
RAW_NAME = re.compile(r"[\w.\-]+_20\d\d-\d\d-\d\d\w*\.(?:json|txt|tgz)")  # name_YYYY-MM-DD*.ext


def _markdown_files() -> list[Path]:
    return sorted(path for path in ROOT.rglob("*.md")
                  if not any(part.startswith(".") or part.endswith(".egg-info")
                             for part in path.relative_to(ROOT).parts[:-1]))


def _benchmark_documents() -> list[Path]:
    return [ROOT / "BENCHMARKS.md", *sorted((ROOT / "benchmarks" / "reports").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", path.read_text()), re.M):
        slug, n = _slug(heading), 1
        while slug in anchors:  # repeated headings get -1, -2, ...
            slug, n = f"{_slug(heading)}-{n}", n + 1
        anchors.add(slug)
    return anchors


def _relative_links(path: Path) -> list[str]:
    return [target for target in LINK.findall(FENCE.sub("", path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


def test_there_are_documents_and_links_to_check():
    files = _markdown_files()
    assert ROOT / "README.md" in files and ROOT / "BENCHMARKS.md" in files
    assert sum(len(_relative_links(path)) for path in files) >= 50


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in _relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_raw_results_named_by_the_benchmark_documents_exist():
    named = set()
    for path in _benchmark_documents():
        named |= set(RAW_NAME.findall(path.read_text()))
    missing = sorted(name for name in named if not (RESULTS / name).exists())
    assert named and not missing, missing


def test_every_raw_result_is_cited():
    cited = set()
    for path in _benchmark_documents():
        for target in _relative_links(path):
            resolved = (path.parent / target.partition("#")[0]).resolve()
            if resolved.parent == RESULTS.resolve():
                cited.add(resolved.name)
    uncited = sorted(path.name for path in RESULTS.iterdir() if path.name not in cited)
    assert not uncited, ("cite these in BENCHMARKS.md or a report under benchmarks/reports/, or "
                         f"delete them: {uncited}")


def test_the_code_cites_reports_that_exist():
    cited = {}
    for folder in ("megadomino", "kernels", "benchmarks", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".sbatch") and path.is_file():
                for name in re.findall(r"benchmarks/reports/[\w.\-]+\.md", path.read_text()):
                    cited.setdefault(name, []).append(str(path.relative_to(ROOT)))
    missing = {name: paths for name, paths in cited.items() if not (ROOT / name).is_file()}
    assert cited and not missing, missing
