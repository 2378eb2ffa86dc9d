"""The FP8 linear's weight cast made once per weight value (tp/fp8.py, FP8State.cast_weight) on
CPU: training with gradient accumulation and optimizer steps equals casting the weight at every
micro-batch, bit for bit (outputs, gradients, the delayed state), under both recipes, with and
without an input gradient, with the codes of --fp8-param-gather; the weight is cast once per step
under tensorwise and twice under delayed's defaults (its WEIGHT scale changes between a step's
first and second micro-batch); an optimizer step, a load_state_dict and a replaced or rewritten
weight make it cast again; the gathered codes' transpose is made once per gather; ZeRO's flat
buffers bump the parameters' version counters (stages 0, 1 and 3); compiled casts compile in the
first step only.

The reference is `_Uncached`: the state with the cache off (`cache_weight` False: cast_weight is
plain cast, as CUDA graphs run it), i.e. the linear as it was before the cache."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from megadomino.build import build_model
from megadomino.config import FP8Recipe, ModelConfig
from megadomino.config.train import E4M3
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.tp import fp8
from megadomino.tp.fp8 import FP8State, fp8_linear, fp8_states, quantize
from megadomino.zero import ZeroConfig, ZeroPlusPlus

pytestmark = [pytest.mark.usefixtures("single_process_group"),
              pytest.mark.filterwarnings("ignore:FP8 GEMM")]


class _Uncached(FP8State):
    """The weight cast at every forward (`cache_weight` off, as for linears captured in CUDA
    graphs), the gathered codes' transpose made at every forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_weight = False

    def gathered_transpose(self):
        return self.gathered_weight[0].t().contiguous()


RECIPES = {
    "tensorwise": FP8Recipe(recipe="tensorwise"),
    "delayed": FP8Recipe(recipe="delayed"),
    "delayed-max3-interval2": FP8Recipe(recipe="delayed", amax_history_len=3,
                                        amax_compute_algo="max", margin=1, interval=2),
}


@contextlib.contextmanager
def _weight_casts(weight: nn.Parameter):
    """Counts the casts of `weight` (every cast of the eager path goes through cast_operand)."""
    count = [0]
    real = fp8.cast_operand

    def spy(t, *args):
        count[0] += t is weight
        return real(t, *args)

    fp8.cast_operand = spy
    try:
        yield count
    finally:
        fp8.cast_operand = real


def _train(state: FP8State, steps: int = 3, micro: int = 4, x_grad: bool = True,
           gather_every: int = 0, weight: nn.Parameter | None = None) -> tuple[list, list[int]]:
    """`steps` optimizer steps (SGD, in place) of `micro` micro-batches each, a no-grad forward
    inside each step; with `gather_every`, the weight's codes handed over as ZeRO's FP8 gather
    does on every other step. Everything computed, and the weight's casts per step."""
    weight = weight if weight is not None else nn.Parameter(
        0.05 * torch.randn(48, 32, generator=torch.Generator().manual_seed(0)))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    seen, casts = [], []
    with _weight_casts(weight) as count:
        for step in range(steps):
            state.gathered_weight = None
            if gather_every and step % gather_every:
                scale = 448.0 / weight.detach().abs().amax().float()
                state.gathered_weight = (quantize(weight.detach(), scale, E4M3),
                                         scale.reciprocal())
            before = count[0]
            for m in range(micro):
                gen = torch.Generator().manual_seed(10 * step + m)
                x = ((1 + m) * torch.randn(2, 16, 32, generator=gen)).requires_grad_(x_grad)
                y = fp8_linear(x, weight, None, state)
                (y * torch.randn(y.shape, generator=gen)).sum().backward()
                seen += [y.detach(), weight.grad.clone()] + ([x.grad] if x_grad else [])
                if m == 1:
                    with torch.no_grad():
                        seen.append(fp8_linear(x.detach(), weight, None, state))
            casts.append(count[0] - before)
            optimizer.step()
            optimizer.zero_grad()
            seen += [value.clone() for value in state.state_dict().values()]
    return seen, casts


