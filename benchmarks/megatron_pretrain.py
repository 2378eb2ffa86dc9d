"""megatron-core's own training step on one of our model presets: the peer column of
benchmarks/bench_pretrain.py (`--peer megatron`), launched with torchrun like pretrain_gpt.py.

What runs is what a Megatron-LM user's `pretrain_gpt.py` runs, without transformer-engine or
apex (neither reaches our GPUs): GPTModel from the local layer spec (torch norms, Megatron's
column/row-parallel linears, its jit-fused bias-GELU and bias-dropout-add), core attention
swapped for torch SDPA (benchmarks/peers.py; the local spec's own attention materializes the
s x s scores), wrapped in Float16Module and megatron-core's DistributedDataParallel (fp32
gradient buffers, overlapped bucketed reduce), its optimizer from `get_megatron_optimizer`
(torch AdamW: megatron-core's fallback without apex or transformer-engine; the distributed
optimizer when asked), and `get_forward_backward_func()`'s schedule (no pipelining, 1F1B or
interleaved 1F1B) with the grad/param sync and finalize hooks Megatron-LM's training loop
installs. Sequence parallelism needs transformer-engine or apex in megatron-core's local spec,
so a TP row runs without it.

Data are random tokens (mock data: the step's time does not depend on their values). Each log
line has the format of ours (train/report.py), parsed by bench_pretrain.py; the time of a log
window is the wall time between two CUDA-synchronized points, as ours, and FLOPs, TFLOP/s and
MFU come from megadomino.train.metrics, so both columns count the same model FLOPs.

    torchrun --nproc_per_node 2 benchmarks/megatron_pretrain.py --model-preset gpt3-1.3b \\
        --micro-batch-size 2 --global-batch-size 32 --train-iters 12 --log-interval 4 \\
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from megadomino.config import ModelConfig
from megadomino.train.metrics import (
    num_floating_point_operations,
    peak_memory_gib,
    peak_tflops,
    throughput,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import _sdpa_core_attention  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Megatron-LM's flag names for what the peer step varies (ours take the same)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-preset", default="gpt3-1.3b")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--log-interval", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--overlap-p2p-communication", action="store_true",
                   help="interleaved schedule: p2p overlapped with compute (batch_p2p off)")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """Our preset with the run's overrides: the shapes both columns build."""
    overrides = {"seq_length": args.seq_length, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    config = ModelConfig.preset(args.model_preset, **overrides)
    if config.position_embedding_type != "rope":
        config = config.replace(max_position_embeddings=max(config.max_position_embeddings,
                                                            args.seq_length))
    return config


def virtual_chunks(config: ModelConfig, args: argparse.Namespace) -> int | None:
    """Model chunks per pipeline stage under the interleaved schedule; None without it."""
    vp = args.num_layers_per_virtual_pipeline_stage
    return config.num_layers // (args.pipeline_model_parallel_size * vp) if vp else None


def transformer_config(config: ModelConfig, args: argparse.Namespace, dtype: torch.dtype,
                       cpu: bool = False):
    """megatron-core's TransformerConfig of `config`: its defaults where they run without
    transformer-engine or apex (fused bias-GELU / bias-dropout-add on), off where they need
    one of them (gradient-accumulation fusion, persistent LayerNorm, RoPE fusion). `cpu`: the
    weights are made on the CPU (tests/test_bench_pretrain.py builds the peer there)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = config.swiglu
    pp = args.pipeline_model_parallel_size
    return TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size, kv_channels=config.kv_channels,
        add_bias_linear=config.add_bias_linear, gated_linear_unit=llama,
        activation_func=F.silu if llama else F.gelu,  # its fused bias-GELU is the tanh one
        normalization=config.normalization, layernorm_epsilon=config.norm_epsilon,
        init_method_std=config.init_method_std, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_chunks(config, args),
        sequence_parallel=False, bias_activation_fusion=True, bias_dropout_fusion=True,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
        use_cpu_initialization=cpu, overlap_p2p_comm=args.overlap_p2p_communication,
        batch_p2p_comm=not args.overlap_p2p_communication)


def build_chunks(config: ModelConfig, transformer, tp: int,
                 device: str = "cuda") -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage), each a GPTModel in Float16Module."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    chunks = []
    for vp_stage in range(transformer.virtual_pipeline_model_parallel_size or 1):
        vp = vp_stage if transformer.virtual_pipeline_model_parallel_size else None
        spec = get_gpt_layer_local_spec(normalization=config.normalization)
        spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention()
        model = GPTModel(
            transformer, spec, vocab_size=config.padded_vocab_size(tp),
            max_sequence_length=config.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=vp),
            position_embedding_type=config.position_embedding_type,
            rotary_base=int(config.rotary_base),
            share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights,
            vp_stage=vp)
        chunks.append(Float16Module(transformer, model.to(device)))
    return chunks


def wrap(chunks, transformer, args: argparse.Namespace):
    """megatron-core's DDP around each chunk and its optimizer over all of them, with the hooks
    Megatron-LM's training loop sets on the config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather)
    model = [DistributedDataParallel(transformer, ddp_config, chunk,
                                     disable_bucketing=index > 0)
             for index, chunk in enumerate(chunks)]
    for chunk in model:
        chunk.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, bf16=True,
                        params_dtype=torch.bfloat16, clip_grad=1.0,
                        use_distributed_optimizer=args.use_distributed_optimizer),
        model)
    one = len(model) == 1
    if args.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        grad_sync = [chunk.start_grad_sync for chunk in model]
        transformer.no_sync_func = no_sync[0] if one else no_sync
        transformer.grad_sync_func = grad_sync[0] if one else grad_sync
    if args.overlap_param_gather and transformer.virtual_pipeline_model_parallel_size:
        # Megatron-LM aligns the param gathers with the schedule only when interleaved
        param_sync = [chunk.start_param_sync for chunk in model]
        transformer.param_sync_func = param_sync[0] if one else param_sync
    transformer.finalize_model_grads_func = finalize_model_grads
    transformer.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def batches(config: ModelConfig, args: argparse.Namespace, vocab: int):
    """Endless random micro-batches (tokens, labels, loss mask, positions) on this GPU."""
    b, s = args.micro_batch_size, args.seq_length
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    positions = torch.arange(s, device="cuda").expand(b, s)
    mask = torch.ones(b, s, device="cuda")
    while True:
        tokens = torch.randint(0, vocab, (b, s + 1), device="cuda", generator=generator)
        yield tokens[:, :-1], tokens[:, 1:], mask, positions


