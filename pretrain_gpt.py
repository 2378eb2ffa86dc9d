"""Pretrain a GPT model (LayerNorm, GELU, learned positions, biases, tied embeddings).

Single node, CPU (gloo), tensor-parallel over 2 processes:

    torchrun --nproc_per_node 2 pretrain_gpt.py --model-preset gpt-tiny \
        --tensor-model-parallel-size 2 --mock-data --train-iters 50 \
        --micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --log-interval 10

One GPU node (NCCL): GPT-3 1.3B, TP 4 x DP 2, bf16:

    # needs 8 GPUs
    torchrun --nproc_per_node 8 pretrain_gpt.py --model-preset gpt3-1.3b \
        --tensor-model-parallel-size 4 --sequence-parallel --bf16 --mock-data \
        --micro-batch-size 4 --global-batch-size 64 --train-iters 1000 \
        --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-iters 100

Several nodes: run on every node, rendezvous at the first node's address:

    # needs 4 nodes of 8 GPUs
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_id gpt13b --rdzv_backend c10d \
        --rdzv_endpoint $MASTER_ADDR:29500 pretrain_gpt.py --model-preset gpt3-13b \
        --tensor-model-parallel-size 8 --sequence-parallel --bf16 --mock-data \
        --micro-batch-size 1 --global-batch-size 512 --train-iters 10000 --lr 1e-4

Without torchrun it runs as one process: `python pretrain_gpt.py --model-preset gpt-tiny
--mock-data --train-iters 20`. Every flag and its policy: docs/flags.md.
"""

import sys

from megadomino.cli.launch import main

if __name__ == "__main__":
    sys.exit(main("gpt"))
