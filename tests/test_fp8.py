"""FP8 linears (megadomino/tp/fp8.py) on CPU: the three GEMMs against a dequantize-then-
matmul reference (the same quantized operands, fp32 matmul) on a shape `_scaled_mm` runs and one
it cannot (not a multiple of 16: the fp32 fallback); the delayed-scaling state machine; exact
resume from a state_dict and from a checkpoint; the flag refusals; a tiny GPT learning with
--fp8-format hybrid; TP=2 against TP=1 (gloo).

torch 2.13's CPU `_scaled_mm` takes every e4m3/e5m2 operand pair and fp32 or bf16 output, so the
FP8 path itself runs here; only its speed needs a GPU (benchmarks/bench_fp8.py)."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

from configs import make_config, with_leaves
from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_model
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError, FP8Recipe, ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.tp import fp8
from megadomino.tp.fp8 import (
    E4M3,
    E5M2,
    GRAD,
    INPUT,
    WEIGHT,
    FP8State,
    current_scale,
    fp8_linear,
    quantize,
)
from megadomino.train.checkpoint import shards
from megadomino.train.loop import train

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--train-iters", "1", "--mock-data"]


def _dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scale = current_scale(t, dtype)
    return quantize(t, scale, dtype).float() / scale


def test_quantize_rounds_to_nearest_and_saturates():
    t = torch.linspace(-3.0, 3.0, 1001)
    for dtype, mantissa_bits in ((E4M3, 3), (E5M2, 2)):
        scale = torch.tensor(100.0)
        back = quantize(t, scale, dtype).float() / scale
        assert (back - t).abs().max() <= 2.0 ** -(mantissa_bits + 1) * t.abs().max()
        assert 0 < (back - t).abs().max()
    huge = quantize(torch.tensor([1e6, -1e6]), torch.tensor(1.0), E4M3).float()
    assert huge.tolist() == [448.0, -448.0]


@contextlib.contextmanager
def _warns_if(fallback: bool):
    """The fallback warns (once per shape); the FP8 path warns nothing."""
    if fallback:
        with pytest.warns(UserWarning, match="not a multiple of 16"):
            yield
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield


SHAPES = {"fp8-gemm": (4, 16, 32, 48), "fallback": (4, 5, 40, 24)}
"""(b, s, in, out): M = b * s. 64 x 32 x 48 runs in _scaled_mm; 20 x 40 x 24 cannot."""


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gemms_match_dequantized_reference(shape, fmt, monkeypatch):
    b, s, k, n = SHAPES[shape]
    scaled_mm_calls = []
    real = torch._scaled_mm

    def spy(a, b_, **kwargs):
        scaled_mm_calls.append((a.dtype, b_.dtype))
        return real(a, b_, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, k, generator=gen, requires_grad=True)
    weight = nn.Parameter(0.05 * torch.randn(n, k, generator=gen))
    bias = nn.Parameter(torch.randn(n, generator=gen))
    grad_out = torch.randn(b, s, n, generator=gen)
    state = FP8State(FP8Recipe(format=fmt, recipe="tensorwise"))
    monkeypatch.setattr(fp8, "_warned_shapes", set())
    with _warns_if(shape == "fallback"):
        y = fp8_linear(x, weight, bias, state)
        y.backward(grad_out)

    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    x_d, w_d = _dequantized(x.detach().reshape(-1, k), E4M3), _dequantized(weight.detach(), E4M3)
    g_d = _dequantized(grad_out.reshape(-1, n), grad_dtype)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.detach().reshape(-1, n), x_d @ w_d.t() + bias.detach(), **tol)
    torch.testing.assert_close(x.grad.reshape(-1, k), g_d @ w_d, **tol)
    torch.testing.assert_close(weight.grad, g_d.t() @ x_d, **tol)
    torch.testing.assert_close(bias.grad, grad_out.reshape(-1, n).sum(0))
    exact = x.detach() @ weight.detach().t() + bias.detach()
    assert (y.detach() - exact).abs().max() > 1e-3, "the forward was not quantized"
    if shape == "fp8-gemm":
        assert scaled_mm_calls == [(E4M3, E4M3), (grad_dtype, E4M3), (grad_dtype, E4M3)]
    else:
        assert scaled_mm_calls == []


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_compiled_casts_equal_eager_ones_bit_for_bit(recipe):
    """--compile-layer-pieces casts each operand and writes its transpose in one compiled
    function: the same FP8 bytes, so the same outputs, gradients and recorded amaxes."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 32, generator=gen, dtype=torch.bfloat16)
    weight = (0.05 * torch.randn(48, 32, generator=gen)).to(torch.bfloat16)
    grad_out = torch.randn(4, 16, 48, generator=gen, dtype=torch.bfloat16)
    results = []
    for compiled in (False, True):
        state = FP8State(FP8Recipe(recipe=recipe), compiled=compiled)
        xs, w = x.clone().requires_grad_(), nn.Parameter(weight.clone())
        for _ in range(2):  # delayed: the second step casts with the first step's amaxes
            xs.grad, w.grad = None, None
            fp8_linear(xs, w, None, state).backward(grad_out)
        results.append((xs.grad, w.grad, dict(state.state_dict())))
    (x_grad, w_grad, state), (x_grad_c, w_grad_c, state_c) = results
    assert torch.equal(x_grad, x_grad_c) and torch.equal(w_grad, w_grad_c)
    assert state.keys() == state_c.keys()
    assert all(torch.equal(state[key], state_c[key]) for key in state)
    cast_q, cast_t, _, amax = fp8.cast_operand(x[0], torch.tensor(3.0), E5M2, True, True)
    assert torch.equal(cast_t.float(), cast_q.float().t())
    assert amax == x[0].float().abs().max()


