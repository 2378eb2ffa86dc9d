"""Per-layer forward+backward time of a transformer layer stack under tensor parallelism:
(a) the no-communication limit, (b) our plain TP, (c) megatron-core's TransformerBlock,
(d) DeepSpeed's DominoTransformer (GPT rows), (e) our Domino at every (N, K) tried, (f) SP with
the collectives fused into the GEMMs (`--comm-overlap`) - all in one run, same shapes, random
inputs (bf16 on GPUs, fp32 on CPUs).

    torchrun --nproc_per_node 4 benchmarks/bench_domino.py --rows core --out domino.json
    CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc_per_node 4 benchmarks/bench_domino.py \
        --rows core --peers deepspeed --out domino_ds.json
    # the communication-bound testbed: NCCL kept off GPU peer-to-peer, 3 rounds, auto's choice
    torchrun --nproc_per_node 2 benchmarks/bench_domino.py --rows link --link pcie --rounds 3 \
        --comm-overlap --auto --out domino_pcie.json
    # CPU, gloo (benchmarks/bench_domino_netns.sh runs it across two emulated hosts)
    torchrun --nproc_per_node 2 benchmarks/bench_domino.py --device cpu --rows cpu --peers ''

Timing: CUDA events around forward+backward of `--layers` layers (input grad and every weight
grad), median of `--iters` after `--warmup`, divided by the layer count (on a CPU: the wall
clock); grads set to None between iterations. `--rounds R` times every column R times, the
columns of a row in order within each round (a round rebuilds each column), and reports the
median and range over rounds. `--link` exports a link setting's NCCL variables in every rank
before NCCL starts (benchmarks/domino_links.py), and each row records the collectives' bus
bandwidth at its message sizes and the share of plain TP's layer time the collectives take
(benchmarks/domino_report.py says how). `--auto` times the plans `--domino` compares, with its
own code, on the row's shape, and reports its choice against the best of those plans as this
run measured them. `--profile` adds, for (b) and the best (e), one profiled iteration's kernel
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
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import domino_links as links  # noqa: E402
import domino_report as report  # noqa: E402
from timeline import graphed, profile_summary  # noqa: E402

from megadomino.build import build_model  # noqa: E402
from megadomino.config import DominoPlan, ModelConfig, ParallelConfig  # noqa: E402
from megadomino.distributed import ParallelDims  # noqa: E402
from megadomino.distributed.mappings import no_tp_communication  # noqa: E402
from megadomino.distributed.random import model_parallel_seed  # noqa: E402
from megadomino.models.blocks import rotary_tables  # noqa: E402
from megadomino.models.transformer import TransformerBlock  # noqa: E402
from megadomino.overlap.domino import autotune  # noqa: E402
from megadomino.overlap.domino.schedule import DominoRunner  # noqa: E402


@dataclass(frozen=True)
class Row:
    preset: str
    seq: int
    micro_batch: int
    shape: tuple[tuple[str, int], ...] = ()
    """ModelConfig fields changed from the preset (the CPU rows' small layers)."""


CPU_SHAPE = (("hidden_size", 256), ("num_attention_heads", 4), ("vocab_size", 1024))
ROWS = {
    "gpt3-6.7b": Row("gpt3-6.7b", 2048, 4),
    "llama2-7b": Row("llama2-7b", 2048, 4),
    "gpt3-13b": Row("gpt3-13b", 2048, 4),
    "llama2-13b": Row("llama2-13b", 2048, 4),
    "gpt3-6.7b-mb8": Row("gpt3-6.7b", 2048, 8),
    "llama2-7b-mb8": Row("llama2-7b", 2048, 8),
    "gpt3-6.7b-s4096": Row("gpt3-6.7b", 4096, 2),
    "cpu-gpt": Row("gpt3-6.7b", 128, 4, (*CPU_SHAPE, ("ffn_hidden_size", 1024))),
    "cpu-llama": Row("llama2-7b", 128, 4, (*CPU_SHAPE, ("ffn_hidden_size", 704))),
}
ROW_SETS = {"core": ["gpt3-6.7b", "llama2-7b"],
            "all": ["gpt3-6.7b", "llama2-7b", "gpt3-13b", "llama2-13b", "gpt3-6.7b-mb8"],
            "link": ["gpt3-6.7b", "gpt3-6.7b-mb8", "llama2-7b", "llama2-7b-mb8"],
            "cpu": ["cpu-gpt", "cpu-llama"]}
CANDIDATES = sorted({*autotune.CANDIDATES, (1, 4)})
"""The default (N, K) sweep: every plan `--domino` compares, and 1x4."""


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def model_config(row: str, layers: int, dtype: str) -> tuple[ModelConfig, str, int]:
    spec = ROWS[row]
    config = ModelConfig.preset(spec.preset, num_layers=layers, seq_length=spec.seq,
                                max_position_embeddings=spec.seq, hidden_dropout=0.0,
                                attention_dropout=0.0, params_dtype=dtype, **dict(spec.shape))
    return config, ("llama" if spec.preset.startswith("llama") else "gpt"), spec.micro_batch


def time_step(step, warmup: int, iters: int, device: torch.device) -> tuple[float, float]:
    """Median ms of step() (forward + backward) over iters, after warmup, and the median host
    time to enqueue it (host ~ device time means the step is CPU-bound; on a CPU they are one)."""
    start, stop = links.device_timer(device)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    times, host = [], []
    for _ in range(iters):
        begin, host_begin = start(), time.perf_counter()
        step()
        host.append((time.perf_counter() - host_begin) * 1e3)
        times.append(stop(begin))
    # every rank reports its median; the slowest rank is the step time
    median = torch.tensor([statistics.median(times), statistics.median(host)], device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median[0].item(), median[1].item()


def reset_peak_memory(device: torch.device) -> None:
    """Start a column's peak-memory count (torch.cuda.max_memory_allocated) from what is alive
    for it: the earlier columns' blocks are unreferenced by then, but a Domino block and its
    runner refer to each other (block.runner, runner.block), so without a collection such a
    block's weights and gradients stay allocated into the next columns' peaks."""
    gc.collect()
    if device.type == "cuda":
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


def ours(config, dims, rotary, parallel: ParallelConfig, device):
    block = TransformerBlock(config, dims, parallel, device=device)
    if parallel.domino.enabled:
        block.runner = DominoRunner(block, parallel.domino)

    # the final norm is not part of a layer: time the layers only
    def forward(inp):
        return block.run(inp, rotary) if block.runner is None else block.runner(inp, rotary)
    return block, forward


class Columns:
    """One row's shapes and inputs; `run_round` times every column once into `result`."""

    def __init__(self, row: str, args, dims: ParallelDims, device: torch.device, result: dict):
        self.row, self.args, self.dims, self.device, self.result = row, args, dims, device, result
        self.config, self.family, self.micro_batch = model_config(row, args.layers, args.dtype)
        seq, hidden = self.config.seq_length, self.config.hidden_size
        local_seq = seq // dims.tp if args.sequence_parallel else seq
        gen = torch.Generator(device=device).manual_seed(1)
        dtype = getattr(torch, args.dtype)
        self.x = torch.randn(local_seq, self.micro_batch, hidden, device=device, dtype=dtype,
                             generator=gen).requires_grad_()
        self.grad_out = torch.randn(local_seq, self.micro_batch, hidden, device=device,
                                    dtype=dtype, generator=gen)
        self.rotary = None
        if self.config.position_embedding_type == "rope":
            cos, sin = rotary_tables(seq, self.config.kv_channels, self.config.rotary_base,
                                     device)
            self.rotary = (cos[:, None, None, :], sin[:, None, None, :])

    def measure(self, name, module, forward, comm=True, profile=False, inputs=None) -> None:
        args, dims, result = self.args, self.dims, self.result
        inputs = inputs or (self.x, self.grad_out)
        params = [p for p in module.parameters() if p.requires_grad]
        step = make_step(module, forward, *inputs, params, keep_grads=args.cuda_graph)
        reset_peak_memory(self.device)
        if args.cuda_graph:
            try:
                if comm:
                    step = graphed(step)
                else:
                    with no_tp_communication(dims):
                        step = graphed(step)
            except Exception as error:  # report, time eagerly
                result["skipped"][name + " graph"] = f"{type(error).__name__}: {error}"[:300]
                log(f"  {self.row} {name}: CUDA graph capture failed ({error}); eager")
                torch.cuda.synchronize()
                step = make_step(module, forward, *inputs, params)
        if comm:
            ms, host_ms = time_step(step, args.warmup, args.iters, self.device)
            if profile:
                result["profile"][name] = profile_summary(step)
        else:
            with no_tp_communication(dims):
                ms, host_ms = time_step(step, args.warmup, args.iters, self.device)
        result["ms_rounds"].setdefault(name, []).append(ms / args.layers)
        result["host_rounds"].setdefault(name, []).append(host_ms / args.layers)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**30
            result["peak_gib"][name] = max(peak, result["peak_gib"].get(name, 0.0))
        log(f"  {self.row} tp={dims.tp} {name:>24}: {ms / args.layers:.3f} ms/layer "
            f"(host {host_ms / args.layers:.3f})")

    def run_round(self, profile: bool) -> None:
        args, dims, config, result = self.args, self.dims, self.config, self.result
        layout = ParallelConfig(sequence_parallel=args.sequence_parallel)
        model_parallel_seed(1, dims)
        block, forward = ours(config, dims, self.rotary, layout, self.device)
        self.measure("a_no_comm", block, forward, comm=False)
        self.measure("b_plain_tp", block, forward, profile=profile)
        del block, forward
        if args.comm_overlap and not args.sequence_parallel:
            local = config.seq_length // dims.tp
            sp_inputs = (self.x.detach()[:local].clone().requires_grad_(),
                         self.grad_out[:local].contiguous())
            for name, fused in (("b_plain_tp_sp", False), ("f_sp_comm_overlap", True)):
                if fused and not links.link_carries_fused_sp(args.link):
                    result["skipped"][name] = links.BYPASSES_NCCL
                    continue
                sp = ParallelConfig(sequence_parallel=True, tp_comm_overlap=fused)
                block, forward = ours(config, dims, self.rotary, sp, self.device)
                if not fused:  # the limit of the SP layout: all-gather -> repeat, RS -> slice
                    self.measure("a_sp_no_comm", block, forward, comm=False, inputs=sp_inputs)
                self.measure(name, block, forward, profile=profile, inputs=sp_inputs)
                del block, forward
        ffn_local = config.ffn_hidden_size // dims.tp
        for n, k in args.plans:
            if n > self.micro_batch or ffn_local % k:
                continue
            domino = ParallelConfig(sequence_parallel=args.sequence_parallel,
                                    domino=DominoPlan(n, k, explicit_backward=True))
            block, forward = ours(config, dims, self.rotary, domino, self.device)
            self.measure(f"e_domino_N{n}_K{k}", block, forward, profile=profile)
            del block, forward
        if not args.sequence_parallel:  # the peers run without sequence parallelism
            for peer in args.peers:
                run_peer(peer, self, args, dims)

    def auto_choice(self) -> dict:
        """The plans `--domino` times on this shape (its own code: autotune.time_plans on a
        model of `--layers` layers) and its choice."""
        layout = ParallelConfig(sequence_parallel=self.args.sequence_parallel)
        model = build_model(self.config, self.dims, self.family, device=self.device,
                            parallel=layout)
        timed = autotune.time_plans(model, self.micro_batch)
        del model
        gc.collect()
        log(f"  {self.row} {timed.line()}")
        return {"plans": [list(plan) for plan in timed.plans], "ms": list(timed.ms),
                "choice": timed.choice, "line": timed.line()}


def bench_row(row: str, args, dims, device: torch.device, bandwidth: dict) -> dict:
    result = {"row": row, "tp": dims.tp, "layers": args.layers, "link": args.link_label,
              "sequence_parallel": args.sequence_parallel, "rounds": args.rounds,
              "timed": "cuda graph" if args.cuda_graph else "eager", "ms_rounds": {},
              "host_rounds": {}, "peak_gib": {}, "profile": {}, "skipped": {}}
    columns = Columns(row, args, dims, device, result)
    config = columns.config
    result.update(family=columns.family, seq=config.seq_length, micro_batch=columns.micro_batch,
                  message_numel=config.seq_length * columns.micro_batch * config.hidden_size)
    numels = links.message_numels(config.seq_length, config.hidden_size, columns.micro_batch,
                                  [n for n, _ in args.plans])
    missing = [n for n in numels if str(n) not in bandwidth]
    if missing:
        measured = links.measure_collectives(missing, getattr(torch, args.dtype), device)
        bandwidth.update({str(numel): value for numel, value in measured.items()})
    result["collectives"] = {str(n): bandwidth[str(n)] for n in numels}
    for round_index in range(args.rounds):
        log(f"  {row}: round {round_index + 1} of {args.rounds}")
        columns.run_round(profile=args.profile and round_index == 0)
    if args.auto:
        result["auto"] = columns.auto_choice()
    report.finish_row(result)
    return result


def run_peer(peer, columns: Columns, args, dims) -> None:
    result, row, config = columns.result, columns.row, columns.config
    try:
        import peers
    except ImportError as error:
        result["skipped"][peer] = f"benchmarks/peers.py not importable: {error}"
        return
    if peer == "deepspeed" and columns.family != "gpt":
        result["skipped"][peer] = "DeepSpeed's Domino has LayerNorm only and no GQA"
        return
    shape = peers.LayerShape(name=row, family=columns.family, hidden=config.hidden_size,
                             heads=config.num_attention_heads,
                             query_groups=config.num_query_groups, ffn=config.ffn_hidden_size,
                             seq=config.seq_length, micro_batch=columns.micro_batch)
    builder = peers.build_megatron_block if peer == "megatron" else peers.build_deepspeed_domino
    try:
        module, forward = builder(shape, dims.tp, args.layers, getattr(torch, args.dtype))
    except Exception as error:  # a peer that fails to build is reported, not fatal
        module, forward = None, f"{type(error).__name__}: {error}"
    if module is None:
        result["skipped"][peer] = str(forward)
        log(f"  {row}: {peer} skipped: {forward}")
        return
    columns.measure("c_megatron_core" if peer == "megatron" else "d_deepspeed_domino", module,
                    forward)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="core",
                        help=f"{' | '.join(ROW_SETS)} | comma-separated row names "
                             f"({', '.join(ROWS)})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: NCCL, bf16; cpu: gloo, fp32 (the network-namespace testbed)")
    parser.add_argument("--link", choices=list(links.LINKS), default=None,
                        help="NCCL link setting exported in every rank before NCCL starts "
                             f"(default nvlink; GPUs only): {links.link_help()}")
    parser.add_argument("--tag", default="",
                        help="what the link is, recorded with the results when --link does not "
                             "say it (e.g. 'netns 1000mbit')")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every column this many times; report median and range")
    parser.add_argument("--peers", default="megatron",
                        help="comma-separated: megatron, deepspeed (or '' for none)")
    parser.add_argument("--plans", default="",
                        help="Domino (N, K) plans to try, e.g. '1x1,2x1' (default: "
                             f"{','.join(f'{n}x{k}' for n, k in CANDIDATES)})")
    parser.add_argument("--auto", action="store_true",
                        help="also time the plans --domino compares (its own code) and report "
                             "its choice against the best of them as measured here")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--comm-overlap", action="store_true",
                        help="also time plain TP + SP without and with --tp-comm-overlap")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture each column's forward+backward in a CUDA graph and time "
                             "replays (host time drops out; a capture failure is reported)")
    parser.add_argument("--out", default="bench_domino.json")
    args = parser.parse_args(argv)
    if args.device == "cpu" and (args.link or args.cuda_graph or args.profile):
        parser.error("--link, --cuda-graph and --profile need --device cuda (NCCL, CUDA)")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} is invalid: it must be >= 1")
    args.peers = [p for p in args.peers.split(",") if p]
    args.plans = ([tuple(int(v) for v in plan.split("x")) for plan in args.plans.split(",")]
                  if args.plans else CANDIDATES)
    args.rows = ROW_SETS.get(args.rows, args.rows.split(","))
    unknown = [row for row in args.rows if row not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if args.device == "cuda":
        args.link = args.link or "nvlink"
    args.link_label = args.link or args.tag or "gloo"
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


def run_header(args, dims: ParallelDims, device: torch.device) -> dict:
    """What ran: the device, the link and the NCCL variables in effect in this rank."""
    cuda = device.type == "cuda"
    return {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "gpus": dims.tp if cuda else 0, "world": dims.tp, "torch": torch.__version__,
            "link": args.link_label,
            "link_emulates": links.LINKS[args.link].emulates if args.link else "gloo over TCP",
            "nccl_env": {key: os.environ[key] for key in sorted(os.environ)
                         if key.startswith("NCCL_")},
            "env_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "args": vars(args)}


def main() -> None:
    args = parse_args()
    if args.link:  # before NCCL starts in this rank (the testbed, not library behaviour)
        environment = links.link_environment(args.link, os.environ)
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        os.environ.update(environment)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    dims = ParallelDims(tp=dist.get_world_size())
    header = run_header(args, dims, device)
    log("bench_domino: " + ", ".join(f"{key} {header[key]}" for key in
                                     ("device", "world", "torch", "link", "link_emulates",
                                      "nccl_env", "env_max_connections")))
    results, bandwidth = [], {}
    for row in args.rows:
        results.append(bench_row(row, args, dims, device, bandwidth))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if dist.get_rank() == 0:  # after every row: a run cut short keeps its finished rows
            with open(args.out, "w") as f:
                json.dump({**header, "results": results}, f, indent=2)
    if dist.get_rank() == 0:
        print(report.columns_table(results), report.table(results), report.link_table(results),
              sep="\n\n", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
