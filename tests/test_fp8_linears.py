"""Which linears run FP8 (config/train.py FP8Recipe.linears and Megatron-LM's first / last layers
in bf16, models/blocks.py and transformer.py; --fp8-linears auto, train/fp8_linears.py) on CPU,
where torch._scaled_mm runs the FP8 path itself.

Single process: Megatron's first/last rule; the selection builds an FP8State on exactly the
selected linears (GPT and Llama, whole models and a layer range); every linear of a model with
only fc1, fc2 in FP8 computes what the all-high-precision model's (qkv, proj) or the all-FP8
model's (fc1, fc2) linear computes from the same input, and the model trains; auto's rule on
given times and its resolution of a config; the start-up summary's clause; the flags' refusals
and notices. gloo, 2 ranks: the selection at TP=2; auto resolving the same roles on every rank,
timed for real and with rank-dependent times (the slowest rank's decide); a mixed model's
checkpoint resumed bit for bit, and loaded into another selection; --fp8-param-gather with a
mixed model trains as without it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import C, DistSuite
from megadomino.build import build_model
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError, FP8Recipe, ModelConfig
from megadomino.config.train import FP8_ROLES
from megadomino.distributed import ParallelDims, comm
from megadomino.models.transformer import TransformerBlock
from megadomino.tp.fp8 import fp8_states
from megadomino.train import fp8_linears
from megadomino.train.loop import train
from megadomino.train.summary import startup_lines

PATHS = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
         "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
BASE = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10"]
RUN = ["--model-preset", "gpt-tiny", "--seq-length", "32", "--mock-data", "--micro-batch-size",
       "2", "--global-batch-size", "4", "--lr", "5e-3", "--lr-warmup-iters", "1",
       "--log-interval", "100", "--eval-interval", "100", "--eval-iters", "0",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--fp8-format", "hybrid"]
"""A gpt-tiny training run (2 layers) with FP8, under --fp8-linears' default (all)."""


def fp8_linears_of(block: TransformerBlock) -> set[tuple[int, str]]:
    """(global layer index, role) of every linear of the block's layers that holds an
    FP8State; checks no other module holds one."""
    found = {(block.layer_offset + i, role) for i, layer in enumerate(block.layers)
             for role, path in PATHS.items() if layer.get_submodule(path).fp8_state is not None}
    assert len(fp8_states(block)) == len(found)
    return found


def expected(roles: tuple[str, ...], layers: range) -> set[tuple[int, str]]:
    return {(layer, role) for layer in layers for role in roles}


def _run(dims: ParallelDims, *flags: str, iters: int = 6, log=None) -> dict:
    config, _ = parse_args([*RUN, "--tensor-model-parallel-size", str(dims.tp), "--train-iters",
                            str(iters), *flags], "gpt")
    return train(config, dims, "gpt", log=log or (lambda line: None))


@pytest.mark.parametrize("layers, start, end, on", [
    (6, 1, 1, True), (6, 2, 0, True), (6, 0, 3, True), (6, 3, 3, True), (6, 1, 1, False)])
def test_first_last_layers_follow_megatrons_rule(layers, start, end, on):
    """Megatron-LM's is_first_last_bf16_layer: global layers [0, start) and [L - end, L)."""
    recipe = FP8Recipe(first_last_layers_bf16=on, num_layers_at_start_in_bf16=start,
                       num_layers_at_end_in_bf16=end)
    want = {layer for layer in range(layers) if on and (layer < start or layer >= layers - end)}
    assert {layer for layer in range(layers) if recipe.bf16_layer(layer, layers)} == want


SELECTIONS = [
    (FP8_ROLES, None), (("fc1", "fc2"), None), (("qkv",), (1, 1)), (("proj", "fc2"), (2, 0)),
    ((), None)]
"""(roles, (start, end) of --first-last-layers-bf16 or None)."""


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("roles, ends", SELECTIONS)
def test_the_selected_linears_and_only_they_hold_fp8_states(family, roles, ends):
    """Whole models of 4 layers, and the layer range [2, 4) of one (a pipeline stage's share),
    whose layers keep their global indices."""
    config = ModelConfig.preset(f"{family}-tiny", num_layers=4)
    start, end = ends or (1, 1)
    recipe = FP8Recipe(linears=roles, first_last_layers_bf16=ends is not None,
                       num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=end)
    fp8_layers = range(start, 4 - end) if ends else range(4)
    model = build_model(config, ParallelDims(tp=1), family, fp8=recipe)
    assert fp8_linears_of(model.decoder) == expected(roles, fp8_layers)
    stage = TransformerBlock(config, ParallelDims(tp=1), fp8=recipe, layer_range=(2, 4))
    assert fp8_linears_of(stage) == expected(roles, [i for i in fp8_layers if i >= 2])


