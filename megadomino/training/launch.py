"""The main of pretrain_gpt.py and pretrain_llama.py: flags, process group, training loop.

Order matters for multi-rank runs: every rank parses and validates the flags against WORLD_SIZE
before any process group exists, so a bad flag makes each rank print `error: ...` and exit 2
instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import functools
import os
import socket
import sys

import torch
import torch.distributed as dist

from megadomino.config import ConfigError
from megadomino.parallel import ParallelDims
from megadomino.training.arguments import parse_args, validate_world


def main(family: str, argv: list[str] | None = None) -> int:
    """Train a `family` ('gpt' or 'llama') model from Megatron-LM flags (argv None: sys.argv[1:]).

    Works under torchrun and as a plain single process. Returns the exit status: 0, or 2 after
    printing `error: ...` for a configuration that cannot run.
    """
    try:
        model_config, train_config, notices = parse_args(argv, family)
        _default_to_single_process()
        validate_world(model_config, train_config, int(os.environ["WORLD_SIZE"]))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    if int(os.environ["RANK"]) == 0:
        for notice in notices:
            print(f"notice: {notice}", flush=True)
    # Imported only once the flags are good: a flag error never depends on the model code.
    from megadomino.training.loop import train

    _init_process_group()
    try:
        dims = ParallelDims(tp=train_config.tensor_model_parallel_size,
                            pp=train_config.pipeline_model_parallel_size,
                            gpus_per_node=train_config.gpus_per_node)
        train(model_config, train_config, dims, family, log=functools.partial(print, flush=True))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def _default_to_single_process() -> None:
    """Without torchrun's environment, run as rank 0 of 1 on a free local port."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])


def _init_process_group() -> None:
    """NCCL on this rank's GPU (LOCAL_RANK) when CUDA is available, else gloo on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
