"""Pretrain a Llama model (RMSNorm, SwiGLU, RoPE, no biases, untied output, grouped-query heads).

Single node, CPU (gloo), tensor-parallel over 2 processes:

    torchrun --nproc_per_node 2 pretrain_llama.py --model-preset llama-tiny \
        --tensor-model-parallel-size 2 --mock-data --train-iters 50 \
        --micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --log-interval 10

One GPU node (NCCL): Llama-2 7B, TP 8, bf16, selective recompute:

    # needs 8 GPUs
    torchrun --nproc_per_node 8 pretrain_llama.py --model-preset llama2-7b \
        --tensor-model-parallel-size 8 --sequence-parallel --bf16 --mock-data \
        --recompute-activations --micro-batch-size 1 --global-batch-size 32 \
        --train-iters 1000 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 100

Several nodes: run on every node, rendezvous at the first node's address:

    # needs 4 nodes of 8 GPUs
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_id llama70b --rdzv_backend c10d \
        --rdzv_endpoint $MASTER_ADDR:29500 pretrain_llama.py --model-preset llama2-70b \
        --tensor-model-parallel-size 8 --sequence-parallel --bf16 --mock-data \
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
        --micro-batch-size 1 --global-batch-size 256 --train-iters 10000 --lr 1.5e-4

Without torchrun it runs as one process: `python pretrain_llama.py --model-preset llama-tiny
--mock-data --train-iters 20`. Every flag and its policy: docs/flags.md.
"""

import sys

from megadomino.cli.launch import main

if __name__ == "__main__":
    sys.exit(main("llama"))
