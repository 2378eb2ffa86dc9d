"""Live tensor bytes of a GPT layer stack's forward + backward on CPU, bf16 against FP8 linears,
and what is alive at the peak; then bench_layer_tp1's sequence of columns, and what of the
earlier columns is still allocated when each one starts.

    python benchmarks/fp8_memory_cpu.py                  # hidden 256, the 6.7B row's ratios
    python benchmarks/fp8_memory_cpu.py --hidden 512 --top 30

The shapes keep the GPT-3 6.7B row's ratios (tokens = 2 x hidden: seq 2048 x micro-batch 4
against hidden 4096; ffn 4 x hidden; head dim 128; 4 layers), so every byte count below scales
by (4096 / hidden)^2 to that row, attention included (flash: no s x s tensor). The meter
(LiveBytes) counts the storages made by dispatched ops (every aten op, forward and backward)
from their creation to their release; parameters, gradients from an earlier step and the input
exist before it and are added as a fixed base, as under bench_layer_tp1's CUDA graphs, where
gradients accumulate in place. The FP8 casts are the eager ones (`cast_operand`): on CUDA,
--compile-layer-pieces runs the fused Triton cast instead, whose only allocations are its
outputs.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megadomino.config import DominoPlan, FP8Recipe, ModelConfig, ParallelConfig  # noqa: E402
from megadomino.distributed import ParallelDims  # noqa: E402
from megadomino.models.transformer import TransformerBlock  # noqa: E402
from megadomino.overlap.domino.schedule import DominoRunner  # noqa: E402

MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops dispatched under this mode create, while they are alive
    (released through a finalizer on the storage, so a view or a tensor autograd saved keeps its
    storage counted); their peak, the phase it came in, and at the peak a label per live
    storage: (phase, op, shape, dtype, bytes). Storages of `known` tensors (existing before)
    are never counted. `phase` is a free tag the caller sets ("forward", "backward")."""

    def __init__(self, known: list[torch.Tensor] = ()):
        super().__init__()
        self._known = {id(t.untyped_storage()) for t in known}
        self._pinned = [t.untyped_storage() for t in known]  # keeps their ids unique
        self._live: dict[int, tuple] = {}
        self.now = self.peak = 0
        self.at_peak: list[tuple] = []
        self.phase = self.peak_phase = ""

    def _release(self, key: int) -> None:
        self.now -= self._live.pop(key)[-1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._known or key in self._live or storage.nbytes() == 0:
                continue
            op = func.overloadpacket.__name__
            self._live[key] = (self.phase, op, tuple(t.shape), t.dtype, storage.nbytes())
            self.now += storage.nbytes()
            weakref.finalize(storage, self._release, key)
        if self.now > self.peak:
            self.peak, self.peak_phase = self.now, self.phase
            self.at_peak = list(self._live.values())
        return out


def gpt_config(hidden: int, layers: int = 4) -> ModelConfig:
    """GPT-3 6.7B's shape ratios at `hidden` (a multiple of 128): module docstring."""
    seq = hidden // 2
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 128,
                       ffn_hidden_size=4 * hidden, seq_length=seq, max_position_embeddings=seq,
                       hidden_dropout=0.0, attention_dropout=0.0, params_dtype="bfloat16",
                       position_embedding_type="learned_absolute")


def layer_stack_memory(config: ModelConfig, fp8: FP8Recipe | None, micro_batch: int = 4,
                       steps: int = 2) -> dict:
    """The last of `steps` forward + backward passes of config's layers (the first makes the
    gradients, which the next accumulate into) under LiveBytes: `base` (parameters, their
    gradients, the input and its gradient), `peak` and `after_forward` (bytes made by the step),
    the peak's `phase` and `at_peak` labels. The last pass is a step's first micro-batch: the
    parameters' version counters are bumped first, as an optimizer step does, so the FP8
    linears cast their weights in it (the codes they keep for the step's micro-batches are
    counted)."""
    dims = ParallelDims(tp=1)
    torch.manual_seed(0)
    block = TransformerBlock(config, dims, ParallelConfig(), fp8=fp8)
    x = torch.randn(config.seq_length, micro_batch, config.hidden_size, dtype=torch.bfloat16,
                    requires_grad=True)
    grad_out = torch.randn_like(x)
    for _ in range(steps - 1):
        block.run(x).backward(grad_out)
    known = [x, x.grad, grad_out, *block.parameters(), *block.buffers()]
    known = [t for t in known + [p.grad for p in block.parameters()] if t is not None]
    torch.autograd.graph.increment_version(list(block.parameters()))
    meter = LiveBytes(known)
    with meter:
        meter.phase = "forward"
        out = block.run(x)
        after_forward = meter.now
        meter.phase = "backward"
        out.backward(grad_out)
    base = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in known}.values())
    return {"base": base, "peak": meter.peak, "after_forward": after_forward,
            "phase": meter.peak_phase, "at_peak": meter.at_peak}