def forward_step(data_iterator, model):
    tokens, labels, mask, positions = next(data_iterator)
    losses = model(tokens, positions, None, labels=labels)

    def loss_func(output):
        loss = (output.float().view(-1) * mask.view(-1)).sum() / mask.sum()
        # the schedule divides the returned loss in place by the micro-batch count
        return loss, {"lm loss": loss.detach().clone()}

    return losses, loss_func


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = parse(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    config = model_config(args)
    transformer = transformer_config(config, args, torch.bfloat16)
    vp = transformer.virtual_pipeline_model_parallel_size
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model, optimizer = wrap(build_chunks(config, transformer, tp), transformer, args)
    dp = parallel_state.get_data_parallel_world_size()
    accumulation = args.global_batch_size // (args.micro_batch_size * dp)
    data = batches(config, args, config.vocab_size)
    iterators = [data] * len(model) if len(model) > 1 else data
    flops = num_floating_point_operations(config, args.global_batch_size,
                                          config.padded_vocab_size(tp))
    peak = peak_tflops(torch.cuda.get_device_name(), args.peak_tflops)
    step = get_forward_backward_func()
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for iteration in range(1, args.train_iters + 1):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = step(forward_step_func=forward_step, data_iterator=iterators, model=model,
                      num_microbatches=accumulation, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, forward_only=False)
        _, grad_norm, _ = optimizer.step()
        if iteration % args.log_interval:
            continue
        loss = torch.stack([x["lm loss"] for x in losses]).mean() if last else torch.zeros(
            (), device="cuda")
        dist.all_reduce(loss)  # the last stage's mean over its data-parallel ranks, to rank 0
        loss /= dp * tp  # every tensor-parallel rank of the last stage holds the mean
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.log_interval
        metrics = throughput(flops, args.global_batch_size * args.seq_length, seconds,
                             dist.get_world_size(), peak)
        mfu = f"MFU {100 * metrics['mfu']:.2f}% | " if "mfu" in metrics else ""
        if dist.get_rank() == 0:
            print(f" iteration {iteration:8d}/{args.train_iters:8d} | loss {loss.item():.6E} | "
                  f"lr {args.lr:.3E} | global batch {args.global_batch_size} | "
                  f"grad norm {grad_norm or 0.0:.3f} | {1e3 * seconds:.1f} ms/iter | "
                  f"{metrics['tokens_per_s']:.0f} tokens/s | "
                  f"{metrics['tflops_per_gpu']:.2f} TFLOP/s/GPU | {mfu}"
                  f"peak mem {peak_memory_gib(torch.device('cuda')):.2f} GiB", flush=True)
        start = time.perf_counter()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
