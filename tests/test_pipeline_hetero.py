"""Heterogeneous pipeline plans (--pipeline-plan) against the same model without PP (fp32,
dropout 0, vocabulary 331 that pads): the mean loss over the micro-batches and every full
gradient within 1e-5 relative, GPT and Llama, 1F1B, eager-1F1B, ZB-H1, eager-zb and auto's
choice (its profiling pass through the resharding transport), for the plans of issue 20: a TP=2
stage feeding a TP=1 stage (3 ranks; with and without sequence parallelism), TP=2
then two TP=1 stages (4 ranks), a TP=1 / TP=2 / TP=1 chain whose ends share GPT's tied embedding
(4 ranks), a stage of 2 batch-split ranks feeding one of 3 (5 ranks: a micro-batch of 5
sequences splits 3 + 2, then 2 + 2 + 1), and a DP2 x TP2 stage with sequence parallelism (a 2-D
mesh: batch over DP, seq over TP) feeding a TP=1 stage (5 ranks). Each rank takes its rows of
each whole micro-batch; the gradients of a stage are averaged over its own DP group, as the
engine does. Through the training loop: 10 AdamW steps (clipping on) of DP2 -> DP3 (GPT and
Llama, eager-1F1B; GPT at ZeRO stage 1) and TP2 -> TP1 (Llama, 1F1B) give plain data
parallelism's losses, grad norms and validation loss within 1e-5. Also: the validator's refusals
of bad plan files, one line each naming the file."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch.distributed as dist
from test_pipeline_equivalence import reduce_stage_grads, reference_loss_and_grads
from test_tp_equivalence import batch, tiny_config

from configs import make_config, parallel_config
from dist_utils import C, DistSuite, assert_close, tier
from megadomino.build import build_stage
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError, ModelConfig
from megadomino.config.pipeline_plan import PipelinePlan, Stage
from megadomino.config.validate import validate
from megadomino.distributed import ParallelDims
from megadomino.pipeline.reshard.boundary import STRATEGY_OF
from megadomino.pipeline.runtime import PipelineRuntime
from megadomino.pipeline.stage import load_stage_full_state, stage_full_state
from megadomino.train.loop import train

REL = 1e-5
ITERS = 10

PLANS = {  # name -> (stages: ranks, tp, layers), layers in all
    "tp2_tp1": ([((0, 1), 2, (0, 4)), ((2,), 1, (4, 7))], 7),
    "tp2_tp1_tp1": ([((0, 1), 2, (0, 2)), ((2,), 1, (2, 4)), ((3,), 1, (4, 5))], 5),
    "tp1_tp2_tp1": ([((0,), 1, (0, 2)), ((1, 2), 2, (2, 3)), ((3,), 1, (3, 5))], 5),
    "dp2_dp3": ([((0, 1), 1, (0, 3)), ((2, 3, 4), 1, (3, 5))], 5),
    "dp2tp2_tp1": ([((0, 1, 2, 3), 2, (0, 2)), ((4,), 1, (2, 4))], 4),
    "tp1_tp2": ([((0,), 1, (0, 2)), ((1, 2), 2, (2, 4))], 4),
    "dp2_dp1": ([((0, 1), 1, (0, 4)), ((2,), 1, (4, 7))], 7),
    "dp2_tp2": ([((0, 1), 1, (0, 2)), ((2, 3), 2, (2, 4))], 4),
}
RESHARD_PLANS = {3: ("tp2_tp1", "tp1_tp2", "dp2_dp1"), 4: ("tp1_tp2_tp1", "dp2_tp2")}
"""The plans every --pipeline-reshard strategy runs, by world: TP2 -> TP1 (the gradient
broadcast to two replicas), TP1 -> TP2 (the activation), DP2 -> DP1 (no replica), a chain of
both, and DP2 -> TP2 (two slices to each of two replicas)."""


def file_plan(stages, num_layers: int) -> PipelinePlan:
    """The plan a --pipeline-plan file of `stages` (ranks, tp, layers) reads as."""
    return PipelinePlan(tuple(Stage(index, tuple(ranks), tp, (tuple(layers),))
                              for index, (ranks, tp, layers) in enumerate(stages)),
                        num_layers, batch_split=True)


def check_hetero(family: str, dims, dims_ref, plan_name: str, schedule: str, micro: int,
                 mbs: int, untie: bool, **parallel):
    plan, num_layers = file_plan(*PLANS[plan_name]), PLANS[plan_name][1]
    config = tiny_config(family, num_layers=num_layers, vocab_size=331,
                         untie_embeddings_and_output_weights=untie)
    every = [batch(config, seed=200 + m, b=mbs)[:3] for m in range(micro)]
    full, ref_loss, ref_grads = reference_loss_and_grads(config, family, dims_ref, every)
    parallel_cfg = parallel_config(pipeline_model_parallel_size=plan.size, **parallel)
    stage = build_stage(config, dims, plan, family, "cpu", parallel=parallel_cfg)
    load_stage_full_state(stage, full)
    runtime = PipelineRuntime(stage, plan, dims, config, parallel_cfg, schedule, mbs, micro)
    if "pipeline_reshard" in parallel:
        check_strategy(runtime.transport, parallel["pipeline_reshard"])
    loss = runtime.forward_backward(every)
    assert_close(loss, ref_loss, REL, "mean loss")
    reduce_stage_grads(stage, dims)
    grads = stage_full_state(stage, grads=True)
    params = stage_full_state(stage)
    assert grads.keys() == params.keys(), sorted(set(params) - set(grads))
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], REL, f"grad {name}")
    names = [None] * dims.world_size
    dist.all_gather_object(names, sorted(params))
    assert set().union(*map(set, names)) == set(ref_grads)


def check_strategy(transport, strategy: str) -> None:
    """Every boundary between different layouts runs `strategy` both ways (else the equality
    would hold whatever the flag did), and each start-up line names it with its time."""
    ways = [*transport.forward, *transport.backward]
    planned = [way.route for way in ways if way.route.plan is not None]
    assert planned and {route.plan.strategy for route in planned} == {STRATEGY_OF[strategy]}
    moved = [(route.broadcasts, route.gathers) for route in planned]
    if strategy == "broadcast":
        assert all(casts and not gathers for casts, gathers in moved)
    lines = transport.describe()
    assert len(lines) == 2 * (transport.stages - 1) and all(
        "same layout" in line or f": {STRATEGY_OF[strategy]} (" in line
        and " predicted " in line for line in lines), lines


SUITE = DistSuite(worlds=(3, 4, 5), timeout=300.0)


@SUITE.setup
def _setup(world: int) -> dict:
    out = {"ref": ParallelDims(tp=1)}
    for name, (stages, layers) in PLANS.items():
        if sum(len(ranks) for ranks, _, _ in stages) == world:
            out[name] = ParallelDims(plan=file_plan(stages, layers))
    return out


# each schedule on each plan in the default tier once, the families taking turns; the other
# family in the slow tier (the schedules and the resharding code are both families' own)
for family in ("gpt", "llama"):
    for index, schedule in enumerate(("1f1b", "eager-1f1b", "zb-h1", "eager-zb", "auto")):
        main = ("gpt", "llama")[index % 2]
        SUITE.case(f"{family}-tp2-tp1-{schedule}", check_hetero, family, C.tp2_tp1, C.ref,
                   "tp2_tp1", schedule, 4, 3, True, **tier(family, main, 3))
        SUITE.case(f"{family}-tp2-tp1-tp1-{schedule}", check_hetero, family,
                   C.tp2_tp1_tp1, C.ref, "tp2_tp1_tp1", schedule, 5, 2, True,
                   **tier(family, main, 4))
        SUITE.case(f"{family}-dp2-dp3-{schedule}", check_hetero, family, C.dp2_dp3, C.ref,
                   "dp2_dp3", schedule, 3, 5, True, **tier(family, main, 5))
    SUITE.case(f"{family}-tp2-sp-tp1", check_hetero, family, C.tp2_tp1, C.ref, "tp2_tp1",
               "eager-1f1b", 3, 3, True, sequence_parallel=True, worlds=(3,))
SUITE.case("llama-dp2tp2-sp-tp1", check_hetero, "llama", C.dp2tp2_tp1, C.ref, "dp2tp2_tp1",
           "eager-1f1b", 4, 3, True, sequence_parallel=True, worlds=(5,))
SUITE.case("gpt-tp1-tp2-tp1-tied", check_hetero, "gpt", C.tp1_tp2_tp1, C.ref,
           "tp1_tp2_tp1", "1f1b", 4, 3, False, worlds=(4,))
# Every strategy x family x schedule on a plan of 3 and of 4 ranks in the default tier, the
# plans taken in turn so that each runs every strategy; the rest of the grid in the slow tier.
for strategy in ("broadcast", "scatter-gather"):
    for turn, (family, schedule) in enumerate((f, s) for f in ("gpt", "llama")
                                              for s in ("1f1b", "eager-1f1b", "zb-h1")):
        for world, names in RESHARD_PLANS.items():
            for name in names:
                main = name == names[turn % len(names)]
                SUITE.case(f"{family}-{name.replace('_', '-')}-{strategy}-{schedule}",
                           check_hetero, family, getattr(C, name), C.ref, name, schedule, 4, 3,
                           True, pipeline_reshard=strategy, worlds=(world,) if main else (),
                           slow_worlds=() if main else (world,))
SUITE.case("gpt-tp2-sp-tp1-broadcast", check_hetero, "gpt", C.tp2_tp1, C.ref, "tp2_tp1",
           "1f1b", 3, 3, True, sequence_parallel=True, pipeline_reshard="broadcast",
           worlds=(3,))



def train_run(family: str, dims, layers: int, mbs: int, log=None, **changes) -> dict:
    config = make_config(
        tiny_config(family, num_layers=layers, vocab_size=331,
                    untie_embeddings_and_output_weights=True),
        micro_batch_size=mbs, global_batch_size=3 * 5, train_iters=ITERS, lr=3e-3, min_lr=3e-4,
        lr_warmup_iters=2, clip_grad=0.5, log_interval=5, eval_interval=ITERS, eval_iters=1,
        mock_data=True, **changes)
    return train(config, dims, family, log=log or (lambda line: None))


def check_training(family: str, dims, dims_ref, plan_name: str, schedule: str,
                   reshard: str | None = None, **changes):
    """AdamW steps through the training loop with the plan, against the same global batches
    on every rank as plain data parallelism (mock data: every label counts, so the mean over
    the plan's micro-batches of 5 and over the DP ranks' micro-batches of 1 are the same).
    `reshard`: the plan's --pipeline-reshard, whose choice rank 0 prints per boundary."""
    stages, layers = PLANS[plan_name]
    path = os.path.join(tempfile.mkdtemp(), "plan.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"stages": [{"ranks": list(r), "tp": t, "layers": list(la)}
                              for r, t, la in stages]}, handle)
    ref = train_run(family, dims_ref, layers, 1, **changes)
    lines: list[str] = []
    mine = train_run(family, dims, layers, 5, lines.append, pipeline_plan=path,
                     pipeline_schedule=schedule, pipeline_model_parallel_size=len(stages),
                     **({} if reshard is None else {"pipeline_reshard": reshard}), **changes)
    printed = [line for line in lines if line.startswith(" pipeline boundary ")]
    assert dims.rank != 0 or len(printed) == 2 * (len(stages) - 1), lines
    for line in printed if reshard is not None else ():
        assert f": {STRATEGY_OF[reshard]} (" in line and " predicted " in line, line
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, ref["losses"]
    for what in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(mine[what], ref[what], strict=True)):
            assert abs(a - b) <= REL * abs(b), (what, step, a, b)
    (a,), (b,) = ([e["loss"] for e in h["eval"]] for h in (mine, ref))
    assert abs(a - b) <= REL * abs(b), ("validation", a, b)


