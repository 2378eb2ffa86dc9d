"""Per-layer forward+backward time of a transformer layer stack under tensor parallelism:
(a) the no-communication limit, (b) our plain TP, (c) megatron-core's TransformerBlock,
(d) DeepSpeed's DominoTransformer (GPT rows), (e) our Domino at every (N, K) tried - all in one
run, same shapes, bf16, random inputs.

    torchrun --nproc_per_node 4 benchmarks/bench_domino.py --rows core --out domino.json
    CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc_per_node 4 benchmarks/bench_domino.py \
        --rows core --peers deepspeed --out domino_ds.json

Timing: CUDA events around forward+backward of `--layers` layers (input grad and every weight
grad), median of `--iters` after `--warmup`, divided by the layer count; grads set to None
between iterations. `--profile` adds, for (b) and the best (e), one profiled iteration's kernel
timeline summary: compute busy time, NCCL time, and how much of NCCL ran under compute.
`--cuda-graph` times CUDA-graph replays of every column instead (gradients accumulate in place).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timeline import graphed, profile_summary  # noqa: E402

from megadomino.config import DominoPlan, ModelConfig, ParallelConfig  # noqa: E402
from megadomino.distributed import ParallelDims  # noqa: E402
from megadomino.distributed.mappings import no_tp_communication  # noqa: E402
from megadomino.distributed.random import model_parallel_seed  # noqa: E402
from megadomino.models.blocks import rotary_tables  # noqa: E402
from megadomino.models.transformer import TransformerBlock  # noqa: E402
from megadomino.overlap.domino.schedule import DominoRunner  # noqa: E402

ROWS = {
    # name: (preset, seq, micro_batch)
    "gpt3-6.7b": ("gpt3-6.7b", 2048, 4),
    "llama2-7b": ("llama2-7b", 2048, 4),
    "gpt3-13b": ("gpt3-13b", 2048, 4),
    "llama2-13b": ("llama2-13b", 2048, 4),
    "gpt3-6.7b-mb8": ("gpt3-6.7b", 2048, 8),
    "gpt3-6.7b-s4096": ("gpt3-6.7b", 4096, 2),
}
ROW_SETS = {"core": ["gpt3-6.7b", "llama2-7b"],
            "all": ["gpt3-6.7b", "llama2-7b", "gpt3-13b", "llama2-13b", "gpt3-6.7b-mb8"]}
CANDIDATES = [(1, 1), (2, 1), (1, 2), (1, 4), (2, 2), (4, 1)]


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def model_config(row: str, layers: int, **changes) -> tuple[ModelConfig, str, int]:
    preset, seq, micro_batch = ROWS[row]
    config = ModelConfig.preset(preset, num_layers=layers, seq_length=seq,
                                max_position_embeddings=seq, hidden_dropout=0.0,
                                attention_dropout=0.0, params_dtype="bfloat16", **changes)
    return config, ("llama" if preset.startswith("llama") else "gpt"), micro_batch


def time_step(step, warmup: int, iters: int) -> tuple[float, float]:
    """Median ms of step() (forward + backward) over iters, after warmup, and the median host
    time to enqueue it (host ~ device time means the step is CPU-bound)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    times, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        step()
        host.append((time.perf_counter() - begin) * 1e3)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    # every rank reports its median; the slowest rank is the step time
    median = torch.tensor([statistics.median(times), statistics.median(host)], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median[0].item(), median[1].item()


def reset_peak_memory() -> None:
    """Start a column's peak-memory count (torch.cuda.max_memory_allocated) from what is alive
    for it: the earlier columns' blocks are unreferenced by then, but a Domino block and its
    runner refer to each other (block.runner, runner.block), so without a collection such a
    block's weights and gradients stay allocated into the next columns' peaks."""
    gc.collect()
    torch.cuda.reset_peak_memory_stats()


def make_step(module, forward, x, grad_out, params, keep_grads=False):
    """forward + backward; grads set to None first unless keep_grads (CUDA-graph capture: the
    captured backward accumulates into the buffers the warm-up made)."""
    def step():
        if not keep_grads:
            for p in params:
                p.grad = None
            x.grad = None
        out = forward(x)
        out.backward(grad_out)
    return step


def ours(config, dims, rotary, parallel: ParallelConfig):
    block = TransformerBlock(config, dims, parallel, device="cuda")
    if parallel.domino.enabled:
        block.runner = DominoRunner(block, parallel.domino)

    # the final norm is not part of a layer: time the layers only
    def forward(inp):
        return block.run(inp, rotary) if block.runner is None else block.runner(inp, rotary)
    return block, forward


def bench_row(row: str, args, dims) -> dict:
    config, family, micro_batch = model_config(row, args.layers)
    layout = ParallelConfig(sequence_parallel=args.sequence_parallel)
    seq, hidden = config.seq_length, config.hidden_size
    local_seq = seq // dims.tp if args.sequence_parallel else seq
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(local_seq, micro_batch, hidden, device="cuda", dtype=torch.bfloat16,
                    generator=gen).requires_grad_()
    grad_out = torch.randn(local_seq, micro_batch, hidden, device="cuda", dtype=torch.bfloat16,
                           generator=gen)
    rotary = None
    if config.position_embedding_type == "rope":
        cos, sin = rotary_tables(seq, config.kv_channels, config.rotary_base, "cuda")
        rotary = (cos[:, None, None, :], sin[:, None, None, :])
    result = {"row": row, "family": family, "tp": dims.tp, "seq": seq,
              "micro_batch": micro_batch, "layers": args.layers,
              "sequence_parallel": args.sequence_parallel, "ms_per_layer": {}, "peak_gib": {},
              "profile": {}, "skipped": {}}

    def measure(name, module, forward, comm=True, profile=False, inputs=None):
        params = [p for p in module.parameters() if p.requires_grad]
        step = make_step(module, forward, *(inputs or (x, grad_out)), params,
                         keep_grads=args.cuda_graph)
        reset_peak_memory()
        if args.cuda_graph:
            try:
                if comm:
                    step = graphed(step)
                else:
                    with no_tp_communication(dims):
                        step = graphed(step)
            except Exception as error:  # report, time eagerly
                result["skipped"][name + " graph"] = f"{type(error).__name__}: {error}"[:300]
                log(f"  {row} {name}: CUDA graph capture failed ({error}); eager")
                torch.cuda.synchronize()
                step = make_step(module, forward, *(inputs or (x, grad_out)), params)
        if comm:
            ms, host_ms = time_step(step, args.warmup, args.iters)
            if profile:
                result["profile"][name] = profile_summary(step)
        else:
            with no_tp_communication(dims):
                ms, host_ms = time_step(step, args.warmup, args.iters)
        result["ms_per_layer"][name] = ms / args.layers
        result.setdefault("host_ms_per_layer", {})[name] = host_ms / args.layers
        result["peak_gib"][name] = torch.cuda.max_memory_allocated() / 2**30
        log(f"  {row} tp={dims.tp} {name:>24}: {ms / args.layers:.3f} ms/layer "
            f"(host {host_ms / args.layers:.3f})")

    model_parallel_seed(1, dims)
    block, forward = ours(config, dims, rotary, layout)
    measure("a_no_comm", block, forward, comm=False)
    measure("b_plain_tp", block, forward, profile=args.profile)
    del block, forward
    if args.comm_overlap and not args.sequence_parallel:
        sp_inputs = (x.detach()[: seq // dims.tp].clone().requires_grad_(),
                     grad_out[: seq // dims.tp].contiguous())
        for name, overlap in (("b_plain_tp_sp", False), ("f_sp_comm_overlap", True)):
            sp = ParallelConfig(sequence_parallel=True, tp_comm_overlap=overlap)
            block, forward = ours(config, dims, rotary, sp)
            if not overlap:  # the limit of the SP layout: all-gather -> repeat, RS -> slice
                measure("a_sp_no_comm", block, forward, comm=False, inputs=sp_inputs)
            measure(name, block, forward, profile=args.profile, inputs=sp_inputs)
            del block, forward
    ffn_local = config.ffn_hidden_size // dims.tp
    for n, k in CANDIDATES:
        if n > micro_batch or ffn_local % k:
            continue
        domino = ParallelConfig(sequence_parallel=args.sequence_parallel,
                                domino=DominoPlan(n, k, explicit_backward=True))
        block, forward = ours(config, dims, rotary, domino)
        measure(f"e_domino_N{n}_K{k}", block, forward, profile=args.profile)
        del block, forward
    domino = {k: v for k, v in result["ms_per_layer"].items() if k.startswith("e_")}
    if domino:
        best = min(domino, key=domino.get)
        result["best_domino"] = best
    if not args.sequence_parallel:  # the peers run without sequence parallelism
        for peer in args.peers:
            run_peer(peer, row, config, family, micro_batch, dims, args, result, measure)
    return result


def run_peer(peer, row, config, family, micro_batch, dims, args, result, measure) -> None:
    try:
        import peers
    except ImportError as error:
        result["skipped"][peer] = f"benchmarks/peers.py not importable: {error}"
        return
    if peer == "deepspeed" and family != "gpt":
        result["skipped"][peer] = "DeepSpeed's Domino has LayerNorm only and no GQA"
        return
    shape = peers.LayerShape(name=row, family=family, hidden=config.hidden_size,
                        heads=config.num_attention_heads, query_groups=config.num_query_groups,
                        ffn=config.ffn_hidden_size, seq=config.seq_length, micro_batch=micro_batch)
    builder = peers.build_megatron_block if peer == "megatron" else peers.build_deepspeed_domino
    try:
        module, forward = builder(shape, dims.tp, args.layers, torch.bfloat16)
    except Exception as error:  # a peer that fails to build is reported, not fatal
        module, forward = None, f"{type(error).__name__}: {error}"
    if module is None:
        result["skipped"][peer] = str(forward)
        log(f"  {row}: {peer} skipped: {forward}")
        return
    name = "c_megatron_core" if peer == "megatron" else "d_deepspeed_domino"
    measure(name, module, forward)


def table(results: list[dict]) -> str:
    """(e) is the best Domino plan; (f) sequence parallelism with the GEMM-fused communication
    (`--comm-overlap`); ratios of each peer against our best of (e) and (f). (a') is the
    no-communication limit of the sequence-parallel layout (norms and residuals on s / tp rows;
    all-gathers become local repeats, reduce-scatters slices), the tighter limit for (f)."""
    lines = ["| row | TP | (a) limit | (a') SP limit | (b) plain TP | (c) mcore | (d) DS Domino "
             "| (e) best Domino | (f) SP + fused comm | ours best / a | f / a' | b / ours "
             "| c / ours | d / ours |",
             "|" + " --- |" * 14]
    for r in results:
        ms = r["ms_per_layer"]
        a, b = ms.get("a_no_comm"), ms.get("b_plain_tp")
        c, d = ms.get("c_megatron_core"), ms.get("d_deepspeed_domino")
        f = min((v for k, v in ms.items() if k.startswith("f_sp_comm_overlap")), default=None)
        a_sp = ms.get("a_sp_no_comm")
        best = r.get("best_domino")
        e = ms.get(best) if best else None
        ours = min(v for v in (e, f) if v) if (e or f) else None
        fmt = lambda v: f"{v:.3f}" if v else "-"  # noqa: E731
        ratio = lambda p, q: f"{p / q:.2f}" if p and q else "-"  # noqa: E731
        lines.append(f"| {r['row']} | {r['tp']} | {fmt(a)} | {fmt(a_sp)} | {fmt(b)} | {fmt(c)} | "
                     f"{fmt(d)} | {fmt(e)} ({best}) | {fmt(f)} | {ratio(ours, a)} | "
                     f"{ratio(f, a_sp)} | {ratio(b, ours)} | {ratio(c, ours)} | {ratio(d, ours)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="core", help="core | all | comma-separated row names")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--peers", default="megatron",
                        help="comma-separated: megatron, deepspeed (or '' for none)")
    parser.add_argument("--plans", default="",
                        help="Domino (N, K) plans to try, e.g. '1x1,2x1' (default: a sweep)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--comm-overlap", action="store_true",
                        help="also time plain TP + SP without and with --tp-comm-overlap")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture each column's forward+backward in a CUDA graph and time "
                             "replays (host time drops out; a capture failure is reported)")
    parser.add_argument("--out", default="bench_domino.json")
    args = parser.parse_args()
    args.peers = [p for p in args.peers.split(",") if p]
    if args.plans:
        CANDIDATES[:] = [tuple(int(v) for v in plan.split("x")) for plan in args.plans.split(",")]
    rows = ROW_SETS.get(args.rows, args.rows.split(","))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    dims = ParallelDims(tp=dist.get_world_size())
    log(f"bench_domino: {torch.cuda.get_device_name()} x {dims.tp}, torch {torch.__version__}, "
        f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}")
    results = []
    for row in rows:
        results.append(bench_row(row, args, dims))
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "gpus": dims.tp,
                       "torch": torch.__version__, "env_max_connections":
                       os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "args": vars(args),
                       "results": results}, f, indent=2)
        print(table(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
