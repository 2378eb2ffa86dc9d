#!/usr/bin/env bash
# Llama-2 7B pretraining on one node: torchrun --standalone on GPUS_PER_NODE GPUs
# (default 8), with the hyperparameters and environment variables of
# scripts/slurm/pretrain_llama2_7b.sbatch:
#
#   DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=tokenizer.model \
#     bash scripts/local/pretrain_llama2_7b.sh [extra flags]
#
# DRY_RUN=1 prints the torchrun command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/../.."
LAUNCHER=local MEGADOMINO_DIR="$PWD" exec bash scripts/slurm/pretrain_llama2_7b.sbatch "$@"
