"""--fp8-param-gather (zero/fp8_gather.py): the FP8 linears' weights all-gathered as e4m3 codes,
which the linears' GEMMs take as gathered.

Single process: a unit of odd shapes over 1, 3 and 5 simulated DP ranks (shards cut through
parameters, padding at the end) encodes to the linear's own codes of each FP8 weight
(quantize(W, 448 / amax(W))) and decodes every other parameter exactly; an FP8 linear handed
the gathered codes computes, forward and backward, exactly what its own current-scaling cast
computes.
gloo ranks: at ZeRO 3 and ZeRO 1 with the overlapped gather (the Llama-3 8B FP8 script's), DP=2,
the weight gathers move 0.5x bf16's bytes plus the biases and norms, by the engine's own count;
training with --fp8-recipe tensorwise gives the run without the gather's losses exactly (TP=2 x
DP=2 too), with delayed scaling within 2%; a resume repeats the uninterrupted run exactly.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import C, DistSuite
from megadomino.build import build_model
from megadomino.cli.arguments import parse_args
from megadomino.config import FP8Recipe
from megadomino.config.train import E4M3
from megadomino.distributed import ParallelDims, comm
from megadomino.tp.fp8 import FP8State, fp8_linear, quantize
from megadomino.train.loop import train
from megadomino.zero.fp8_gather import FP8Layout
from megadomino.zero.optimizer import build_engine
from megadomino.zero.partition import FlatUnit

SHAPES = [(48, 40), (48,), (40,), (37, 16), (7,), (32, 48)]
FP8 = [0, 3, 5]
"""Indices of SHAPES that are FP8 weights; the rest are biases and norms."""


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02 * (i + 1))
                               .to(dtype)) for i, shape in enumerate(SHAPES)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dp", [1, 3, 5])
def test_payloads_over_ranks(dtype, dp):
    params = _params(dtype)
    states = {id(params[i]): FP8State(FP8Recipe(recipe="tensorwise")) for i in FP8}
    layouts = [FP8Layout.of(FlatUnit("u", params, dp, r), states, dp, r, dtype)
               for r in range(dp)]
    flat = layouts[0].unit.flatten([p.detach() for p in params], dtype)
    amaxes = torch.stack([layout.own_amaxes(layout.unit.shard(flat)) for layout in layouts])
    want_amax = torch.stack([params[i].detach().abs().amax().float() for i in FP8])
    assert torch.equal(amaxes.amax(0), want_amax)
    scales = 448.0 / want_amax
    payloads = [layout.encode(layout.unit.shard(flat), scales) for layout in layouts]
    codes = torch.cat([c for c, _ in payloads])
    other = torch.stack([o for _, o in payloads])
    assert other.shape[1] < 0.1 * flat.numel()
    out = torch.full_like(flat, float("nan"))
    layout = layouts[1 % dp]
    layout.decode_other(other, out)
    layout.publish(codes, scales)
    views = layout.unit.views(out)
    for index, (param, got) in enumerate(zip(params, views)):
        if index in FP8:
            slot = FP8.index(index)
            want = quantize(param.detach(), scales[slot], E4M3)
            weight, inverse = states[id(param)].gathered_weight
            assert torch.equal(weight.view(torch.uint8), want.view(torch.uint8)), index
            assert inverse == scales[slot].reciprocal()
        else:
            assert torch.equal(got, param.detach()), index
    layout.unpublish()
    assert all(state.gathered_weight is None for state in states.values())


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_linear_on_gathered_codes_computes_its_own_cast(recipe):
    """Forward and backward of an FP8 linear handed the codes and scale of its current-scaling
    cast equal the linear casting the weight itself, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 48, generator=generator, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(64, 48, generator=generator) * 0.02)
    results = []
    for gathered in (False, True):
        state = FP8State(FP8Recipe(recipe=recipe))
        state.weight_current_scaling = True
        if gathered:
            scale = 448.0 / weight.detach().abs().amax().float()
            state.gathered_weight = (quantize(weight.detach(), scale, E4M3), scale.reciprocal())
        x.grad, weight.grad = None, None
        y = fp8_linear(x, weight, None, state)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
        results.append((y.detach(), x.grad.clone(), weight.grad.clone()))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


# ---- gloo ranks --------------------------------------------------------------------------------