for family in ("gpt", "llama"):
    SUITE.case(f"{family}-train-dp2-dp3", check_training, family, C.dp2_dp3, C.ref, "dp2_dp3",
               "eager-1f1b", worlds=(5,))
SUITE.case("gpt-train-dp2-dp3-zero1", check_training, "gpt", C.dp2_dp3, C.ref, "dp2_dp3",
           "1f1b", worlds=(5,), stage=1)
SUITE.case("llama-train-tp2-tp1", check_training, "llama", C.tp2_tp1, C.ref, "tp2_tp1", "1f1b",
           worlds=(3,))
SUITE.case("gpt-train-tp1-tp2-broadcast", check_training, "gpt", C.tp1_tp2, C.ref, "tp1_tp2",
           "eager-1f1b", "broadcast", worlds=(3,))
SUITE.case("llama-train-tp2-tp1-scatter-gather", check_training, "llama", C.tp2_tp1, C.ref,
           "tp2_tp1", "zb-h1", "scatter-gather", worlds=(3,))

test_hetero_pipeline_matches_no_pp = SUITE.test()


def plan_file(tmp_path, stages) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"stages": [{"ranks": list(r), "tp": t, "layers": list(la)}
                                           for r, t, la in stages]}))
    return str(path)


GOOD = [((0, 1), 2, (0, 2)), ((2,), 1, (2, 4))]
BAD_FILES = [
    ([((0, 1), 2, (0, 2)), ((2,), 1, (3, 4))], "contiguous"),
    ([((0, 1), 2, (0, 2)), ((2,), 1, (2, 3))], "end at layer 3"),
    ([((0, 1), 2, (0, 2)), ((1,), 1, (2, 4))], "rank 1 is in more than one stage"),
    ([((0, 1), 2, (0, 2)), ((3,), 1, (2, 4))], "rank 3 is outside the world"),
    ([((0, 1), 2, (0, 2)), ((2, 3), 1, (2, 4))], "rank 3 is outside the world"),
    ([((0, 1, 2), 2, (0, 2)), ((3,), 1, (2, 4))], "tp 2 does not divide its 3 ranks"),
    ([((0, 1), 3, (0, 2)), ((2,), 1, (2, 4))], "tp 3 does not divide"),
    ([((0, 1, 2), 1, (0, 4))], "at least 2 stages"),
]