def _same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_cached_training_equals_casting_every_micro_batch(recipe, x_grad):
    got, casts = _train(FP8State(RECIPES[recipe]), x_grad=x_grad)
    want, want_casts = _train(_Uncached(RECIPES[recipe]), x_grad=x_grad)
    assert _same(got, want)
    assert want_casts == [5, 5, 5] and sum(casts) < 12, casts  # 4 micro-batches, 1 no-grad


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_gathered_codes_train_as_without_the_cache(recipe):
    """--fp8-param-gather: the weight takes current scaling; on gathered steps the codes."""
    states = [cls(RECIPES[recipe]) for cls in (FP8State, _Uncached)]
    for state in states:
        state.weight_current_scaling = True
    (got, casts), (want, _) = (_train(state, steps=4, gather_every=2) for state in states)
    assert _same(got, want)
    assert casts == [1, 0, 1, 0], casts


@pytest.mark.parametrize("recipe, per_step", [
    (RECIPES["tensorwise"], [1, 1, 1]),
    (RECIPES["delayed"], [2, 2, 2]),
    (FP8Recipe(recipe="delayed", amax_history_len=2, amax_compute_algo="max"), [3, 3, 3]),
    (RECIPES["delayed-max3-interval2"], [2, 2, 2]),
])
def test_weight_cast_once_per_weight_value_and_scale(recipe, per_step):
    """4 micro-batches (and a no-grad forward) a step. Delayed: the step's first micro-batch
    casts with the scale from the previous weight's amax, the second with the new one's; a
    2-row max history reads the previous weight's amax once more (3 casts); updates every 2nd
    forward leave the scale of micro-batches 1 and 3 to micro-batches 2 and 4."""
    _, casts = _train(FP8State(recipe))
    assert casts == per_step


def test_replaced_or_rewritten_weight_is_cast_again():
    state = FP8State(RECIPES["tensorwise"])
    weight = nn.Parameter(torch.randn(48, 32))
    x = torch.randn(32, 32)

    def casts(w: nn.Parameter) -> int:
        with _weight_casts(w) as count:
            y = fp8_linear(x, w, None, state)
        assert torch.equal(y, fp8_linear(x, w, None, _Uncached(RECIPES["tensorwise"])))
        return count[0]

    assert casts(weight) == 1 and casts(weight) == 0
    with torch.no_grad():
        weight.mul_(2.0)  # in place: the version counter moves
    assert casts(weight) == 1 and casts(weight) == 0
    replaced = nn.Parameter(weight.detach().clone())  # the same values, another tensor
    assert casts(replaced) == 1
    replaced.data = torch.randn(48, 32)  # another storage, the version counter unmoved
    assert casts(replaced) == 1 and casts(replaced) == 0


class _Net(nn.Module):
    def __init__(self, state_class: type[FP8State], recipe: FP8Recipe):
        super().__init__()
        self.weight = nn.Parameter(0.05 * torch.randn(48, 32,
                                                      generator=torch.Generator().manual_seed(2)))
        self.fp8_state = state_class(recipe)


@pytest.mark.parametrize("recipe", ["delayed", "delayed-max3-interval2"])
def test_load_state_dict_drops_the_codes(recipe):
    """A resumed net (weights and delayed state loaded mid-run, after an odd number of
    forwards) continues as the uninterrupted one, cached or not; a load into a net that casts
    makes it cast again although its weight is unchanged."""
    nets = [_Net(FP8State, RECIPES[recipe]), _Net(_Uncached, RECIPES[recipe])]
    for net in nets:
        _train(net.fp8_state, steps=1, micro=3, weight=net.weight)
    saved = copy.deepcopy(nets[0].state_dict())
    assert torch.equal(saved["fp8_state.steps"], torch.tensor(3))
    straight, want = (_train(net.fp8_state, steps=2, micro=3, weight=net.weight)[0]
                      for net in nets)
    resumed = _Net(FP8State, RECIPES[recipe])
    _train(resumed.fp8_state, steps=2, micro=2, weight=resumed.weight)  # other history, codes
    resumed.load_state_dict(saved)
    with _weight_casts(resumed.weight) as count:
        with torch.no_grad():
            fp8_linear(torch.randn(16, 32), resumed.weight, None, resumed.fp8_state)
    assert count[0] == 1
    got = _train(resumed.fp8_state, steps=2, micro=3, weight=resumed.weight)[0]
    assert _same(straight, want) and _same(got, want)