@pytest.mark.parametrize("use_max, margin, interval", [(False, 0, 1), (True, 1, 2)])
def test_compiled_step_closing_equals_eager_bit_for_bit(use_max, margin, interval):
    """--compile-layer-pieces closes each delayed step with one compiled function: the same
    scales, history and count as the eager operations, over steps that update and keep the
    scale (an amax of 0 and of inf included)."""
    rows = torch.tensor([[3.0, 0.5, 7.0], [0.0, 2.0, float("inf")], [1e-3, 4.0, 9.0],
                         [5.0, 0.0, 0.25], [2.5, 6.0, 1.0]])
    fp8_max = torch.tensor([448.0, 448.0, 57344.0])
    states = []
    for close in (fp8.close_step, fp8._compiled_close_step()):
        history, scale, steps = torch.zeros(3, 3), torch.ones(3), torch.zeros((), dtype=torch.int64)
        seen = []
        for row in rows:
            history[0] = row
            close(history, scale, steps, fp8_max, margin, interval, use_max)
            seen.append((history.clone(), scale.clone(), steps.clone()))
        states.append(seen)
    for (h, sc, st), (h_c, sc_c, st_c) in zip(*states, strict=True):
        assert torch.equal(h, h_c) and torch.equal(sc, sc_c) and torch.equal(st, st_c)
    assert not torch.equal(states[0][-1][1], torch.ones(3))  # the scales did update


def test_bf16_activations_keep_their_dtype():
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = nn.Parameter(0.05 * torch.randn(16, 32, dtype=torch.bfloat16))
    y = fp8_linear(x, weight, None, FP8State(FP8Recipe(recipe="tensorwise")))
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == weight.grad.dtype == torch.bfloat16
    x_d = _dequantized(x.detach().float().reshape(-1, 32), E4M3)
    w_d = _dequantized(weight.detach().float(), E4M3)
    torch.testing.assert_close(y.float().reshape(-1, 16), x_d @ w_d.t(), rtol=1e-2, atol=1e-2)


def _steps(recipe: FP8Recipe, amaxes: list[float]) -> list[float]:
    """The INPUT scale each delayed step casts with, the step's tensor having amax `amaxes[i]`."""
    state = FP8State(recipe)
    used = []
    for amax in amaxes:
        state.begin_step()
        used.append(state.scale_for(INPUT, torch.tensor([-amax, 0.0]), record=True).item())
    return used


@pytest.mark.parametrize("algo, expected", [
    ("max", [1, 1, 28, 28, 28, 28, 224]),
    ("most_recent", [1, 1, 28, 28, 224, 224, 896]),
])
def test_delayed_history_margin_interval(algo, expected):
    """History 3, margin 1 (448 / amax / 2), a new scale every 2 steps from the steps before.
    Step 3 sees [8, 2]; step 5 sees [1, 4, 8] (max 8, newest 1); step 7 sees [.25, .5, 1]."""
    recipe = FP8Recipe(recipe="delayed", amax_history_len=3, amax_compute_algo=algo, margin=1,
                       interval=2)
    assert _steps(recipe, [2, 8, 4, 1, 0.5, 0.25, 0.125]) == expected


def test_delayed_keeps_the_scale_on_zero_or_inf_amax():
    recipe = FP8Recipe(recipe="delayed")  # history 1, most_recent, margin 0, interval 1
    assert _steps(recipe, [4, 0, float("inf"), 2, 1]) == [1, 112, 112, 112, 224]


