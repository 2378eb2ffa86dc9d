#!/usr/bin/env bash
# Supervised fine-tuning of Llama-2 7B end to end, on one node: a Hugging Face checkpoint and
# JSONL {"prompt", "response"} pairs in; the fine-tuned model out as a megadomino checkpoint
# (WORK_DIR/checkpoint) and as a Hugging Face directory (WORK_DIR/hf).
#
#   HF_DIR=Llama-2-7b-hf SFT_DATA=sft.jsonl WORK_DIR=runs/sft \
#     bash scripts/finetune/llama2_7b_sft.sh [extra finetune_llama.py flags]
#
# HF_DIR holds config.json, the safetensors and Llama-2's tokenizer.model; the loss covers the
# responses only. Without downloads, DEMO=1 first builds the inputs in WORK_DIR: a learnable
# task (sums and word reversal), a sentencepiece tokenizer trained on it, and a randomly
# initialised HF Llama with the 7B shape (DEMO_PRESET, default llama2-7b) but DEMO_LAYERS layers
# (default 4):
#
#   DEMO=1 WORK_DIR=runs/sft-demo GPUS_PER_NODE=1 TP=1 ITERS=300 \
#     bash scripts/finetune/llama2_7b_sft.sh
#
# Steps: 1. (DEMO=1) scripts/finetune/make_demo_inputs.py and scripts/train_tokenizer.py;
# 2. finetune_llama.py through scripts/local/finetune_llama2_7b.sh, with the hyperparameters of
#    scripts/slurm/finetune_llama2_7b.sbatch (GPUS_PER_NODE, TP, ITERS, MICRO_BATCH and
#    PROMPT_TEMPLATE are read there); re-running resumes from WORK_DIR/checkpoint;
# 3. scripts/convert_hf_llama.py megadomino-to-hf, plus the tokenizer, into WORK_DIR/hf.
# Extra arguments go to finetune_llama.py after the recipe's and win (e.g. --lr 1e-5).
# DRY_RUN=1 prints every step's command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/slurm/common.sh

WORK_DIR=${WORK_DIR:?set WORK_DIR, where the outputs go}
recipe_args=()
if [ "${DEMO:-0}" = 1 ]; then
  HF_DIR=$WORK_DIR/demo_hf
  SFT_DATA=$WORK_DIR/sft.jsonl
  if [ ! -e "$HF_DIR/config.json" ]; then
    megadomino_run mkdir -p "$HF_DIR"
    megadomino_run python3 scripts/finetune/make_demo_inputs.py data --out "$SFT_DATA"
    megadomino_run python3 scripts/train_tokenizer.py --input "$SFT_DATA" \
      --json-keys prompt response --model-prefix "$HF_DIR/tokenizer" --vocab-size 512
    megadomino_run python3 scripts/finetune/make_demo_inputs.py model \
      --tokenizer-model "$HF_DIR/tokenizer.model" --preset "${DEMO_PRESET:-llama2-7b}" \
      --num-layers "${DEMO_LAYERS:-4}" --out "$HF_DIR"
  fi
  # A random start moves faster with a larger step; the task's examples fit in 64 tokens.
  recipe_args=(--lr 1e-4 --min-lr 1e-5 --seq-length 64 --global-batch-size 32)
fi

HF_DIR=${HF_DIR:?set HF_DIR to a Hugging Face Llama directory (or DEMO=1)} \
SFT_DATA=${SFT_DATA:?set SFT_DATA to the JSONL file(s) (or DEMO=1)} \
OUTPUT_DIR=$WORK_DIR/checkpoint \
  bash scripts/local/finetune_llama2_7b.sh "${recipe_args[@]}" "$@"

megadomino_run python3 scripts/convert_hf_llama.py megadomino-to-hf \
  --load "$WORK_DIR/checkpoint" --hf-dir "$WORK_DIR/hf"
megadomino_run cp "${TOKENIZER_MODEL:-$HF_DIR/tokenizer.model}" "$WORK_DIR/hf/tokenizer.model"
