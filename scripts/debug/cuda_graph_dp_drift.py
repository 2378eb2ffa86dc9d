"""The --enable-cuda-graph drift at TP 2 x DP 2, before and after its fix (GPU machine, 4 GPUs):

    torchrun --standalone --nproc_per_node 4 \\
        scripts/debug/cuda_graph_dp_drift.py

Trains a tiny GPT (fp32, TF32 off, dropout 0) for a few iterations at TP 2 x DP (world / 2):
eager, CUDA-graphed, and CUDA-graphed with the gradient hooks' stream join switched off (the code
before the fix: `distributed.streams.HookStreams.join` a no-op), and prints per iteration the loss
and the pre-clip gradient norm of each. The cause: the graphed layers' AccumulateGrad nodes run
on the capture's side stream, the embedding's on the main one, and the DP bucket's all-reduce was
enqueued on the stream of its last hook without waiting for the other (distributed/streams.py).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megadomino.config import (
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)
from megadomino.distributed import ParallelDims
from megadomino.distributed.streams import HookStreams
from megadomino.train.loop import train


def run(dims: ParallelDims, graph: bool, iters: int) -> dict:
    model_config = ModelConfig.preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0,
                                      seq_length=64, params_dtype="float32")
    schedule = ScheduleConfig(micro_batch_size=2, global_batch_size=2 * dims.dp,
                              train_iters=iters, lr=3e-3, lr_warmup_iters=1)
    config = Config(model_config,
                    ParallelConfig(tensor_model_parallel_size=2, enable_cuda_graph=graph),
                    TrainConfig(schedule=schedule, data=DataConfig(mock_data=True),
                                logging=LoggingConfig(log_interval=100)))
    return train(config, dims, "gpt", log=lambda _line: None)


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    iters = 8
    dims = ParallelDims(tp=2, dp=dist.get_world_size() // 2)
    join = HookStreams.join
    for name, graph, joined in (("eager", False, True), ("graph", True, True),
                                ("graph, no stream join", True, False)):
        HookStreams.join = join if joined else (lambda self, key: self._seen.pop(key, None))
        history = run(dims, graph, iters)
        if dist.get_rank() == 0:
            print(f"TP2 x DP{dims.dp} {name}: loss "
                  + " ".join(f"{v:.7f}" for v in history["losses"]) + " | grad norm "
                  + " ".join(f"{v:.7f}" for v in history["grad_norms"]), flush=True)
    HookStreams.join = join
    # destroy_process_group() hung here on the GPU machine (three runs' graphs, and the NCCL and
    # symmetric-memory state they captured, alive in one process): leave without it.
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)


if __name__ == "__main__":
    main()