@pytest.mark.usefixtures("single_process_group")
def test_an_unresolved_auto_is_refused_where_nothing_times_it():
    with pytest.raises(ConfigError, match="--fp8-linears auto is resolved by the training run"):
        build_model(ModelConfig.preset("gpt-tiny"), ParallelDims(tp=1), "gpt",
                    fp8=FP8Recipe(linears="auto"))


def _linear_calls(model) -> dict[tuple[int, str], tuple]:
    """Every layer linear's (args, kwargs, output) of one forward of `model`."""
    calls, hooks = {}, []
    for index, layer in enumerate(model.decoder.layers):
        for role, path in PATHS.items():
            def hook(module, args, kwargs, out, key=(index, role)):
                calls[key] = (args, kwargs, out)
            hooks.append(layer.get_submodule(path).register_forward_hook(hook, with_kwargs=True))
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.seq_length),
                           generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(tokens)
    for handle in hooks:
        handle.remove()
    return calls


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_model_with_fc1_fc2_in_fp8_runs_each_linear_as_selected(family):
    """Each linear of the mixed model, fed the input it saw, gives bit for bit what the same
    linear of the all-high-precision model (qkv, proj) or of the all-FP8 model (fc1, fc2) gives;
    fc1 and fc2 differ from high precision (they are quantized). Tensorwise: no state."""
    config = ModelConfig.preset(f"{family}-tiny", seq_length=32, num_layers=3)
    dims, scaling = ParallelDims(tp=1), FP8Recipe(recipe="tensorwise")
    torch.manual_seed(5)
    mixed = build_model(config, dims, family,
                        fp8=FP8Recipe(recipe="tensorwise", linears=("fc1", "fc2")))
    weights = mixed.full_state_dict()
    references = {}
    for name, fp8 in (("high", None), ("fp8", scaling)):
        references[name] = build_model(config, dims, family, fp8=fp8)
        references[name].load_full_state_dict(weights)
    calls = _linear_calls(mixed)
    assert len(calls) == 3 * 4
    for (index, role), (args, kwargs, out) in calls.items():
        layer = {name: model.decoder.layers[index] for name, model in references.items()}
        with torch.no_grad():
            high = layer["high"].get_submodule(PATHS[role])(*args, **kwargs)
            fp8 = layer["fp8"].get_submodule(PATHS[role])(*args, **kwargs)
        want = fp8 if role in ("fc1", "fc2") else high
        assert torch.equal(out, want), (index, role)
        assert torch.equal(out, high) == (role in ("qkv", "proj")), (index, role)


@pytest.mark.usefixtures("single_process_group")
def test_a_model_with_fc1_fc2_in_fp8_trains():
    losses = _run(ParallelDims(tp=1), "--fp8-linears", "fc1,fc2", iters=8)["losses"]
    assert losses[0] > 5.5 and sum(losses[-3:]) / 3 < 0.95 * losses[0], losses


def test_autos_rule_keeps_fp8_only_where_it_takes_at_most_098_of_bf16s_time():
    assert fp8_linears.choose([1.0, 1.0, 2.0, 2.0], [0.97, 0.98, 1.99, 1.0]) == \
        ("qkv", "proj", "fc2")
    assert fp8_linears.choose([1.0] * 4, [1.5] * 4) == ()