def test_delayed_records_all_three_roles_and_no_grad_records_nothing():
    state = FP8State(FP8Recipe(format="hybrid", recipe="delayed"))
    x = torch.randn(32, 16, requires_grad=True)
    weight = nn.Parameter(torch.randn(16, 16))
    grad_out = 3.0 * torch.randn(32, 16)
    fp8_linear(x, weight, None, state).backward(grad_out)
    with torch.no_grad():
        fp8_linear(x, weight, None, state)
    assert state.steps.item() == 1 and state.scale.tolist() == [1.0, 1.0, 1.0]
    fp8_linear(x, weight, None, state)  # step 2 casts with scales from step 1's amaxes
    expected = [448 / x.detach().abs().max(), 448 / weight.detach().abs().max(),
                57344 / grad_out.abs().max()]
    torch.testing.assert_close(state.scale, torch.stack(expected), rtol=1e-6, atol=0)
    assert (INPUT, WEIGHT, GRAD) == (0, 1, 2)


class _Net(nn.Module):
    def __init__(self, recipe: FP8Recipe):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 48, generator=torch.Generator().manual_seed(1)))
        self.fp8_state = FP8State(recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, None, self.fp8_state)


def _train_net(net: _Net, start: int, steps: int) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    outputs = []
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        x = (1 + step) * torch.randn(16, 48, generator=gen)
        y = net(x)
        outputs.append(y.detach())
        optimizer.zero_grad()
        (y * torch.randn(16, 32, generator=gen)).sum().backward()
        optimizer.step()
    return outputs


def test_state_dict_round_trip_resumes_bit_exactly():
    recipe = FP8Recipe(recipe="delayed", amax_history_len=4, amax_compute_algo="max", margin=1)
    net = _Net(recipe)
    _train_net(net, 0, 3)
    saved = copy.deepcopy(net.state_dict())
    assert {"fp8_state.amax_history", "fp8_state.scale", "fp8_state.steps"} <= set(saved)
    straight = _train_net(net, 3, 3)
    resumed_net = _Net(recipe)
    resumed_net.load_state_dict(saved)
    resumed = _train_net(resumed_net, 3, 3)
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    assert torch.equal(net.fp8_state.amax_history, resumed_net.fp8_state.amax_history)
    fresh_state = _Net(recipe)
    fresh_state.weight.data.copy_(saved["weight"])
    assert not torch.equal(_train_net(fresh_state, 3, 1)[0], straight[0]), \
        "the scaling state made no difference: this test could not fail"


@pytest.mark.parametrize("argv, named", [
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], "--fp8-recipe=mxfp8 is refused"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"], "--fp8-recipe=blockwise is refused"),
    (["--fp8-format", "e5m2"], "--fp8-format"),
    (["--fp8-format", "hybrid", "--fp8-margin", "-1"], "--fp8-margin=-1 is invalid"),
    (["--fp8-format", "hybrid", "--fp8-interval", "0"], "--fp8-interval=0 is invalid"),
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"],
     "--fp8-amax-history-len=0 is invalid"),
    (["--fp8-format", "hybrid", "--fp8-amax-compute-algo", "mean"], "--fp8-amax-compute-algo"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-interval", "2"],
     "--fp8-interval applies to --fp8-recipe delayed"),
    (["--fp8-format", "hybrid", "--domino-batch-slices", "2"],
     "--domino-batch-slices=2 is invalid"),
    (["--fp8-format", "hybrid", "--domino-explicit-backward"], "--domino-explicit-backward=True"),
    (["--fp8-format", "hybrid", "--domino"], "off with --fp8-format"),
    (["--fp8-format", "hybrid", "--domino-batch-slices", "auto"], "off with --fp8-format"),
    (["--fp8-format", "hybrid", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--tp-comm-overlap"], "--tp-comm-overlap=True is invalid"),
    (["--fp8-format", "hybrid", "--recompute-granularity", "full", "--recompute-method",
      "uniform", "--recompute-num-layers", "1"], "--recompute-granularity=full is invalid"),
])
def test_refusals_name_the_flag(argv, named):
    with pytest.raises(ConfigError, match=named):
        parse_args([*BASE, *argv], "gpt")