def test_gathered_transpose_made_once_per_gather():
    state = FP8State(RECIPES["tensorwise"])
    codes = quantize(torch.randn(48, 32), torch.tensor(50.0), E4M3)
    transposes = []
    for _ in range(2):
        state.gathered_weight = (codes.clone(), torch.tensor(0.02))
        for _ in range(3):
            x = torch.randn(16, 32, requires_grad=True)
            fp8_linear(x, nn.Parameter(torch.randn(48, 32)), None, state).sum().backward()
            transposes.append(state.gathered_transpose())
    assert [id(t) for t in transposes[:3]] == [id(transposes[0])] * 3
    assert transposes[3] is not transposes[0] and transposes[4] is transposes[3]
    assert torch.equal(transposes[0].view(torch.uint8), codes.t().contiguous().view(torch.uint8))


def _zero_run(state_class: type[FP8State], recipe: str, **zero) -> tuple[list, list[int]]:
    """gpt-tiny (bf16) with FP8 linears in a ZeRO engine: 3 steps of 3 micro-batches. The
    losses, the final weights, and one FP8 weight's version counter after each step."""
    dims = ParallelDims(tp=1)
    config = ModelConfig.preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0,
                                seq_length=32, params_dtype="bfloat16")
    model_parallel_seed(1234, dims)
    model = build_model(config, dims, "gpt", device="cpu", fp8=RECIPES[recipe])
    for state in fp8_states(model).values():
        state.__class__ = state_class
    if zero["stage"]:
        zero["layers_per_unit"] = 1
    engine = ZeroPlusPlus(model, dims, lambda groups: torch.optim.SGD(groups, lr=0.5),
                          ZeroConfig(**zero))
    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    gen = torch.Generator().manual_seed(0)
    seen, versions = [], []
    for _ in range(3):
        for micro in range(3):
            tokens = torch.randint(0, config.vocab_size, (2, 33), generator=gen)
            with engine.no_sync() if micro < 2 else contextlib.nullcontext():
                loss = engine(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
                engine.backward(loss / 3)
            seen.append(loss.detach())
        engine.step()
        versions.append(weight._version)
    return seen + list(engine.full_state_dict().values()), versions


@pytest.mark.parametrize("recipe, zero", [
    ("delayed", dict(stage=0)),
    ("tensorwise", dict(stage=1)),
    ("delayed", dict(stage=1, fp8_param_gather=True)),
    ("delayed", dict(stage=3)),
])
def test_zero_flat_buffers_bump_versions_and_train_as_uncached(recipe, zero):
    """The engine writes parameters through their flat buffers (`.data` views), which autograd's
    counters do not see: its refresh bumps them, so the cached codes follow the steps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got, versions = _zero_run(FP8State, recipe, **zero)
        want, _ = _zero_run(_Uncached, recipe, **zero)
    assert _same(got, want)
    assert versions[0] < versions[1] < versions[2], versions


def test_compiled_casts_compile_in_the_first_step_only():
    """--compile-layer-pieces' compiled cast (CPU; CUDA runs the Triton cast): the cache lives
    in eager code around it (`_FP8Linear` is never inside a compiled region), so later
    micro-batches and steps, hits and misses alike, compile nothing."""
    state = FP8State(RECIPES["delayed"], compiled=True)
    weight = nn.Parameter(0.05 * torch.randn(48, 32))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    graphs = []
    for _ in range(3):
        for _ in range(3):
            x = torch.randn(32, 32, requires_grad=True)
            fp8_linear(x, weight, None, state).sum().backward()
        optimizer.step()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[2] == graphs[0], graphs
