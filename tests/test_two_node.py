"""The two-node run on one machine (scripts/two_node_netns.sh): two network namespaces as nodes,
TP=2 inside each and DP=2 across, losses equal to the same run as 4 processes on one node.

The run itself takes one to two minutes on a shared CPU (ten Python processes start): slow tier,
skipped where network namespaces cannot be made. The loss comparison it relies on is tested here
in the fast tier, including that it fails when it should."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "two_node_netns.sh")


def _load_compare_losses():
    spec = importlib.util.spec_from_file_location(
        "compare_losses", os.path.join(REPO, "scripts", "compare_losses.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare_losses = _load_compare_losses()

LOG = """W1122 torchrun noise
 iteration        1/       2 | loss 6.250831E+00 | lr 1.000E-03 | global batch 4 | grad norm 1.272
 iteration        2/       2 | loss 6.154881E+00 | lr 8.750E-04 | global batch 4 | grad norm 1.173
 validation at iteration 2 | loss 5.883286E+00 | ppl 3.589869E+02
"""


def test_read_losses_parses_train_and_validation_lines():
    assert compare_losses.read_losses(LOG) == {
        "train 1": 6.250831, "train 2": 6.154881, "valid 2": 5.883286}


def test_compare_accepts_equal_and_refuses_different_losses(tmp_path):
    same = compare_losses.read_losses(LOG)
    assert compare_losses.compare(same, dict(same), 1e-5) == []
    off = dict(same, **{"train 2": 6.154881 * (1 + 3e-5)})
    assert any("train 2" in p for p in compare_losses.compare(same, off, 1e-5))
    assert compare_losses.compare(same, {k: same[k] for k in ("train 1", "train 2")}, 1e-5)
    assert compare_losses.compare({}, {}, 1e-5) == ["a log reports no losses"]
    (tmp_path / "a.log").write_text(LOG)
    (tmp_path / "b.log").write_text(LOG.replace("6.154881E+00", "6.154981E+00"))
    assert compare_losses.main([str(tmp_path / "a.log"), str(tmp_path / "a.log")]) == 0
    assert compare_losses.main([str(tmp_path / "a.log"), str(tmp_path / "b.log")]) == 1


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True, timeout=30)


def _netns_permitted() -> str | None:
    """None if this process may create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    name = f"md2n-probe-{uuid.uuid4().hex[:8]}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as err:
        return f"ip netns add is not permitted here: {err}"
    subprocess.run(["ip", "netns", "del", name], check=True, timeout=10)
    return None


def _namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


@pytest.mark.slow
def test_two_namespaces_train_like_one_node(tmp_path):
    reason = _netns_permitted()
    if reason:
        pytest.skip(reason)
    run = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=420,
                         env=dict(os.environ, LOG_DIR=str(tmp_path), RUN_TIMEOUT="180"))
    print(run.stdout, run.stderr)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: 9 losses equal" in run.stdout
    made = set(re.search(r"two nodes: (\S+) \(.*\) \+ (\S+) \(", run.stdout).groups())
    assert not made & _namespaces(), f"the script left {made & _namespaces()} behind"
