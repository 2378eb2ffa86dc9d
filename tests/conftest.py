"""Test tiers, and the collection-time check of the distributed cases.

Every test belongs to one tier, named by its marker (none: `default`):
  default  CPU CI: `bash scripts/test.sh` (pytest's time under 10 minutes on 2 idle cores)
  slow     network namespaces, long fault tests, 8-rank worlds, the oldest dependencies, the
           rest of a grid whose every code path has a representative in the default tier
  gpu      CUDA: tests/gpu and every NCCL suite, on the GPU machine
  peers    parity with megatron-core and DeepSpeed, where they are installed
`--tier` picks the tiers a run takes (default: `default`); a test of another tier is skipped with
its tier named, and a summary before pytest's closing line gives each skipped tier's count and the
command that runs it.
"""

import os
import sys
from collections import Counter

import pytest

# tests/gpu imports the CPU test modules and dist_utils by name.
sys.path.insert(0, os.path.dirname(__file__))



@pytest.fixture(scope="module")
def single_process_group():
    """A gloo world of one for a module's tests (ParallelDims needs a process group); a module
    asks for it with `pytestmark = pytest.mark.usefixtures("single_process_group")`."""
    import torch.distributed as dist

    from dist_utils import free_port

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


TIERS = {
    "default": "bash scripts/test.sh",
    "slow": "bash scripts/test.sh --tier slow",
    "gpu": "bash scripts/test.sh --tier gpu   (on a CUDA machine)",
    "peers": "bash scripts/test.sh --tier peers   (with megatron-core / deepspeed installed)",
}
TIER_OF: dict[str, str] = {}  # nodeid -> tier, filled at collection; read by the summary


def pytest_addoption(parser):
    parser.addoption("--tier", default="default",
                     help="comma-separated tiers to run: " + ", ".join(TIERS) + ", or all")


def pytest_configure(config):
    for tier in TIERS:
        if tier != "default":
            config.addinivalue_line("markers", f"{tier}: the {tier} tier (see tests/conftest.py)")
    chosen = config.getoption("--tier").split(",")
    unknown = sorted(set(chosen) - set(TIERS) - {"all"})
    if unknown:
        raise pytest.UsageError(f"--tier {','.join(unknown)}: choose from "
                                f"{', '.join(TIERS)} or all")
    config.chosen_tiers = set(TIERS) if "all" in chosen else set(chosen)


def versions() -> str:
    import importlib.metadata as metadata

    found = []
    for package in ("torch", "triton", "pytest", "transformers", "numpy"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def tier_of(item) -> str:
    if item.get_closest_marker("gpu") or os.sep + "gpu" + os.sep in str(item.path):
        return "gpu"
    for tier in ("peers", "slow"):
        if item.get_closest_marker(tier):
            return tier
    return "default"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    check_suites_are_asserted(items)
    for item in items:
        tier = TIER_OF[item.nodeid] = tier_of(item)
        if tier not in config.chosen_tiers:
            # first of the item's marks, so that this reason wins over the test's own skipif
            item.add_marker(pytest.mark.skipif(True, reason=f"tier {tier}: run it with "
                                               f"{TIERS[tier]}"), append=False)


def check_suites_are_asserted(items) -> None:
    """Every DistSuite defined in a collected module must be turned into a collected test (its
    `test()` assigned to a `test_*` name), so that no registered case runs without an assert."""
    from dist_utils import DistSuite

    modules = {item.module for item in items if getattr(item, "module", None) is not None}
    asserted = {id(getattr(item.function, "dist_suite", None)) for item in items
                if hasattr(item, "function")}
    for module in modules:
        for name, value in vars(module).items():
            if (isinstance(value, DistSuite) and value.home == module.__name__ and value.cases
                    and id(value) not in asserted):
                raise pytest.UsageError(
                    f"{module.__name__}.{name}: a DistSuite whose cases no test asserts; "
                    f"assign `test_<what> = {name}.test()` after its last case")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    reports = terminalreporter.stats.get("skipped", [])
    skipped = Counter(TIER_OF.get(report.nodeid, "default") for report in reports)
    terminalreporter.section("tiers")
    terminalreporter.write_line(f"ran tiers {','.join(sorted(config.chosen_tiers))} with "
                                f"{versions()}")
    for tier in TIERS:
        if not skipped[tier]:
            continue
        if tier not in config.chosen_tiers:
            terminalreporter.write_line(f"tier {tier}: {skipped[tier]} skipped; "
                                        f"run: {TIERS[tier]}")
            continue
        # skipped although its tier ran: say why (a missing package, too few GPUs, ...)
        reasons = Counter(_reason(report) for report in reports
                          if TIER_OF.get(report.nodeid, "default") == tier)
        why = "; ".join(f"{count}: {reason}" for reason, count in reasons.most_common(3))
        terminalreporter.write_line(f"tier {tier}: {skipped[tier]} skipped here ({why})")
    load = " / ".join(f"{value:.2f}" for value in os.getloadavg())
    terminalreporter.write_line(f"load average (1 / 5 / 15 min) at the end: {load} "
                                f"on {os.cpu_count()} cores")


def _reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")
