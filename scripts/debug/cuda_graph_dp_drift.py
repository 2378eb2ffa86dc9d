"""Localize the --enable-cuda-graph drift seen at TP 2 x DP 2 (GPU machine, 4 GPUs):

    MEGADOMINO_CUDA_GRAPH_ALLOW_DP=1 torchrun --standalone --nproc_per_node 4 \
        scripts/debug/cuda_graph_dp_drift.py

Trains a tiny GPT (fp32, TF32 off, dropout 0) for a few iterations, eager and with the layers
CUDA-graphed, at TP 2 x DP (world / 2) (`--nproc_per_node 2` is the control, TP 2 x DP 1, which
matched), and prints per iteration the loss and the gradient norm of both runs. The gradient
norm is taken before clipping, so a difference at iteration 1 is a gradient difference in the
first backward, not an optimizer effect. (First seen: losses equal for 2 iterations, then
1e-4..7e-4 relative apart; eager runs agree with each other exactly.)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megadomino.config import ModelConfig, TrainConfig
from megadomino.parallel import ParallelDims
from megadomino.training.loop import train


def run(dims: ParallelDims, graph: bool, iters: int) -> dict:
    model_config = ModelConfig.preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0,
                                      seq_length=64, params_dtype="float32",
                                      enable_cuda_graph=graph)
    train_config = TrainConfig(tensor_model_parallel_size=2, micro_batch_size=2,
                               global_batch_size=2 * dims.dp, train_iters=iters, lr=3e-3,
                               lr_warmup_iters=1, log_interval=100, mock_data=True)
    return train(model_config, train_config, dims, "gpt", log=lambda _line: None)


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    iters = 5
    dims = ParallelDims(tp=2, dp=dist.get_world_size() // 2)
    for graph in (False, True):
        history = run(dims, graph, iters)
        if dist.get_rank() == 0:
            print(f"TP2 x DP{dims.dp} graph={graph}: loss "
                  + " ".join(f"{v:.7f}" for v in history["losses"]) + " | grad norm "
                  + " ".join(f"{v:.7f}" for v in history["grad_norms"]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
