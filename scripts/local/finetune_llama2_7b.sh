#!/usr/bin/env bash
# Llama-2 7B supervised fine-tuning on one node: torchrun --standalone on GPUS_PER_NODE GPUs
# (default 8), with the hyperparameters and environment variables of
# scripts/slurm/finetune_llama2_7b.sbatch:
#
#   HF_DIR=Llama-2-7b-hf SFT_DATA=sft.jsonl OUTPUT_DIR=ckpt/llama2-7b-sft \
#     bash scripts/local/finetune_llama2_7b.sh [extra flags]
#
# DRY_RUN=1 prints the torchrun command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/../.."
LAUNCHER=local MEGADOMINO_DIR="$PWD" exec bash scripts/slurm/finetune_llama2_7b.sbatch "$@"