def plan_config(path: str, pp: int = 2, **leaves):
    model = ModelConfig.preset("gpt-tiny", num_layers=4, untie_embeddings_and_output_weights=True)
    leaves = dict(pipeline_model_parallel_size=pp, pipeline_plan=path, mock_data=True,
                  train_iters=1, micro_batch_size=2, global_batch_size=4) | leaves
    return make_config(model, **leaves)


def test_good_plan_validates(tmp_path):
    validate(plan_config(plan_file(tmp_path, GOOD)), 3)


@pytest.mark.parametrize("stages, message", BAD_FILES)
def test_bad_plan_files_are_refused(tmp_path, stages, message):
    path = plan_file(tmp_path, stages)
    with pytest.raises(ConfigError, match=message) as err:
        validate(plan_config(path, pp=len(stages)), 3)
    assert f"--pipeline-plan {path}" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("not json", "cannot be read as JSON"), ('{"stages": []}', "non-empty list 'stages'"),
    ('{"stages": [{"ranks": [0], "tp": 1}]}', "stage 0: no 'layers' .*exactly the keys"),
    ('{"stages": [{"ranks": [0], "tp": 1, "layer": [0, 4]}]}',
     "stage 0: unknown key 'layer'; no 'layers'"),
    ("[1, 2]", "expected an object"),
    ('{"stages": [{"ranks": [0], "tp": 0, "layers": [0, 4]}]}', "'tp' must be a positive"),
    ('{"stages": [{"ranks": [0], "tp": 1, "layers": [2, 1]}]}', "'layers' must be"),
])
def test_malformed_plan_files_are_refused(tmp_path, text, message):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        validate(plan_config(str(path)), 3)


