"""Convert Llama checkpoints between Hugging Face directories and megadomino checkpoints.

HF -> megadomino: a weights-only 'release' checkpoint (`DIR/release/mp_rank_XX/...`) that
`--load DIR` (or `--finetune --load DIR`) starts from; a run at another TP degree re-shards it on
load, so converting at TP 1 is enough:

    python scripts/convert_hf_llama.py hf-to-megadomino --hf-dir Llama-2-7b-hf --save ckpt/llama2-7b

megadomino -> HF: the latest checkpoint of DIR (any TP degree) as config.json + safetensors:

    python scripts/convert_hf_llama.py megadomino-to-hf --load ckpt/llama2-7b --hf-dir out/hf \
        --dtype bfloat16

One process runs at TP 1 on the CPU. Under `torchrun --nproc_per_node N ... \
--tensor-model-parallel-size N` each of N ranks reads or writes only its own shards (gloo, CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch.distributed as dist

from megadomino.config import ConfigError, ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.interop.hf import load_llama, save_llama
from megadomino.models.llama import LlamaModel
from megadomino.train import checkpoint
from megadomino.train.checkpoint import CheckpointError, Manifest, TrainingState
from megadomino.train.checkpoint.files import open_shard

DTYPES = ("float32", "bfloat16", "float16")


def hf_to_megadomino(hf_dir: str, save_dir: str, dims: ParallelDims, params_dtype: str) -> str:
    """Write the HF checkpoint in `hf_dir` as a release checkpoint of `save_dir`; its path."""
    model = load_llama(hf_dir, dims, params_dtype=params_dtype, device="cpu")
    target = checkpoint.save_checkpoint(save_dir, TrainingState(), model, None, dims,
                                        save_rng=False, release=True)
    return str(target)


def saved_model_config(load_dir: str) -> ModelConfig:
    """The ModelConfig stored in the latest checkpoint of `load_dir` (its known fields)."""
    iteration = checkpoint.latest_iteration(load_dir)
    if iteration is None:
        raise checkpoint.CheckpointError(f"{load_dir} has no {checkpoint.TRACKER}: not a "
                                         "megadomino checkpoint directory")
    source = checkpoint.checkpoint_dir(load_dir, iteration)
    path = checkpoint.shard_path(source, 0, 0, 1)
    saved = open_shard(path, Manifest.read(source))["model_config"]
    # Fields this version does not know (a newer writer's run options) are left out: the
    # architecture is what conversion needs, and load_checkpoint checks it against the shards.
    known = {field.name for field in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{name: value for name, value in saved.items() if name in known})


def megadomino_to_hf(load_dir: str, hf_dir: str, dims: ParallelDims, dtype: str | None,
                     max_shard_bytes: int) -> None:
    """Write the latest checkpoint of `load_dir` as an HF Llama directory `hf_dir`."""
    config = saved_model_config(load_dir)
    model = LlamaModel(config, dims, device="cpu")
    checkpoint.load_checkpoint(load_dir, model, dims, load_rng=False,
                               finetune=True, log=lambda line: print(line, flush=True))
    save_llama(model, hf_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_ours = commands.add_parser("hf-to-megadomino", help="HF directory -> release checkpoint")
    to_ours.add_argument("--hf-dir", required=True, help="config.json + *.safetensors")
    to_ours.add_argument("--save", required=True, help="megadomino checkpoint directory")
    to_ours.add_argument("--params-dtype", choices=DTYPES, default="float32",
                         help="dtype of the saved weights (default float32)")
    to_hf = commands.add_parser("megadomino-to-hf", help="latest checkpoint -> HF directory")
    to_hf.add_argument("--load", required=True, help="megadomino checkpoint directory")
    to_hf.add_argument("--hf-dir", required=True, help="output directory")
    to_hf.add_argument("--dtype", choices=DTYPES, default=None,
                       help="dtype of the safetensors (default: the checkpoint's params dtype)")
    to_hf.add_argument("--max-shard-size-gb", type=float, default=5.0,
                       help="split the safetensors into files of at most this size")
    for sub in (to_ours, to_hf):
        sub.add_argument("--tensor-model-parallel-size", type=int, default=1,
                         help="the TP degree to convert at (= WORLD_SIZE under torchrun)")
    return parser.parse_args(argv)


def init_process_group() -> None:
    """gloo over torchrun's environment, or a one-rank group with no network at all."""
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    init_process_group()
    try:
        dims = ParallelDims(tp=args.tensor_model_parallel_size)
        if args.command == "hf-to-megadomino":
            target = hf_to_megadomino(args.hf_dir, args.save, dims, args.params_dtype)
            message = f"wrote {target} from {args.hf_dir} (load it with --load {args.save})"
        else:
            megadomino_to_hf(args.load, args.hf_dir, dims, args.dtype,
                             int(args.max_shard_size_gb * 2**30))
            message = f"wrote {args.hf_dir} from {args.load}"
        if dims.rank == 0:
            print(message, flush=True)
    except (ConfigError, FileNotFoundError) as error:  # every rank reads the same files
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