@pytest.mark.usefixtures("single_process_group")
def test_auto_resolves_the_config_with_the_roles_it_chose(monkeypatch):
    """Given times (bf16, FP8 per role, in FP8_ROLES order): the config that runs names the
    chosen roles, and the start-up line every time; a config without auto is left as it is."""
    given = [1.0, 1.2, 1.0, 0.9, 2.0, 1.0, 2.0, 1.98]
    monkeypatch.setattr(fp8_linears, "interleaved_medians",
                        lambda timers, rounds, device, world: torch.tensor(given))
    config, _ = parse_args([*RUN, "--train-iters", "1", "--fp8-linears", "auto"], "gpt")
    lines: list[str] = []
    resolved = fp8_linears.resolve_fp8_linears(config, ParallelDims(tp=1), 2, lines.append)
    assert resolved.train.precision.fp8.linears == ("proj", "fc1")
    assert lines == [
        "fp8 linears auto: FP8 in proj, fc1, fp32 in qkv, fc2 (FP8 where it takes at most "
        "0.98x fp32's time); timed each GEMM's forward+backward [MxKxN], median of 3 passes, "
        "slowest rank: qkv [64x64x192] fp32 1.000 ms, FP8 1.200 ms (1.20x), proj [64x64x64] "
        "fp32 1.000 ms, FP8 0.900 ms (0.90x), fc1 [64x64x256] fp32 2.000 ms, FP8 1.000 ms "
        "(0.50x), fc2 [64x256x64] fp32 2.000 ms, FP8 1.980 ms (0.99x)"]
    named, _ = parse_args([*RUN, "--train-iters", "1", "--fp8-linears", "fc1"], "gpt")
    assert fp8_linears.resolve_fp8_linears(named, ParallelDims(tp=1), 2, lines.append) is named


def _summary(*flags: str) -> str:
    config, _ = parse_args([*BASE, "--bf16", "--num-layers", "24", *flags], "gpt")
    return "\n".join(startup_lines("gpt", config, 1000, world=1, tp=1, pp=1, dp=1,
                                   backend="gloo", device="CPU", global_batch=1,
                                   micro_batches=1, iterations=10, data="mock data"))


