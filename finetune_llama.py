"""Supervised fine-tuning (SFT) of a Llama model on prompt/response pairs, loss on the responses.

One GPU node (NCCL): Llama-2 7B from its Hugging Face checkpoint, TP 4 x DP 2, bf16; resumes from
--load after a requeue (the first run finds no checkpoint there and starts from --hf-checkpoint):

    # needs 8 GPUs
    torchrun --nproc_per_node 8 finetune_llama.py --hf-checkpoint /models/Llama-2-7b-hf \
        --tokenizer-type Llama2Tokenizer --tokenizer-model /models/Llama-2-7b-hf/tokenizer.model \
        --data-path /data/sft.jsonl --split 98,2,0 --prompt-template "[INST] {prompt} [/INST]" \
        --seq-length 2048 --tensor-model-parallel-size 4 --sequence-parallel --bf16 \
        --micro-batch-size 2 --global-batch-size 64 --train-iters 1000 --lr 2e-5 \
        --min-lr 2e-6 --lr-decay-style cosine --lr-warmup-iters 30 --weight-decay 0.0 \
        --save /ckpt/llama2-7b-sft --save-interval 200 --load /ckpt/llama2-7b-sft \
        --exit-signal-handler --log-interval 10 --eval-interval 100 --eval-iters 10

Several nodes: the same flags after torchrun's rendezvous, on every node:

    # needs 2 nodes of 8 GPUs
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_id sft --rdzv_backend c10d \
        --rdzv_endpoint $MASTER_ADDR:29500 finetune_llama.py --hf-checkpoint /models/Llama-2-7b-hf \
        --tokenizer-type Llama2Tokenizer --tokenizer-model /models/Llama-2-7b-hf/tokenizer.model \
        --data-path /data/sft.jsonl --split 98,2,0 --prompt-template "[INST] {prompt} [/INST]" \
        --seq-length 4096 --tensor-model-parallel-size 8 --sequence-parallel --bf16 \
        --micro-batch-size 1 --global-batch-size 128 --train-iters 2000 --lr 2e-5 \
        --save /ckpt/sft --save-interval 200 --load /ckpt/sft --exit-signal-handler

CPU (gloo), two processes: pretrain a tiny Llama on mock data, then fine-tune its weights on the
JSONL of token ids the repository ships (NullTokenizer reads space-separated ids below
`--vocab-size` and adds the end-of-document id `--vocab-size` itself: 512 ids, the preset's):

    torchrun --nproc_per_node 2 pretrain_llama.py --model-preset llama-tiny --mock-data \
        --micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 1e-3 \
        --save ckpt/pretrained --log-interval 10
    torchrun --nproc_per_node 2 finetune_llama.py --model-preset llama-tiny \
        --load ckpt/pretrained --finetune --tokenizer-type NullTokenizer --vocab-size 511 \
        --data-path tests/fixtures/sft_ids.jsonl --split 90,10,0 --micro-batch-size 4 \
        --global-batch-size 8 --train-iters 20 --lr 1e-3 --save ckpt/sft --log-interval 10

Data (`--data-path`, one or more JSONL files): one example per line,
`{"prompt": "...", "response": "..."}`. A sample is one example: the prompt laid out by
`--prompt-template` (with `{prompt}` where the prompt goes; default `{prompt}`), then the
response and the tokenizer's end-of-document token, cut or padded to `--seq-length` + 1 tokens.
The loss counts the response's tokens and its end-of-document token only (see
`megadomino/data/sft.py`). `--split` divides the examples, in file order, into train and
validation parts; `--eval-interval` / `--eval-iters` report validation loss and perplexity.

Start: `--hf-checkpoint DIR` (a Hugging Face Llama directory, config.json + safetensors; the
architecture comes from its config.json, and flags such as `--seq-length` override it; loaded by
`megadomino.interop.hf.load_llama` at any TP degree, into pipeline stages at any PP), or `--load
DIR --finetune` (a megadomino checkpoint, weights only), or `--load DIR` alone to resume a
fine-tuning run. The tokenizer is given as in pretraining (`--tokenizer-type` and its files) and
must match the checkpoint's vocabulary. Every other flag is Megatron-LM's, with the policy of
docs/flags.md; the two of this script are `--hf-checkpoint` and `--prompt-template`.
`--eod-mask-loss` is refused.
"""

import sys

from megadomino.cli.launch import main

if __name__ == "__main__":
    sys.exit(main("llama", finetune=True))