def test_flags_set_the_config():
    config, _ = parse_args([*BASE, "--fp8-format", "e4m3", "--fp8-amax-history-len", "16",
                            "--fp8-amax-compute-algo", "max", "--fp8-margin", "2",
                            "--fp8-interval", "3"], "gpt")
    assert config.train.precision.fp8 == FP8Recipe("e4m3", "delayed", 16, "max", 2, 3)
    config, _ = parse_args([*BASE, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
                            "--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "1"], "gpt")
    assert config.train.precision.fp8.recipe == "tensorwise"
    assert parse_args(BASE, "gpt")[0].train.precision.fp8 is None


# Distributed (gloo): TP=2 against TP=1, training, exact resume from a checkpoint.

FP8_MODEL = ModelConfig.preset("gpt-tiny", seq_length=32, hidden_dropout=0.0,
                               attention_dropout=0.0, init_method_std=0.05)
"""Trained with --fp8-format hybrid (FP8Recipe("hybrid"))."""
REL_DELAYED = 1e-5
"""TP=2 against TP=1 under delayed scaling, relative to max |logit|: the amaxes are max-reduced
over TP, so both cast the same numbers and differ only in summation order (as without FP8)."""
DELAYED_FLIPS = 0.0
"""Where summation orders differ between TP=1 and TP=2 (the GPU's GEMMs pick their algorithm by
shape), an fp32 difference of an ulp can carry an activation across an FP8 rounding boundary
(e4m3 steps are 6-12% apart) in the next layer's cast, and when that element is a tensor's amax
the next step's delayed scale differs, so that every element of the tensor rounds differently:
the delayed bound is then this multiple of FP8's own error (TP=1 FP8 against fp32), if larger
than REL_DELAYED. 0 on CPU, where the two sum alike."""


def _case_tp2_forward_matches_tp1(ref: ParallelDims, tp: ParallelDims, recipe: str) -> None:
    """Three forwards (delayed: the 2nd and 3rd cast with scales from the steps before). Under
    tensorwise each rank scales its own weight and input shards, so TP=2 rounds differently:
    its distance to TP=1 must stay within 1.5x FP8's own error (TP=1 FP8 against fp32)."""
    config, scaling = FP8_MODEL, FP8Recipe("hybrid", recipe)
    torch.manual_seed(7)
    reference = build_model(config, ref, "gpt", fp8=scaling)
    full = reference.full_state_dict()
    model = build_model(config, tp, "gpt", fp8=scaling)
    model.load_full_state_dict(full)
    high = build_model(config, ref, "gpt")
    high.load_full_state_dict(full)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_length),
                           generator=torch.Generator().manual_seed(11))
    exact = high(tokens).detach()
    for step in range(3):
        logits, ref_logits = model(tokens).detach(), reference(tokens).detach()
        fp8_error = (ref_logits - exact).abs().max().item() / exact.abs().max().item()
        assert fp8_error > 1e-3, f"FP8 logits equal fp32 ones ({fp8_error:.1e}): not quantized"
        rel = (max(REL_DELAYED, DELAYED_FLIPS * fp8_error) if recipe == "delayed"
               else 1.5 * fp8_error)
        assert_close(logits, ref_logits, rel,
                     f"logits, {recipe} step {step + 1} (FP8's own error {fp8_error:.2e})")


TRAIN = make_config(FP8_MODEL, micro_batch_size=2, global_batch_size=4, train_iters=12, lr=5e-3,
                    lr_warmup_iters=2, log_interval=100, eval_interval=100, eval_iters=1,
                    mock_data=True, format="hybrid")


def _train(dims: ParallelDims, **overrides) -> dict:
    config = with_leaves(TRAIN, tensor_model_parallel_size=dims.tp, **overrides)
    return train(config, dims, "gpt", log=lambda line: None)


def _case_learns(dims: ParallelDims) -> None:
    """10 steps, --fp8-format hybrid (delayed): the loss falls from ln(512) = 6.24."""
    losses = _train(dims, train_iters=10)["losses"]
    assert losses[0] > 5.5, losses
    assert sum(losses[-3:]) / 3 < 0.9 * losses[0], f"the loss did not fall: {losses}"


def _case_resume_exact(dims: ParallelDims, root: str) -> None:
    """12 steps straight == 6 (saved) + resume + 6, bit for bit, with a 4-step max history at
    DP=2 (each DP rank's scaling state is its own); without restoring that state the resumed
    losses differ, so the test can tell."""
    history = dict(amax_history_len=4, amax_compute_algo="max", margin=1)
    straight = _train(dims, **history)
    first = _train(dims, **history, save=f"{root}/fp8", exit_interval=6)
    resumed = _train(dims, **history, load=f"{root}/fp8")
    assert first["losses"] + resumed["losses"] == straight["losses"]
    load_fp8 = shards._ShardReader._load_fp8
    shards._ShardReader._load_fp8 = lambda self, model: None
    try:
        fresh = _train(dims, **history, load=f"{root}/fp8")
    finally:
        shards._ShardReader._load_fp8 = load_fp8
    assert fresh["losses"] != straight["losses"][6:]


SUITE = DistSuite(worlds=(2,))


@pytest.fixture(scope="module")
def fp8_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("fp8")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"ref": ParallelDims(tp=1), "tp": ParallelDims(tp=world), "root": root}


SUITE.case("tp2_forward_tensorwise", _case_tp2_forward_matches_tp1, C.ref, C.tp, "tensorwise")
SUITE.case("tp2_forward_delayed", _case_tp2_forward_matches_tp1, C.ref, C.tp, "delayed")
SUITE.case("tp2_learns", _case_learns, C.tp)
SUITE.case("dp2_resume_exact", _case_resume_exact, C.ref, C.root)

test_fp8_dist = SUITE.test(args_fixture="fp8_root")