def column_leftovers(config: ModelConfig, collect: bool) -> list[tuple[str, int]]:
    """bench_layer_tp1's columns in its order (bf16, Domino 2x1 twice, FP8), each built, run
    forward + backward twice and deleted as the benchmark does: per column, the bytes of the
    earlier columns' parameters and gradients still allocated when it starts, with or without
    a gc.collect() first. A Domino block and its runner refer to each other."""
    dims = ParallelDims(tp=1)
    x = torch.randn(config.seq_length, 4, config.hidden_size, dtype=torch.bfloat16,
                    requires_grad=True)
    domino = ParallelConfig(domino=DominoPlan(2, 1, explicit_backward=True))
    columns = [("compiled", ParallelConfig(), None), ("domino_2x1_eager", domino, None),
               ("domino_2x1_compiled", domino, None), ("fp8_compiled", ParallelConfig(),
                                                       FP8Recipe())]
    earlier, rows = [], []
    enabled = gc.isenabled()
    gc.disable()  # the cyclic collector runs only when the benchmark's allocations trigger it
    try:
        for name, parallel, fp8 in columns:
            if collect:
                gc.collect()
            alive = [ref() for ref in earlier if ref() is not None]
            rows.append((name, sum(p.numel() * p.element_size() * (1 + (p.grad is not None))
                                   for block in alive for p in block.parameters())))
            del alive
            block = TransformerBlock(config, dims, parallel, fp8=fp8)
            if parallel.domino.enabled:
                block.runner = DominoRunner(block, parallel.domino)
            run = block.run if block.runner is None else block.runner
            for _ in range(2):
                run(x, None).backward(torch.ones_like(x))
            earlier.append(weakref.ref(block))
            del block, run
    finally:
        if enabled:
            gc.enable()
        gc.collect()
    return rows


def summary(at_peak: list[tuple], top: int) -> list[str]:
    """The `top` groups (phase, op, shape, dtype) of live storages by bytes."""
    groups: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for phase, op, shape, dtype, nbytes in at_peak:
        group = groups[(phase, op, shape, str(dtype).removeprefix("torch."))]
        group[0] += nbytes
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
    return [f"    {nbytes / MIB:8.2f} MiB  {count:3d} x {phase:>8} {op}{list(shape)} {dtype}"
            for (phase, op, shape, dtype), (nbytes, count) in ranked]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256, help="a multiple of 128")
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()
    if args.hidden % 128:
        print(f"--hidden={args.hidden}: must be a multiple of 128", file=sys.stderr)
        sys.exit(2)
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = gpt_config(args.hidden)
    scale = (4096 / args.hidden) ** 2 / 1024  # MiB here -> GiB at the 6.7B row
    print(f"GPT layers: hidden {args.hidden}, 4 layers, tokens {2 * args.hidden}; "
          f"MiB here x {scale * 1024:.0f} / 1024 = GiB at gpt3-6.7b")
    results = {}
    for name, fp8 in (("bf16", None), ("fp8", FP8Recipe())):
        r = results[name] = layer_stack_memory(config, fp8)
        total = r["base"] + r["peak"]
        print(f"{name}: base {r['base'] / MIB:.2f} MiB + peak {r['peak'] / MIB:.2f} MiB "
              f"({r['phase']}) = {total / MIB:.2f} MiB (~{total / MIB * scale:.2f} GiB at 6.7B); "
              f"alive after forward {r['after_forward'] / MIB:.2f} MiB")
        print("\n".join(summary(r["at_peak"], args.top)))
    totals = {name: r["base"] + r["peak"] for name, r in results.items()}
    print(f"fp8 / bf16 peak: {totals['fp8'] / totals['bf16']:.3f}")
    for collect in (False, True):
        print(f"bench_layer_tp1's columns, {'with' if collect else 'without'} gc.collect() "
              "before each: earlier columns' parameters + gradients still allocated")
        for name, nbytes in column_leftovers(config, collect):
            print(f"    {name:>20}: {nbytes / MIB:6.2f} MiB (~{nbytes / MIB * scale:.2f} GiB "
                  "at 6.7B)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
