"""Started by `srun` directly, one task per GPU: torchrun's variables from SLURM's.

    srun --ntasks-per-node 8 --gpus-per-node 8 python pretrain_gpt.py ...

`apply_slurm_env(os.environ)` sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from the
srun step (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE),
MASTER_ADDR from the first host of the step's node list (the node of task 0) and MASTER_PORT from
the job id, so that every task agrees without talking. It changes nothing under torchrun (RANK is
set) or outside an srun step: a batch script's own shell also carries SLURM_PROCID, but it is one
process, not a task of a parallel step. Variables already set are kept.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping

PORT_BASE, PORT_SPAN = 15000, 20000
"""MASTER_PORT = PORT_BASE + job id % PORT_SPAN: distinct for jobs sharing a node."""


def apply_slurm_env(environ: MutableMapping[str, str]) -> None:
    """Fill torch.distributed's env:// variables in `environ` from an srun step's variables."""
    if "RANK" in environ or "SLURM_PROCID" not in environ \
            or "SLURM_STEP_NUM_TASKS" not in environ:
        return
    node_id = int(environ.get("SLURM_NODEID", "0"))
    tasks_per_node = expand_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    derived = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
    }
    if node_id < len(tasks_per_node):
        derived["LOCAL_WORLD_SIZE"] = str(tasks_per_node[node_id])
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if nodelist:
        derived["MASTER_ADDR"] = first_host(nodelist)
    job_id = environ.get("SLURM_JOB_ID", "")
    if job_id.isdigit():
        derived["MASTER_PORT"] = str(PORT_BASE + int(job_id) % PORT_SPAN)
    for name, value in derived.items():
        environ.setdefault(name, value)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list, as `scontrol show hostnames` would list it first:
    'gpu[07-12,20],cpu3' -> 'gpu07'; 'rack[1-2]-n[003-004]' -> 'rack1-n003'."""
    host = []
    # Brackets are split off whole, so a comma that ends the first host is never inside one.
    for part in re.split(r"(\[[^\]]*\]|,)", nodelist.strip()):
        if part == ",":
            break
        if part.startswith("["):
            # '[07-12,20]' -> '07' (zero padding kept)
            part = part[1:-1].split(",")[0].split("-")[0]
        host.append(part)
    if not "".join(host):
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return "".join(host)


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed per-node task counts: '4(x2),3' -> [4, 4, 3]; '' -> []."""
    counts = []
    for item in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"cannot read SLURM tasks per node {spec!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts
