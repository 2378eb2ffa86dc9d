"""The main of pretrain_gpt.py, pretrain_llama.py and finetune_llama.py: flags, tokenizer,
process group, datasets, training loop.

Order matters for multi-rank runs: every rank parses and validates the flags (and reads the
tokenizer, which sets the vocabulary, and --hf-checkpoint's tensor shapes) against WORLD_SIZE
before any process group exists, so a bad flag or file makes every rank exit 2 instead of
leaving the others waiting in a collective, its `error: ...` lines printed once per node, by
local rank 0 (the ranks of a node read the same flags, environment and files, so they fail
alike); a file read once the group exists (--data-path's, by rank 0 first) fails every rank
alike (rank 0's error, broadcast: printed once per node too); any other ConfigError met once
the group exists may differ by rank and prints on every rank. Exit status: 0
when the run ends or an --exit-* condition stops it (after saving), 2 for a configuration or an
input file that cannot run (a checkpoint --load names that cannot be loaded too), 1 for a
checkpoint that cannot be saved, for a loss that became NaN, and for a rank that stopped
answering: each rank's heartbeat (cli/heartbeat.py),
on gloo and NCCL alike, prints `error: rank N stopped answering (no heartbeat for X s;
--distributed-timeout-minutes T); ending this rank (R)` once a peer's heartbeat has been silent
for half of T, so before NCCL's watchdog would end the process at T with no such line. When
gloo's timeout of a collective comes first, the line names the ranks whose heartbeat is stale, or
says that every rank still beats (one waits elsewhere): a live rank that entered the collective
later is never named. Each rank prints one such line, at most T/2 plus 2 heartbeat intervals (T/12
clamped to 0.5-10 s) after a peer stopped.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import sys

import torch
import torch.distributed as dist

from megadomino.cli.arguments import parse_run
from megadomino.cli.heartbeat import Heartbeat, StalledRankError
from megadomino.cli.slurm_env import apply_slurm_env
from megadomino.config import ConfigError
from megadomino.config.diloco import site_count
from megadomino.config.nccl import read_nccl_config
from megadomino.config.pipeline_plan import AUTO, resolve_plan
from megadomino.config.validate import validate
from megadomino.distributed import ParallelDims, comm


def main(family: str, argv: list[str] | None = None, finetune: bool = False) -> int:
    """Train a `family` ('gpt' or 'llama') model from Megatron-LM flags (argv None: sys.argv[1:]);
    `finetune`: supervised fine-tuning on --data-path's JSONL (finetune_llama.py's flags).

    Works under torchrun, started by srun directly (one task per GPU), and as a plain single
    process. Returns the exit status.
    """
    try:
        config, notices, read = parse_run(argv, family, finetune)
        # Imported only once the flags are good: a flag error never depends on the model code.
        from megadomino.train.inputs import run_tokenizer

        config, tokenizer = run_tokenizer(config)
        if config.train.checkpoint.hf_checkpoint is not None:  # against the tokenizer's vocab too
            from megadomino.interop.hf import check_hf_checkpoint

            check_hf_checkpoint(config.train.checkpoint.hf_checkpoint, config.model)
        world_size, local_size = _launch_world()
        validate(config, world_size, local_size, finetune=finetune, plan=read)
        nccl, nccl_notices = read_nccl_config(config.parallel.nccl_communicator_config_path,
                                              config.parallel.high_priority_stream_groups or ())
        # the run's one plan, before any group (--pipeline-plan auto's once the group exists)
        plan = None if config.parallel.pipeline_plan == AUTO else resolve_plan(config,
                                                                              world_size, read)
    except ConfigError as err:
        if _local_rank() == 0:  # the node's other ranks met the same error: one prints it
            _print_errors(err)
        return 2
    if int(os.environ["RANK"]) == 0:
        for notice in notices + nccl_notices:
            print(f"notice: {notice}", flush=True)
    from megadomino.train.checkpoint import CheckpointError
    from megadomino.train.inputs import build_datasets, hf_model_init
    from megadomino.train.loop import train
    from megadomino.train.report import NonFiniteLossError
    from megadomino.zero.diloco import ReplicaMismatchError

    parallel, timeout = config.parallel, config.train.runtime.distributed_timeout_minutes
    _init_process_group(timeout)
    heartbeat = None
    try:
        if world_size > 1:
            heartbeat = Heartbeat(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  dist.get_rank(), world_size, timeout)
            heartbeat.start()
        if plan is None:
            config, plan = _plan_auto(config)
        dims = ParallelDims(gpus_per_node=parallel.gpus_per_node or local_size,
                            timeout=datetime.timedelta(minutes=timeout), plan=plan,
                            sites=site_count(parallel, world_size, local_size), nccl=nccl)
        train_data, valid_data = build_datasets(config, dims, tokenizer, finetune)
        model_init = None
        if config.train.checkpoint.hf_checkpoint is not None:
            model_init = hf_model_init(config.train.checkpoint.hf_checkpoint)
        train(config, dims, family, functools.partial(print, flush=True), train_data,
              valid_data, model_init, _data_description(config.train.data))
        # Every rank done before any tears down: a gloo run whose two ranks finished apart once
        # aborted at exit ("terminate called without an active exception", CI, not reproduced).
        comm.barrier()
    except ConfigError as err:
        if not err.alike or _local_rank() == 0:  # alike: the node's other ranks hold it too
            _print_errors(err)
        return 2
    except (CheckpointError, NonFiniteLossError, ReplicaMismatchError, StalledRankError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as err:
        # A world of one waits for no peer: its timeout would be our bug, with its traceback.
        if heartbeat is None or not _collective_timed_out(err):
            raise  # our own bugs keep their tracebacks
        line = heartbeat.after_timeout()  # None: the heartbeat said its line and ends the rank
        if line is not None:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return 1
    finally:
        if heartbeat is not None:
            heartbeat.stop()  # before the store's host (rank 0) may go away with its group
        dist.destroy_process_group()
    return 0


def _launch_world() -> tuple[int, int]:
    """(world size, ranks on this node) as torchrun's variables give them: set from SLURM's
    when srun started the process directly, a single process's when none are set."""
    apply_slurm_env(os.environ)
    _default_to_single_process()
    world_size = int(os.environ["WORLD_SIZE"])
    return world_size, _local_world_size(world_size)


def _plan_auto(config):
    """--pipeline-plan auto's config and plan, planned from the measured world once its process
    group exists (pipeline/placement/resolve.py), every rank the same."""
    from megadomino.pipeline.placement.resolve import resolve_auto

    return resolve_auto(config, functools.partial(print, flush=True))


def _print_errors(err: ConfigError) -> None:
    """One `error:` line per message of `err` (every bad flag of the command)."""
    for message in err.messages or [str(err)]:
        print(f"error: {message}", file=sys.stderr, flush=True)


def _local_rank() -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK, else an srun task's SLURM_LOCALID
    (apply_slurm_env may not have run yet), else 0 (a single process)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def _collective_timed_out(err: RuntimeError) -> bool:
    """gloo's timeout of a collective whose peer never answered (a RuntimeError of its own)."""
    return "Timed out waiting" in str(err) or (isinstance(err, dist.DistBackendError)
                                                and "timeout" in str(err).lower())


def _local_world_size(world_size: int) -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE,
    else the whole world (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world_size)))


def _default_to_single_process() -> None:
    """Without torchrun's environment, run as rank 0 of 1 on a free local port; half of it (one
    of RANK and WORLD_SIZE) is a ConfigError naming the one that is missing."""
    given = [name for name in ("RANK", "WORLD_SIZE") if name in os.environ]
    if len(given) == 1:
        missing = "WORLD_SIZE" if given == ["RANK"] else "RANK"
        raise ConfigError(f"the environment sets {given[0]} but not {missing}: launch with "
                          "torchrun (it sets both), or set both, or neither for one process")
    if given:
        return
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])


def _init_process_group(timeout_minutes: float) -> None:
    """NCCL on this rank's GPU (LOCAL_RANK) when CUDA is available, else gloo on the CPU; every
    collective waits at most `timeout_minutes` (--distributed-timeout-minutes)."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # Bound to its device, NCCL creates the world's communicator now and splits each group
        # from it as the group is made, instead of creating one lazily at a group's first
        # collective, which waits for every member (a P2P batch naming only some of them hangs).
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def _data_description(config) -> str:
    """The data as the flags give it, for the start-up summary."""
    if config.mock_data:
        return "mock data (--mock-data)"
    return f"--data-path {' '.join(config.data_path)} (--split {config.split})"
