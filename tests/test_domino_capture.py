"""Domino's capture mode (what `--enable-cuda-graph` captures: overlap/cuda_graph.py
`layer_stack`) against its eager mode, bit for bit, on CPU without a capture (no GPU here; the
capture itself runs in tests/gpu/test_gpu_cuda_graph_domino.py).

Block: the outputs, the input's and every layer parameter's gradient of two forward + backward
passes (gradients accumulating), and the one `autograd.grad` over (input, parameters) that
the capture records, equal the eager runner's exactly (values and signs of zeros), GPT and
Llama, fp32 and bf16, batch slices N in {1, 2, 3} on an uneven batch (5), hidden slices K in
{1, 2}, at TP 1, and at TP 2 with and without sequence parallelism; and with dropout (the
generators seeded alike: the capture mode draws the eager mode's masks).
Engine: two optimizer steps of three micro-batches each (gradients accumulating under
`no_sync`) through megadomino.zero, with the decoder's runner a GraphedRunner over the capture
mode's stack (installed after the engine, as the training loop captures), give the eager
Domino run's losses and weights exactly, at DP 1 and DP 2 (ZeRO stages 0 and 1), and at TP 2
with sequence parallelism and dropout."""

from __future__ import annotations

import contextlib
import itertools

import torch
from test_domino import BATCH, domino_config
from test_tp_equivalence import FAMILIES, batch

from configs import make_config, parallel_config
from dist_utils import C, DistSuite
from megadomino.build import build_model
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.overlap.cuda_graph import GraphedLayers, GraphedRunner, layer_stack
from megadomino.overlap.domino.schedule import DominoRunner
from megadomino.zero.optimizer import build_engine

DTYPES = ("float32", "bfloat16")
PLANS = list(itertools.product((1, 2, 3), (1, 2)))


def assert_identical(actual: list, expected: list, what: str) -> None:
    assert len(actual) == len(expected), what
    for n, (a, b) in enumerate(zip(actual, expected)):
        assert (a is None) == (b is None), f"{what} [{n}]: one is None"
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what} [{n}]: values differ"
            assert torch.equal(a.signbit(), b.signbit()), f"{what} [{n}]: signs of zeros differ"


def _config(family: str, dtype: str, dropout: float):
    return domino_config(family, params_dtype=dtype, hidden_dropout=dropout,
                         attention_dropout=dropout)


def _model(family: str, dims, dtype: str, n: int, k: int, sp: bool, dropout: float = 0.0):
    parallel = parallel_config(sequence_parallel=sp, batch_slices=n, hidden_slices=k,
                               explicit_backward=True)
    torch.manual_seed(7)
    return build_model(_config(family, dtype, dropout), dims, family, device="cpu",
                       parallel=parallel)


def _passes(call, block, x: torch.Tensor, grad_out: torch.Tensor, steps: int = 2) -> list:
    """The outputs of `steps` forward + backward passes (gradients accumulating; generators
    seeded first), then x's and every layer parameter's gradient."""
    model_parallel_seed(21, block.dims)
    block.zero_grad(set_to_none=True)
    x.grad = None
    outputs = []
    for _ in range(steps):
        out = call()
        out.backward(grad_out)
        outputs.append(out.detach())
    return outputs + [x.grad] + [p.grad for p in block.layers.parameters()]


