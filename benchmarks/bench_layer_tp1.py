"""One GPU, TP = 1: how close a transformer layer's forward + backward comes to the time of its
matmuls and attention alone, ours eager and with --compile-layer-pieces against megatron-core's
layer with its own fusions, all in one run:

    torchrun --nproc_per_node 1 benchmarks/bench_layer_tp1.py --out layer_tp1.json

Columns (ms per layer, bf16, dropout 0, seq 2048, micro-batch 4, `--layers` layers timed):
  limit      the layer's GEMMs (QKV, projection, fc1, fc2) and SDPA alone, forward + backward:
             what no fusion of element-wise work can go below
  eager      our layer (plain execution), element-wise pieces eager
  compiled   the same with --compile-layer-pieces
  mcore      megatron-core 0.16.1 TransformerBlock (local spec, SDPA core attention as ours,
             its bias-activation and bias-dropout-add fusions on; benchmarks/peers.py)
  domino     our Domino N=2 x K=1 eager and compiled: device and host (enqueue) time per layer;
             `domino_2x1_graphed` is the product's --enable-cuda-graph path: a model built as
             the training loop builds it (build_model with the Domino plan), its layers
             captured by overlap.cuda_graph.capture_layers (Domino's schedule in capture
             mode), each step a call of the decoder's GraphedRunner (inputs copied into the
             graphs' buffers, forward and backward replays, parameter gradients accumulated
             outside the graph) - never under the benchmark's own `--cuda-graph` capture
  fp8        our layer with FP8 hybrid (delayed scaling) linears, eager and compiled pieces
Host time is the median wall time to enqueue one step; where it nears the device time the step
is CPU-bound. `--cuda-graph` times CUDA-graph replays of every column instead (the compiled
pieces' kernels captured with the rest), which takes host time out. `peak_gib` in the JSON is
torch.cuda.max_memory_allocated over a column's warm-up, capture and timed steps, from what is
alive for that column alone (its block with its gradients, the input and its gradient; the
earlier columns are collected first: bench_domino.reset_peak_memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_domino import log, make_step, model_config, ours, reset_peak_memory, time_step  # noqa: E402
from timeline import graphed  # noqa: E402

from megadomino.build import build_model  # noqa: E402
from megadomino.config import DominoPlan, FP8Recipe, ParallelConfig  # noqa: E402
from megadomino.distributed import ParallelDims  # noqa: E402
from megadomino.distributed.random import model_parallel_seed  # noqa: E402
from megadomino.models.blocks import rotary_tables  # noqa: E402
from megadomino.models.transformer import TransformerBlock  # noqa: E402
from megadomino.overlap.cuda_graph import GraphedRunner, capture_layers  # noqa: E402


class GemmsAndAttention(torch.nn.Module):
    """A layer's four GEMMs and its causal SDPA, chained with only the reshapes they need:
    x (s, b, h) -> (s, b, h). fc1 is [gate; up] for SwiGLU (both GEMMed), GQA as the model."""

    def __init__(self, config):
        super().__init__()
        h, d = config.hidden_size, config.kv_channels
        self.heads, self.groups, self.head_dim = (config.num_attention_heads,
                                                  config.num_query_groups, d)
        fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
        kw = dict(device="cuda", dtype=torch.bfloat16)
        self.qkv = torch.nn.Parameter(torch.randn((self.heads + 2 * self.groups) * d, h, **kw)
                                      * 0.02)
        self.proj = torch.nn.Parameter(torch.randn(h, self.heads * d, **kw) * 0.02)
        self.fc1 = torch.nn.Parameter(torch.randn(fc1_out, h, **kw) * 0.02)
        self.fc2 = torch.nn.Parameter(torch.randn(h, config.ffn_hidden_size, **kw) * 0.02)
        self.ffn = config.ffn_hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        qkv = F.linear(x, self.qkv)
        q, k, v = qkv.split([self.heads * self.head_dim, self.groups * self.head_dim,
                             self.groups * self.head_dim], dim=-1)
        # (s, b, heads*d) -> (b, heads, s, d)
        q, k, v = (t.reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=self.groups != self.heads)
        out = F.linear(context.permute(2, 0, 1, 3).reshape(s, b, -1), self.proj)
        return F.linear(F.linear(out, self.fc1)[..., :self.ffn], self.fc2)


def bench_row(row: str, args, dims) -> dict:
    config, family, micro_batch = model_config(row, args.layers)
    seq, hidden = config.seq_length, config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(seq, micro_batch, hidden, device="cuda", dtype=torch.bfloat16,
                    generator=gen).requires_grad_()
    grad_out = torch.randn_like(x)
    rotary = None
    if config.position_embedding_type == "rope":
        cos, sin = rotary_tables(seq, config.kv_channels, config.rotary_base, "cuda")
        rotary = (cos[:, None, None, :], sin[:, None, None, :])
    result = {"row": row, "family": family, "seq": seq, "micro_batch": micro_batch,
              "layers": args.layers, "ms_per_layer": {}, "host_ms_per_layer": {},
              "peak_gib": {}, "skipped": {}}

    def measure(name, module, forward, captured=False):
        """captured: `forward` replays the product's graphs (no capture by the benchmark)."""
        params = [p for p in module.parameters() if p.requires_grad]
        reset_peak_memory()
        own_capture = args.cuda_graph and not captured
        step = make_step(module, forward, x, grad_out, params, keep_grads=own_capture)
        if own_capture:
            try:
                step = graphed(step)
            except Exception as error:  # reported, not fatal
                result["skipped"][name] = f"capture: {type(error).__name__}: {error}"[:300]
                log(f"  {row} {name}: capture failed: {error}")
                return
        ms, host_ms = time_step(step, args.warmup, args.iters)
        result["ms_per_layer"][name] = ms / args.layers
        result["host_ms_per_layer"][name] = host_ms / args.layers
        result["peak_gib"][name] = torch.cuda.max_memory_allocated() / 2**30
        log(f"  {row} {name:>18}: {ms / args.layers:.3f} ms/layer "
            f"(host {host_ms / args.layers:.3f})")

    limit = torch.nn.ModuleList(GemmsAndAttention(config) for _ in range(args.layers))

    def gemms(inp, layers=limit):
        for layer in layers:
            inp = layer(inp)
        return inp
    measure("limit", limit, gemms)
    del limit, gemms
    variants = {"eager": {}, "compiled": dict(compile_layer_pieces=True),
                "domino_2x1_eager": dict(domino=DominoPlan(2, 1, explicit_backward=True)),
                "domino_2x1_compiled": dict(domino=DominoPlan(2, 1, explicit_backward=True),
                                            compile_layer_pieces=True)}
    for name, fields in variants.items():
        model_parallel_seed(1, dims)
        block, forward = ours(config, dims, rotary, ParallelConfig(**fields))
        measure(name, block, forward)
        del block, forward
    measure_product_graph(config, family, micro_batch, dims, rotary, result, measure)
    if family == "gpt":
        for name, compiled in (("fp8_eager", False), ("fp8_compiled", True)):
            block = TransformerBlock(config, dims, ParallelConfig(compile_layer_pieces=compiled),
                                     fp8=FP8Recipe(), device="cuda")
            measure(name, block, lambda inp, block=block: block.run(inp, rotary))
            del block
    run_megatron(row, config, family, micro_batch, args, result, measure)
    return result