def test_a_missing_plan_or_a_directory_is_named_so(tmp_path):
    with pytest.raises(ConfigError, match=r"--pipeline-plan \S+missing.json: not found$"):
        validate(plan_config(str(tmp_path / "missing.json")), 3)
    with pytest.raises(ConfigError, match="a directory, not a JSON file"):
        validate(plan_config(str(tmp_path)), 3)


def test_the_plan_sets_the_pipeline_size_when_the_flag_is_not_given(tmp_path):
    """As its stages are the pipeline, --pipeline-plan alone implies
    --pipeline-model-parallel-size; given and different, the flag is refused naming both."""
    path = plan_file(tmp_path, GOOD)
    argv = ["--model-preset", "gpt-tiny", "--num-layers", "4", "--pipeline-plan", path,
            "--untie-embeddings-and-output-weights", "--mock-data", "--train-iters", "1",
            "--micro-batch-size", "2", "--global-batch-size", "2"]
    config, _ = parse_args(argv, "gpt")
    assert config.parallel.pipeline_model_parallel_size == len(GOOD)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size=3 disagrees with "
                                          "--pipeline-plan"):
        parse_args([*argv, "--pipeline-model-parallel-size", "3"], "gpt")


@pytest.mark.parametrize("leaves, message", [
    (dict(pipeline_model_parallel_size=3), "disagrees with --pipeline-plan"),
    (dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size cannot be used"),
    (dict(pipeline_schedule="interleaved", virtual_pipeline_model_parallel_size=2),
     "interleaved"),
    (dict(batch_slices=2), "Domino"),
    (dict(stage=3), "--zero-stage"),
])
def test_what_does_not_compose_is_refused(tmp_path, leaves, message):
    with pytest.raises(ConfigError, match=message):
        validate(plan_config(plan_file(tmp_path, GOOD), **leaves), 3)


def test_micro_batch_must_hold_a_sequence_per_dp_rank(tmp_path):
    path = plan_file(tmp_path, [((0, 1), 1, (0, 2)), ((2,), 1, (2, 4))])
    validate(plan_config(path), 3)
    with pytest.raises(ConfigError, match="at least one sequence per DP rank"):
        validate(plan_config(path, micro_batch_size=1), 3)


def test_tied_embedding_across_layouts_is_refused(tmp_path):
    config = plan_config(plan_file(tmp_path, GOOD))
    config.model = config.model.replace(untie_embeddings_and_output_weights=False)
    with pytest.raises(ConfigError, match="tied embedding"):
        validate(config, 3)


def test_heads_must_divide_by_each_stage_tp(tmp_path):
    stages = [((0, 1, 2), 3, (0, 2)), ((3,), 1, (2, 4))]  # gpt-tiny's heads do not split by 3
    with pytest.raises(ConfigError):
        validate(plan_config(plan_file(tmp_path, stages)), 4)


def test_sequence_parallel_is_kept_under_a_plan():
    """--tensor-model-parallel-size stays 1 under a plan; --sequence-parallel is then not
    dropped (as it is at TP 1): the plan's TP=2 stages use it."""
    plan = os.path.join(os.path.dirname(__file__), "fixtures", "pipeline_plan_tp2_tp1.json")
    config, notices = parse_args(["--model-preset", "gpt-tiny", "--num-layers", "3",
                                  "--untie-embeddings-and-output-weights", "--mock-data",
                                  "--train-iters", "1", "--pipeline-model-parallel-size", "2",
                                  "--pipeline-plan", plan, "--sequence-parallel"], "gpt")
    assert config.parallel.sequence_parallel and notices == []