def check_block(family: str, dims, dtype: str, n: int, k: int, sp: bool,
                dropout: float = 0.0) -> None:
    model = _model(family, dims, dtype, n, k, sp, dropout)
    block, config = model.decoder, model.config
    eager = block.runner
    stack = layer_stack(block)
    assert isinstance(stack.runner, DominoRunner) and stack.runner.capture_mode
    assert not eager.capture_mode and stack.runner.plan == eager.plan
    params = list(block.layers.parameters())
    assert list(stack.parameters()) == params  # what make_graphed_callables differentiates
    seq = config.seq_length // dims.tp if sp else config.seq_length
    gen = torch.Generator().manual_seed(11 + dims.tp_rank)
    dtype = next(block.parameters()).dtype
    x = torch.randn(seq, BATCH, config.hidden_size, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(x.shape, generator=gen).to(x.dtype)
    rotary = model.rotary(config.seq_length, None, "cpu")
    args = (x, *rotary) if rotary is not None else (x,)
    out = stack(*args)  # the block's node takes the parameters: autograd.grad reaches them
    inputs = [getattr(fn, "variable", None) for fn, _ in out.grad_fn.next_functions]
    assert all(any(p is i for i in inputs) for p in params)
    expected = _passes(lambda: eager(x, rotary), block, x, grad_out)
    captured = _passes(lambda: stack(*args), block, x, grad_out)
    assert_identical(captured, expected, "two passes, capture mode vs eager")
    model_parallel_seed(21, dims)
    once = torch.autograd.grad(stack(*args), (x, *params), grad_out)
    first = _passes(lambda: eager(x, rotary), block, x, grad_out, steps=1)
    assert_identical(list(once), first[1:], "autograd.grad over (x, params) vs eager backward")


class _Counting(GraphedLayers):
    """GraphedLayers that counts its calls (so the test knows the capture path ran)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().__call__(*args)


def _install_capture_mode(model, micro_batch_size: int) -> _Counting:
    """What capture_layers installs, with the capture-mode stack itself in place of its graphs."""
    block, config = model.decoder, model.config
    seq = config.seq_length // model.dims.tp if model.sequence_parallel else config.seq_length
    dtype = next(block.parameters()).dtype
    x = torch.empty(seq, micro_batch_size, config.hidden_size, dtype=dtype)
    rotary = model.rotary(config.seq_length, None, "cpu")
    layers = _Counting(layer_stack(block), (x, *rotary) if rotary is not None else (x,))
    block.runner = GraphedRunner(block, layers, block.runner)
    return layers


def check_engine(family: str, dims, dtype: str, n: int, k: int, sp: bool, stage: int,
                 dropout: float = 0.0) -> None:
    micro, steps = 3, 2
    config = make_config(_config(family, dtype, dropout), sequence_parallel=sp,
                         batch_slices=n, hidden_slices=k, explicit_backward=True,
                         tensor_model_parallel_size=dims.tp, micro_batch_size=BATCH,
                         global_batch_size=BATCH * micro * dims.dp, lr=1e-2,
                         bf16=dtype == "bfloat16", stage=stage)
    runs = []
    for capture in (False, True):
        model = _model(family, dims, dtype, n, k, sp, dropout)
        engine = build_engine(model, dims, config)
        graphed = _install_capture_mode(model, BATCH) if capture else None
        model_parallel_seed(21, dims)
        losses = []
        for step in range(steps):
            for m in range(micro):
                tokens, labels, mask, _ = batch(config.model, seed=100 * step + 10 * m
                                                + dims.dp_rank, b=BATCH)
                sync = m == micro - 1
                with contextlib.nullcontext() if sync else engine.no_sync():
                    loss = engine(tokens, labels=labels, loss_mask=mask).sum() / mask.sum()
                    engine.backward(loss / micro)
                losses.append(loss.detach())
            engine.step()
        if graphed is not None:
            assert graphed.calls == micro * steps, graphed.calls
        weights = engine.full_state_dict()
        runs.append((losses, [weights[name] for name in sorted(weights)]))
    (eager_losses, eager_weights), (losses, weights) = runs
    assert_identical(losses, eager_losses, "losses")
    assert_identical(weights, eager_weights, "weights after the steps")
    assert not torch.equal(losses[-1], losses[0])


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"tp": ParallelDims(tp=world), "dp": ParallelDims(tp=1, dp=world)}


for family in FAMILIES:
    for dtype, (n, k) in itertools.product(DTYPES, PLANS):
        for tp, sp in ((1, False), (2, False), (2, True)):
            SUITE.case(f"{family}-{dtype}-tp{tp}-sp{sp}-N{n}-K{k}", check_block, family,
                       C.dp if tp == 1 else C.tp, dtype, n, k, sp, worlds=(tp,))
    for tp, sp in ((1, False), (2, True)):
        SUITE.case(f"{family}-tp{tp}-sp{sp}-N3-K2-dropout", check_block, family,
                   C.dp if tp == 1 else C.tp, "float32", 3, 2, sp, 0.2, worlds=(tp,))
    for dtype, stage in (("float32", 0), ("bfloat16", 0), ("float32", 1)):
        for dp in (1, 2):
            SUITE.case(f"{family}-{dtype}-engine-dp{dp}-zero{stage}", check_engine, family,
                       C.dp, dtype, 2, 1, False, stage, worlds=(dp,))
    SUITE.case(f"{family}-engine-tp2-sp-N3-K2-dropout", check_engine, family, C.tp, "float32",
               3, 2, True, 1, 0.2, worlds=(2,))

test_domino_capture_mode_equals_eager = SUITE.test()