def measure_product_graph(config, family, micro_batch, dims, rotary, result, measure) -> None:
    """The `domino_2x1_graphed` column: --enable-cuda-graph's own capture of Domino 2x1."""
    plan = DominoPlan(2, 1, explicit_backward=True)
    model_parallel_seed(1, dims)
    model = build_model(config, dims, family, device="cuda",
                        parallel=ParallelConfig(domino=plan, enable_cuda_graph=True))
    model.train()
    try:
        capture_layers(model, micro_batch, log=log)
    except Exception as error:  # reported, not fatal
        result["skipped"]["domino_2x1_graphed"] = f"capture: {type(error).__name__}: {error}"[:300]
        log(f"  domino_2x1_graphed: capture failed: {error}")
        return
    block = model.decoder
    assert isinstance(block.runner, GraphedRunner) and block.runner.fallback is not None
    measure("domino_2x1_graphed", block, lambda inp, block=block: block.runner(inp, rotary),
            captured=True)
    del model, block


def run_megatron(row, config, family, micro_batch, args, result, measure) -> None:
    import peers

    shape = peers.LayerShape(name=row, family=family, hidden=config.hidden_size,
                             heads=config.num_attention_heads,
                             query_groups=config.num_query_groups, ffn=config.ffn_hidden_size,
                             seq=config.seq_length, micro_batch=micro_batch)
    for name, fused in (("mcore", True), ("mcore_unfused", False)):
        try:
            module, forward = peers.build_megatron_block(shape, 1, args.layers, torch.bfloat16,
                                                         fused=fused)
        except Exception as error:  # a peer that fails to build is reported, not fatal
            module, forward = None, f"{type(error).__name__}: {error}"
        if module is None:
            result["skipped"][name] = str(forward)[:300]
            log(f"  {row}: {name} skipped: {forward}")
            continue
        measure(name, module, forward)
        del module, forward


def table(results: list[dict]) -> str:
    lines = ["| row | limit | eager | compiled | mcore (fused) | mcore unfused | compiled / limit "
             "| mcore / compiled | eager / compiled | Domino 2x1 eager / compiled / graphed, "
             "host ms | Domino 2x1 graphed | FP8 eager / compiled | bf16 compiled / FP8 compiled "
             "|",
             "|" + " --- |" * 13]
    for r in results:
        ms, host = r["ms_per_layer"], r["host_ms_per_layer"]
        fmt = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
        ratio = lambda p, q: f"{p / q:.3f}" if p and q else "-"  # noqa: E731
        get = ms.get
        lines.append(
            f"| {r['row']} | {fmt(get('limit'))} | {fmt(get('eager'))} | {fmt(get('compiled'))} "
            f"| {fmt(get('mcore'))} | {fmt(get('mcore_unfused'))} "
            f"| {ratio(get('compiled'), get('limit'))} | {ratio(get('mcore'), get('compiled'))} "
            f"| {ratio(get('eager'), get('compiled'))} "
            f"| {fmt(host.get('domino_2x1_eager'))} / {fmt(host.get('domino_2x1_compiled'))} "
            f"/ {fmt(host.get('domino_2x1_graphed'))} | {fmt(get('domino_2x1_graphed'))} "
            f"| {fmt(get('fp8_eager'))} / {fmt(get('fp8_compiled'))} "
            f"| {ratio(get('compiled'), get('fp8_compiled'))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="gpt3-6.7b,llama2-7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays of every column (host time drops out)")
    parser.add_argument("--out", default="bench_layer_tp1.json")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    dims = ParallelDims(tp=1)
    log(f"bench_layer_tp1: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = []
    for row in args.rows.split(","):
        results.append(bench_row(row, args, dims))
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "args": vars(args), "results": results}, f, indent=2)
    print(table(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