BASE = ["--model-preset", "gpt-tiny", "--seq-length", "32", "--mock-data", "--global-batch-size",
        "8", "--micro-batch-size", "2", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters",
        "1", "--log-interval", "100", "--eval-interval", "100", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--fp8-format", "hybrid"]


def _config(dims: ParallelDims, *flags: str):
    config, _ = parse_args([*BASE, "--tensor-model-parallel-size", str(dims.tp), "--train-iters",
                            "6", *flags], "gpt")
    return config


def _weight_bytes(dims: ParallelDims, *flags: str) -> tuple[dict[str, int], list]:
    """Two steps and a forward of the engine by hand, bf16, a small vocabulary (so that the layers
    hold most parameters): the bytes each weight gather tag moved, and the FP8 layouts."""
    config = _config(dims, "--bf16", "--vocab-size", "100", *flags)
    model = build_model(config.model.replace(params_dtype=config.train.precision.params_dtype),
                        dims, "gpt", parallel=config.parallel, fp8=config.train.precision.fp8)
    engine = build_engine(model, dims, config)
    device = comm.group_device()  # the CPU under gloo, the rank's GPU under NCCL
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 100, (2, 33), generator=generator).to(device)
    mask = torch.ones(2, 32, device=device)
    for _ in range(2):
        loss = engine(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask).sum() / 64
        engine.backward(loss)
        engine.step()
    engine.model(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask)
    engine.params.release_all()
    return ({tag: counts["intra"] + counts["inter"] for tag, counts in engine.comm.bytes.items()
             if tag.startswith("weights")}, [layout for layout in engine.params.fp8 if layout])


def _case_half_the_bytes(dims: ParallelDims, *flags: str) -> None:
    """A layer unit sends half its bf16 shard plus the largest rank's share of its biases and
    norms (up to 4% of a gpt-tiny layer's shard at DP 2; 0.05% at hidden 4096); the gathers'
    bytes, the embeddings' unit (bf16 either way) included, 0.5-0.6x."""
    plain, _ = _weight_bytes(dims, *flags)
    fp8, layouts = _weight_bytes(dims, *flags, "--fp8-param-gather")
    assert plain.keys() == fp8.keys() and plain and layouts, (plain, fp8)
    for layout in layouts:
        ratio = (layout.unit.shard_numel + 2 * layout.n_other) / (2 * layout.unit.shard_numel)
        assert 0.5 <= ratio < 0.55, ratio
    for tag in plain:
        ratio = fp8[tag] / plain[tag]
        assert 0.5 < ratio < 0.6, f"{tag}: {fp8[tag]} / {plain[tag]} = {ratio:.3f}"


def _check_close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want) > 0
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst <= rel, f"relative difference {worst:.2e} > {rel:g}: {got} vs {want}"


def _case_trains_as_without(dims: ParallelDims, *flags: str) -> None:
    """tensorwise: the losses without the gather, exactly (the same codes and scales); delayed:
    within 2% (its weights are scaled from their current amax under the gather, from the
    history without), and the loss falls."""
    log = {"log": lambda line: None}
    for recipe, rel in (("tensorwise", 0.0), ("delayed", 2e-2)):
        want = train(_config(dims, *flags, "--fp8-recipe", recipe), dims, "gpt", **log)
        got = train(_config(dims, *flags, "--fp8-recipe", recipe, "--fp8-param-gather"), dims,
                    "gpt", **log)
        _check_close(got["losses"], want["losses"], rel)
        assert got["losses"][-1] < 0.9 * got["losses"][0], got["losses"]


def _case_resume(dims: ParallelDims, directory: str, *flags: str) -> None:
    """3 steps, saved, resumed for 3: the uninterrupted run's losses exactly."""
    flags = (*flags, "--fp8-param-gather")
    log = {"log": lambda line: None}
    straight = train(_config(dims, *flags), dims, "gpt", **log)
    first = train(_config(dims, *flags, "--save", directory, "--exit-interval", "3"), dims,
                  "gpt", **log)
    resumed = train(_config(dims, *flags, "--load", directory), dims, "gpt", **log)
    assert first["losses"] + resumed["losses"] == straight["losses"]


SUITE = DistSuite()
STAGE1 = ("--use-distributed-optimizer", "--overlap-param-gather")


@pytest.fixture(scope="module")
def fp8_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("fp8_gather")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    if world == 2:
        return {"dp2": ParallelDims(tp=1), "stage3_dir": f"{root}/stage3",
                "stage1_dir": f"{root}/stage1"}
    return {"tp2_dp2": ParallelDims(tp=2)}


SUITE.case("dp2_stage3_bytes", _case_half_the_bytes, C.dp2, "--zero-stage", "3", worlds=(2,))
SUITE.case("dp2_stage1_bytes", _case_half_the_bytes, C.dp2, *STAGE1, worlds=(2,))
SUITE.case("dp2_stage3_trains", _case_trains_as_without, C.dp2, "--zero-stage", "3",
           worlds=(2,))
SUITE.case("dp2_stage1_trains", _case_trains_as_without, C.dp2, *STAGE1, worlds=(2,))
SUITE.case("dp2_stage3_resume", _case_resume, C.dp2, C.stage3_dir, "--zero-stage", "3",
           worlds=(2,))
SUITE.case("dp2_stage1_resume", _case_resume, C.dp2, C.stage1_dir, *STAGE1, worlds=(2,))
SUITE.case("tp2_dp2_stage3_trains", _case_trains_as_without, C.tp2_dp2, "--zero-stage", "3",
           "--sequence-parallel", worlds=(4,))
SUITE.case("tp2_dp2_stage1_trains", _case_trains_as_without, C.tp2_dp2, *STAGE1,
           "--sequence-parallel", worlds=(4,))

test_zero_fp8_gather = SUITE.test(args_fixture="fp8_root")
