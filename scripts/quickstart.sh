#!/usr/bin/env bash
# Set up and run a small GPT pretrain on learnable mock data: 2 GPUs at TP=2 if there are two,
# else 1 GPU, else 2 CPU processes (gloo) at TP=2. Extra arguments go to pretrain_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then nproc=2; tp=2; elif [ "$gpus" -eq 1 ]; then nproc=1; tp=1; else nproc=2; tp=2; fi
exec torchrun --standalone --nproc_per_node "$nproc" pretrain_gpt.py \
  --model-preset gpt-tiny --tensor-model-parallel-size "$tp" --mock-data \
  --micro-batch-size 8 --global-batch-size 16 --train-iters 50 \
  --lr 1e-2 --min-lr 1e-3 --lr-warmup-iters 5 --log-interval 5 --eval-interval 25 --eval-iters 2 \
  "$@"
