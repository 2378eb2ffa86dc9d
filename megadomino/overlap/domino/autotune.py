"""`--domino` (or `--domino-batch-slices auto`): time a few Domino plans on the model's real
shapes at start-up and keep the fastest; plain tensor parallelism and Domino's unsliced explicit
backward are always candidates, so auto is never slower than plain TP (up to timing noise).

Every rank times every candidate (forward + backward of the decoder on a random micro-batch);
the per-candidate times are reduced with MAX over the world (the slowest rank is the step time),
rank 0 picks and broadcasts its choice, so ranks cannot disagree, and rank 0 prints the table.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from megadomino import overlap
from megadomino.config import DominoPlan
from megadomino.distributed import comm

# (N, K); (1, 1) is the plain TP path, "1x1-runner" Domino's explicit backward without slicing.
CANDIDATES = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]


def _candidates(config, tp: int, micro_batch: int) -> list[tuple[int, int, bool]]:
    ffn_local = config.ffn_hidden_size // tp
    plans = [(1, 1, False), (1, 1, True)]
    plans += [(n, k, True) for n, k in CANDIDATES[1:] if n <= micro_batch and ffn_local % k == 0]
    return plans


def _name(n: int, k: int, runner: bool) -> str:
    if not runner:
        return "plain TP"
    return "Domino unsliced (explicit backward)" if n == k == 1 else f"Domino N={n} K={k}"


def _time(block, x, grad, rotary, warmup: int, iters: int) -> float:
    def step():
        x.grad = None
        out = block(x, rotary)
        out.backward(grad)
    for _ in range(warmup):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        step()
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - begin) / iters * 1e3


def autotune_domino(model, micro_batch_size: int, log=print, warmup: int = 2,
                    iters: int = 5) -> DominoPlan:
    """Time the candidate plans on `model.decoder` and install the fastest. Returns its
    DominoPlan: DominoPlan() (not enabled) is plain TP. Gradients the timing left on the
    parameters are cleared."""
    block, config, dims = model.decoder, model.config, model.dims
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    seq = config.seq_length // dims.tp if model.sequence_parallel else config.seq_length
    gen = torch.Generator(device=device).manual_seed(1234)
    x = torch.randn(seq, micro_batch_size, config.hidden_size, device=device, dtype=dtype,
                    generator=gen).requires_grad_()
    grad = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    rotary = model.rotary(config.seq_length, None, device)
    plans = _candidates(config, dims.tp, micro_batch_size)
    times = []
    for n, k, runner in plans:
        overlap.apply(model, dataclasses.replace(model.parallel, domino=DominoPlan(n, k, runner)))
        times.append(_time(block, x, grad, rotary, warmup, iters))
    model.zero_grad(set_to_none=True)
    measured = torch.tensor(times, device=device)
    if dims.world_size > 1:
        comm.all_reduce(measured, op=comm.ReduceOp.MAX)
    choice = torch.tensor([int(measured.argmin())], device=device)
    if dims.world_size > 1:
        comm.broadcast(choice, src=0)
    n, k, runner = plans[int(choice)]
    plan = DominoPlan(n, k, runner)
    overlap.apply(model, dataclasses.replace(model.parallel, domino=plan))
    if dims.rank == 0:
        rows = ", ".join(f"{_name(pn, pk, r)}: {t:.2f} ms"
                         for (pn, pk, r), t in zip(plans, measured.tolist()))
        name = _name(n, k, runner)
        log(f"domino auto: {name} (decoder forward+backward per micro-batch: {rows})")
    return plan
