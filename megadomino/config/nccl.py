"""Per-group NCCL communicator settings: Megatron-LM's `--nccl-communicator-config-path` (a YAML
file mapping a group's name to its settings) and `--high-priority-stream-groups`.

A file such as

    pp:
      max_ctas: 2
    tp:
      is_high_priority_stream: true

makes the pipeline's groups (the pipeline group and each two-rank P2P channel) run their NCCL
kernels on at most 2 thread blocks, and the tensor-parallel group's on a high-priority stream.
The settings are NCCL's own (`ncclConfig_t`: `min_ctas`, `max_ctas`, `cga_cluster_size`,
`net_name` 'IB' or 'socket') and torch's `is_high_priority_stream`, handed to
`torch.distributed.new_group` as `ProcessGroupNCCL.Options` (ParallelDims); on gloo they do not
apply.

Why a knob: an NCCL kernel holds its thread blocks (each an SM) from its launch until its
message is through, so a receive posted ahead of the compute that precedes it (the pipeline's
prefetch) takes those SMs from the compute's kernels while it waits.

The group names are Megatron-LM's. Those of groups this library makes are applied (GROUPS);
those of groups it has no counterpart of (context, expert and the combined groups) are
accepted with a notice, as a Megatron-LM launch script may carry them; any other name, key or
value is refused as one line naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from megadomino.config.check import ConfigError

GROUPS = {"tp": "the tensor-parallel group", "dp": "the data-parallel group",
          "pp": "the pipeline group and its point-to-point channels",
          "embd": "the tied embedding's group (first and last pipeline stages)"}
"""The groups a file may tune here, by Megatron-LM's names."""
ELSEWHERE = ("cp", "hcp", "dp_cp", "intra_dp_cp", "mp", "tp_dp_cp", "tp_dp", "tp_cp", "ep",
             "ep_tp", "ep_dp", "ep_tp_pp", "expt_dp", "expt_tp", "tp_ep_pp", "pos_embd",
             "gtp_remat", "gtp_remat_dp", "gtp_remat_dp_cp", "expt_gtp_remat")
"""Megatron-LM's other group names: no such group is made here."""
KEYS = {"min_ctas": int, "max_ctas": int, "cga_cluster_size": int, "net_name": str,
        "is_high_priority_stream": bool}
NET_NAMES = ("ib", "socket")


def read_nccl_config(path: str | None, high_priority: tuple[str, ...] | list[str] = ()
                     ) -> tuple[dict[str, dict], list[str]]:
    """The file's settings per group this library makes, `high_priority` groups marked
    `is_high_priority_stream`, and the notices of names without a group here. ConfigError (one
    line naming the flag and the file) for anything else."""
    flag = f"--nccl-communicator-config-path {path}"
    settings: dict[str, dict] = {}
    if path is not None:
        settings = _parse(Path(path), flag)
    for name in high_priority:
        if name not in GROUPS and name not in ELSEWHERE:
            raise ConfigError(f"--high-priority-stream-groups: no group named {name!r}; "
                              f"the groups are {', '.join(GROUPS)}")
        settings.setdefault(name, {})["is_high_priority_stream"] = True
    notices = [f"{name}: NCCL settings of a group megadomino does not make, not applied"
               for name in settings if name in ELSEWHERE]
    return {n: s for n, s in settings.items() if n in GROUPS}, notices


def _parse(path: Path, flag: str) -> dict[str, dict]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{flag}: not a readable YAML file "
                          f"({type(err).__name__}); want group names mapping to NCCL "
                          "settings, e.g. 'pp: {max_ctas: 2}'") from None
    if not isinstance(data, Mapping) or not data:
        raise ConfigError(f"{flag}: want a mapping of group names to NCCL settings, e.g. "
                          "'pp: {max_ctas: 2}'")
    out = {}
    for name, entry in data.items():
        if name not in GROUPS and name not in ELSEWHERE:
            raise ConfigError(f"{flag}: no group named {name!r}; the groups are "
                              f"{', '.join(GROUPS)} (and Megatron-LM's others, not applied)")
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{flag}: group {name!r} wants a mapping of settings "
                              f"({', '.join(KEYS)}), not {entry!r}")
        out[name] = {key: _setting(flag, name, key, value) for key, value in entry.items()}
    return out


def _setting(flag: str, group: str, key: str, value):
    want = KEYS.get(key)
    if want is None:
        raise ConfigError(f"{flag}: group {group!r} has no setting {key!r}; the settings are "
                          f"{', '.join(KEYS)}")
    ok = isinstance(value, want) and (want is not int or not isinstance(value, bool))
    if want is int:
        ok = ok and value >= 1
    if key == "net_name":
        ok = ok and value.lower() in NET_NAMES
    if not ok:
        kind = {int: "a positive integer", bool: "true or false",
                str: "'IB' or 'socket'"}[want]
        raise ConfigError(f"{flag}: {group}.{key} is {value!r}; want {kind}")
    return value