def _bench_module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_pretrain.py"
    spec = importlib.util.spec_from_file_location("bench_pretrain", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_summary_and_every_benchmark_row_say_which_linears_run_fp8():
    clause = ("FP8 hybrid (delayed scaling) in linears fc1, fc2 of layers 2-23; qkv, proj and "
              "layers 1, 24 in bf16")
    text = _summary("--fp8-format", "hybrid", "--fp8-linears", "fc1,fc2",
                    "--first-last-layers-bf16")
    assert f"precision: bf16, {clause}\n" in text, text
    assert "in linears qkv, proj, fc1, fc2 of layers 1-24\n" in _summary("--fp8-format", "e4m3")
    bench = _bench_module()
    auto = "fp8 linears auto: FP8 in fc1, fc2, bf16 in qkv, proj (FP8 where ...)"
    assert bench.fp8_fields(f"{auto}\n{text}\niteration 1") == {
        "fp8_linears": clause, "fp8_auto": auto[len("fp8 linears auto: "):]}
    assert bench.fp8_fields(_summary()) == {"fp8_linears": "none"}


@pytest.mark.parametrize("argv, message", [
    (["--fp8-linears", "fc3"], "--fp8-linears=fc3 is invalid: it must be 'all', 'auto' or a "
     "comma list of qkv, proj, fc1, fc2"),
    (["--fp8-linears", "fc1,auto"], "--fp8-linears=fc1,auto is invalid"),
    (["--fp8-linears", ""], "--fp8-linears= is invalid"),
    (["--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "3"],
     r"--num-layers-at-end-in-bf16=3 is invalid: it must be in \[0, --num-layers \(2\)\]"),
    (["--num-layers-at-start-in-bf16", "-1"], "--num-layers-at-start-in-bf16=-1 is invalid"),
])
def test_bad_selections_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        parse_args([*BASE, "--fp8-format", "hybrid", *argv], "gpt")


@pytest.mark.parametrize("argv, notice", [
    (["--fp8-linears", "fc1", "--first-last-layers-bf16"],
     "--fp8-linears, --first-last-layers-bf16: not read, FP8 is off without --fp8-format"),
    (["--fp8-format", "hybrid", "--num-layers-at-end-in-bf16", "1"],
     "--num-layers-at-end-in-bf16: not read without --first-last-layers-bf16"),
])
def test_settings_without_their_feature_say_so_by_their_flags(argv, notice):
    config, notices = parse_args([*BASE, *argv], "gpt")
    assert [line for line in notices if line.startswith(notice)], notices
    assert config.train.precision.fp8 in (None, FP8Recipe())


# gloo, 2 ranks.

def _case_tp2_selection(dims: ParallelDims) -> None:
    for family in ("gpt", "llama"):
        config = ModelConfig.preset(f"{family}-tiny", num_layers=3)
        recipe = FP8Recipe(linears=("qkv", "fc2"), first_last_layers_bf16=True,
                           num_layers_at_end_in_bf16=0)
        model = build_model(config, dims, family, fp8=recipe)
        assert fp8_linears_of(model.decoder) == expected(("qkv", "fc2"), range(1, 3))


def _same_on_every_rank(model) -> set[tuple[int, str]]:
    mine = fp8_linears_of(model.decoder)
    everyone = comm.all_gather_object(sorted(mine))
    assert all(theirs == sorted(mine) for theirs in everyone), everyone
    return mine


def _case_auto_timed(dims: ParallelDims) -> None:
    """Timed for real: every rank builds the roles rank 0's line names."""
    lines: list[str] = []
    history = _run(dims, "--fp8-linears", "auto", iters=2, log=lines.append)
    mine = _same_on_every_rank(history["model"])
    if dist.get_rank() == 0:
        line = next(line for line in lines if line.startswith("fp8 linears auto: FP8 in "))
        named = line[len("fp8 linears auto: FP8 in "):].split(" (")[0].split(", fp32 in")[0]
        assert mine == expected(tuple(named.split(", ")) if named != "none" else (), range(2))


def _case_auto_slowest_rank_decides(dims: ParallelDims) -> None:
    """Rank-dependent times: alone rank 0 would keep all four in FP8; the MAX over ranks keeps
    proj (0.97x) and fc1 (0.5x) only, on both ranks."""
    real = fp8_linears.interleaved_medians
    times = ([1.0, 0.5] * 4 if dist.get_rank() == 0
             else [1.0, 2.0, 1.0, 0.97, 1.0, 0.5, 1.0, 0.99])

    def given(timers, rounds, device, world):
        return real([lambda ms=ms: ms for ms in times], rounds, device, world)

    fp8_linears.interleaved_medians = given
    try:
        history = _run(dims, "--fp8-linears", "auto", iters=1)
    finally:
        fp8_linears.interleaved_medians = real
    assert _same_on_every_rank(history["model"]) == expected(("proj", "fc1"), range(2))


HISTORY = ("--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max", "--fp8-margin", "1")
MIXED = ("--fp8-linears", "fc1,fc2", "--first-last-layers-bf16",
         "--num-layers-at-end-in-bf16", "0", *HISTORY)
"""Layer 1's fc1 and fc2 in FP8 (layer 0 all bf16), delayed scaling with a history."""


def _case_mixed_resume(dims: ParallelDims, root: str) -> None:
    """8 steps straight == 4 (saved) + resume + 4 at DP=2, bit for bit; the checkpoint then
    loads into a model with every linear in FP8 (the states it lacks start fresh)."""
    straight = _run(dims, *MIXED, iters=8)
    assert fp8_linears_of(straight["model"].decoder) == expected(("fc1", "fc2"), [1])
    first = _run(dims, *MIXED, "--save", f"{root}/mixed", "--exit-interval", "4", iters=8)
    resumed = _run(dims, *MIXED, "--load", f"{root}/mixed", iters=8)
    assert first["losses"] + resumed["losses"] == straight["losses"]
    other = _run(dims, *HISTORY, "--load", f"{root}/mixed", iters=6)["losses"]
    assert len(other) == 2 and all(abs(a - b) < 0.05 * b
                                   for a, b in zip(other, straight["losses"][4:6])), other


def _case_mixed_param_gather(dims: ParallelDims) -> None:
    """ZeRO-1 with --fp8-param-gather, tensorwise: the losses without the gather, exactly (the
    FP8 weights gathered as codes, the bf16 linears' weights in their dtype)."""
    flags = ("--fp8-linears", "fc1,fc2", "--fp8-recipe", "tensorwise",
             "--use-distributed-optimizer")
    want = _run(dims, *flags)["losses"]
    gathered = _run(dims, *flags, "--fp8-param-gather")
    assert gathered["losses"] == want
    assert gathered["losses"][-1] < 0.95 * gathered["losses"][0], gathered["losses"]


SUITE = DistSuite(worlds=(2,))


@pytest.fixture(scope="module")
def linears_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("fp8_linears")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    return {"tp": ParallelDims(tp=world), "dp": ParallelDims(tp=1), "root": root}


SUITE.case("tp2_selection", _case_tp2_selection, C.tp)
SUITE.case("dp2_auto_timed", _case_auto_timed, C.dp)
SUITE.case("tp2_auto_slowest_rank", _case_auto_slowest_rank_decides, C.tp)
SUITE.case("dp2_mixed_resume", _case_mixed_resume, C.dp, C.root)
SUITE.case("dp2_mixed_param_gather", _case_mixed_param_gather, C.dp)

test_fp8_linears_dist = SUITE.test(args_fixture="linears_root")
