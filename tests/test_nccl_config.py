"""--nccl-communicator-config-path and --high-priority-stream-groups (config/nccl.py): a YAML
file of NCCL settings per process group by Megatron-LM's names, read at argument time; the
groups this library makes get them as ProcessGroupNCCL.Options (ParallelDims.options), the
names of groups it does not make a notice; anything else one line naming the file, exit 2.
The groups made with the settings are tested on gloo and NCCL in tests/test_open_links.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from test_bad_files import MOCK, run

from megadomino.config import ConfigError
from megadomino.config.nccl import read_nccl_config
from megadomino.distributed import dims as dims_module
from megadomino.distributed.dims import ParallelDims

GOOD = ("pp:\n  max_ctas: 2\n  min_ctas: 1\ntp:\n  is_high_priority_stream: true\n"
        "ep:\n  max_ctas: 4\n")


def test_settings_per_group_and_notices(tmp_path):
    path = tmp_path / "nccl.yaml"
    path.write_text(GOOD)
    settings, notices = read_nccl_config(str(path), ["dp"])
    assert settings == {"pp": {"max_ctas": 2, "min_ctas": 1},
                        "tp": {"is_high_priority_stream": True},
                        "dp": {"is_high_priority_stream": True}}
    assert notices == ["ep: NCCL settings of a group megadomino does not make, not applied"]
    assert read_nccl_config(None) == ({}, [])


@pytest.mark.parametrize("text, said", [
    ("stages:\n  max_ctas: 2\n", "no group named 'stages'"),
    ("pp:\n  max_blocks: 2\n", "group 'pp' has no setting 'max_blocks'"),
    ("pp:\n  max_ctas: 0\n", "pp.max_ctas is 0; want a positive integer"),
    ("pp:\n  max_ctas: two\n", "pp.max_ctas is 'two'; want a positive integer"),
    ("pp:\n  max_ctas: true\n", "pp.max_ctas is True; want a positive integer"),
    ("pp:\n  net_name: ethernet\n", "pp.net_name is 'ethernet'; want 'IB' or 'socket'"),
    ("pp:\n  is_high_priority_stream: 1\n", "want true or false"),
    ("pp: 2\n", "group 'pp' wants a mapping of settings"),
    ("- pp\n", "want a mapping of group names"),
    ("", "want a mapping of group names"),
    ("pp: [\n", "not a readable YAML file"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, text, said):
    path = tmp_path / "nccl.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="") as error:
        read_nccl_config(str(path))
    message = str(error.value)
    assert "\n" not in message and said in message, message
    assert f"--nccl-communicator-config-path {path}" in message


def test_an_unknown_high_priority_group_is_one_line():
    with pytest.raises(ConfigError, match="--high-priority-stream-groups: no group named 'x'"):
        read_nccl_config(None, ["x"])


def test_the_cli_reads_the_file(tmp_path):
    path = tmp_path / "nccl.yaml"
    path.write_text(GOOD)
    assert run([*MOCK, "--nccl-communicator-config-path", str(path),
                "--high-priority-stream-groups", "dp"]) == (0, [])
    path.write_text("pp:\n  max_ctas: 0\n")
    code, errors = run([*MOCK, "--nccl-communicator-config-path", str(path)])
    assert code == 2 and len(errors) == 1 and str(path) in errors[0], errors


def test_options_are_nccl_options_of_the_named_group(monkeypatch):
    """On NCCL a group's settings become its ProcessGroupNCCL.Options (a stand-in here: the CPU
    build has no NCCL); without settings, or on gloo, new_group gets None."""
    class Options:
        def __init__(self, is_high_priority_stream=False):
            self.is_high_priority_stream = is_high_priority_stream
            self.config = SimpleNamespace()

    dims = ParallelDims.__new__(ParallelDims)
    dims.nccl = {"pp": {"max_ctas": 2, "net_name": "IB"}, "tp": {"is_high_priority_stream": True}}
    monkeypatch.setattr(dims_module.dist, "get_backend", lambda group=None: "gloo")
    assert dims.options("pp") is None
    monkeypatch.setattr(dims_module.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dims_module.dist, "ProcessGroupNCCL", SimpleNamespace(Options=Options),
                        raising=False)
    pp = dims.options("pp")
    assert (pp.is_high_priority_stream, vars(pp.config)) == (False, {"max_ctas": 2,
                                                                     "net_name": "IB"})
    tp = dims.options("tp")
    assert tp.is_high_priority_stream and vars(tp.config) == {}
    assert dims.options("dp") is None


def test_the_benchmark_file_reads():
    """benchmarks/nccl_pp_max_ctas2.yaml (gpu_suite.sh pp-prefetch) is a file the CLI takes."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "nccl_pp_max_ctas2.yaml"
    assert read_nccl_config(str(path)) == ({"pp": {"max_ctas": 2}}, [])
