"""`--pipeline-schedule auto` (pipeline/schedule_auto.py). Given fixed times, the pick is the
simulator's fastest: ZB-H1 over free links (F = B-input = W), eager-zb over a slow link (a
message as long as a forward; eager-1F1B where the split backward is refused, as with Domino),
1F1B when the split backward costs more than it saves, the interleaved schedule with virtual
stages; ties go to the earlier candidate (less memory: 1F1B before eager-1F1B, ZB-H1 before
eager-zb); the start-up line names the choice and every prediction; a stage's time is its
slowest rank's.
With processes (gloo): every rank of PP2 x DP2 (two pipeline columns timing apart) and PP4
resolves the same schedule, the stages' gradients then equal the model without PP (1e-5, also
tests/test_pipeline_equivalence.py's auto cases) and the pass leaves the weights, the RNG
streams and no gradients; through the training loop, auto's losses and grad norms are bit for
bit the chosen schedule's run. Refused with --pipeline-plan auto, as one line."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from test_pipeline_equivalence import check_pipeline
from test_tp_equivalence import tiny_config

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.build import build_stage
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError, DominoPlan, ModelConfig, ParallelConfig
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.config.validate import validate
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.pipeline.runtime import PipelineRuntime
from megadomino.pipeline.schedule_auto import Profile, candidates, pick, predict, stage_profile
from megadomino.pipeline.simulate import simulate
from megadomino.train.loop import train


def profile(stages: int, forward: float, backward: float, input_grad: float, weight: float,
            link: float, chunks: int = 1) -> Profile:
    def each(seconds: float) -> tuple[tuple[float, ...], ...]:
        return ((seconds / chunks,) * chunks,) * stages
    return Profile(each(forward), each(backward), each(input_grad), each(weight), link)


ALL = ("1f1b", "eager-1f1b", "zb-h1", "eager-zb")


def test_free_links_pick_zb_h1_and_predict_as_the_simulator():
    times = profile(4, 1.0, 2.0, 1.0, 1.0, 0.0)
    choice = pick(ALL, times, 8, True, "rendezvous")
    assert choice.name == "zb-h1" and choice.steps[3] == choice.steps[2]  # ties to less memory
    assert choice.steps[0] == pytest.approx(simulate("1f1b", 4, 8, [1.0] * 4, [2.0] * 4, 0.0).step)
    assert choice.steps[2] == pytest.approx(simulate("zb-h1", 4, 8, [1.0] * 4, [1.0] * 4, 0.0,
                                                     weight=[1.0] * 4).step)
    # 1F1B and eager-1F1B tie over free links: the earlier (less memory) wins
    tie = pick(ALL[:2], times, 8, True, "rendezvous")
    assert tie.steps[0] == tie.steps[1] and tie.name == "1f1b"


@pytest.mark.parametrize("sends", ["rendezvous", "handed"])
def test_a_slow_link_picks_an_eager_schedule(sends):
    """A message as long as a forward: eager-zb, or without a split backward eager-1F1B."""
    times = profile(4, 1.0, 1.5, 1.0, 0.5, 1.0)
    assert pick(ALL, times, 8, True, sends).name == "eager-zb"
    assert pick(ALL[:2], times, 8, True, sends).name == "eager-1f1b"


def test_a_split_that_costs_more_than_it_saves_keeps_1f1b():
    """B-input + W twice the whole backward (a split that recomputes): ZB-H1 is slower."""
    choice = pick(ALL, profile(2, 1.0, 2.0, 2.0, 2.0, 0.0), 4, True, "rendezvous")
    assert choice.name == "1f1b" and min(choice.steps[2:]) > choice.steps[0]


def test_the_line_names_the_choice_and_every_prediction():
    choice = pick(ALL, profile(2, 0.001, 0.002, 0.001, 0.001, 0.0), 4, True, "handed")
    line = choice.line()
    assert line.startswith("pipeline schedule auto: chose zb-h1, predicted ")
    for name, step in zip(choice.names, choice.steps, strict=True):
        assert f"{name} {step * 1e3:.1f} ms" in line
    assert "(chosen)" in line and "F/B/B-input/W ms per micro-batch: stage 0 1.00/2.00/1.00/1.00" \
        in line and "\n" not in line


def test_candidates():
    plain = ParallelConfig(pipeline_model_parallel_size=2)
    assert candidates(plain, 1, 1) == ALL
    assert candidates(plain, 2, 1) == ("interleaved",)
    domino = ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                            domino=DominoPlan(batch_slices=2))
    assert candidates(domino, 1, 2) == ALL[:2]
    # the interleaved schedule's prediction runs each chunk's time
    assert predict("interleaved", profile(2, 2.0, 4.0, 2.0, 2.0, 0.0, chunks=2), 4, True,
                   "rendezvous") == pytest.approx(
        simulate("interleaved", 2, 4, [2.0] * 2, [4.0] * 2, 0.0, chunks=2).step)


def test_a_stage_takes_its_slowest_rank():
    rows = [[0, 0.1, 1.0, 2.0], [1, 0.3, 1.5, 2.5], [0, 0.2, 3.0, 1.0], [1, 0.1, 1.0, 3.0]]
    got = stage_profile(rows, 2, 1, split=False)
    assert got == Profile(((3.0,), (1.5,)), ((2.0,), (3.0,)), None, None, 0.3)


def test_refusals_and_acceptance():
    base = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "1", "--num-layers",
            "4", "--pipeline-schedule", "auto"]
    with pytest.raises(ConfigError, match=re.escape("--pipeline-schedule auto cannot be used "
                                                    "with --pipeline-plan auto")) as error:
        parse_args([*base, "--pipeline-plan", "auto", "--micro-batch-size", "2"], "gpt")
    assert "\n" not in str(error.value)
    config = parse_args([*base, "--pipeline-model-parallel-size", "2",
                         "--domino-batch-slices", "2"], "gpt")[0]
    assert config.parallel.pipeline_schedule == "auto"  # zb-h1 left out, not refused
    model = ModelConfig.preset("gpt-tiny", num_layers=8)
    virtual = dict(micro_batch_size=1, train_iters=1, mock_data=True,
                   pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                   pipeline_schedule="auto")
    validate(make_config(model, global_batch_size=4, **virtual), 2)
    with pytest.raises(ConfigError, match="--global-batch-size"):  # interleaved's groups
        validate(make_config(model, global_batch_size=3, **virtual), 2)


def resolves_alike(family: str, dims, dims_ref, micro: int, schedule: str = "auto") -> None:
    """Every rank resolves the same schedule, and the pass leaves the stage as it found it
    (weights, RNG streams, no gradients); then the pipeline equals the model without PP.
    Another `schedule`: building the runtime leaves it alike."""
    config = tiny_config(family, num_layers=5, vocab_size=331)
    first = {2: 3, 4: 2}[dims.pp]  # 5 layers
    plan = uniform_plan(5, dims.world_size, dims.tp, dims.pp, first=first)
    parallel = ParallelConfig(pipeline_model_parallel_size=dims.pp)
    model_parallel_seed(11, dims)
    stage = build_stage(config, dims, plan, family, "cpu", parallel=parallel)
    weights = [p.detach().clone() for p in stage.parameters()]
    rng, tracker = torch.get_rng_state(), dims.rng.get_states()
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    runtime = PipelineRuntime(stage, plan, dims, config, parallel, schedule, 3, micro)
    names = [None] * dims.world_size
    dist.all_gather_object(names, runtime.schedule_name)
    assert len(set(names)) == 1 and names[0] in ALL, names
    assert (runtime.auto is not None) == (dims.rank == 0 and schedule == "auto")
    assert all(torch.equal(a, b) for a, b in zip(weights, stage.parameters(), strict=True))
    assert all(p.grad is None for p in stage.parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert cuda_rng is None or torch.equal(cuda_rng, torch.cuda.get_rng_state())
    assert all(torch.equal(state, dims.rng.get_states()[name]) for name, state in tracker.items())
    check_pipeline(family, dims, dims_ref, schedule, 5, micro, first=first)


def trains_as_its_choice(family: str, dims) -> None:
    """Through the loop: auto's run is bit for bit the run of the schedule it chose."""
    def run(schedule: str, log) -> dict:
        config = make_config(tiny_config(family, num_layers=5, vocab_size=331),
                             pipeline_model_parallel_size=dims.pp, micro_batch_size=2,
                             global_batch_size=8, train_iters=6, lr=3e-3, clip_grad=0.5,
                             log_interval=3, eval_iters=0, mock_data=True,
                             decoder_first_pipeline_num_layers=3, pipeline_schedule=schedule)
        return train(config, dims, family, log=log)
    lines: list[str] = []
    auto = run("auto", lines.append)
    chosen = [line.split("chose ")[1].split(",")[0] for line in lines
              if "pipeline schedule auto: chose" in line]
    box = [chosen[0] if dims.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] in ALL, lines
    plain = run(box[0], lambda line: None)
    assert auto["losses"] == plain["losses"] and auto["grad_norms"] == plain["grad_norms"]


SUITE = DistSuite(worlds=(2, 4), timeout=300.0)


@SUITE.setup
def _setup(world: int) -> dict:
    if world == 2:
        return {"ref": ParallelDims(tp=1), "pp2": ParallelDims(pp=2)}
    return {"ref": ParallelDims(tp=1), "pp2dp2": ParallelDims(pp=2), "pp4": ParallelDims(pp=4)}


SUITE.case("gpt-pp2dp2-resolves-alike", resolves_alike, "gpt", C.pp2dp2, C.ref, 4,
           worlds=(4,))
SUITE.case("llama-pp4-resolves-alike", resolves_alike, "llama", C.pp4, C.ref, 6, worlds=(4,))
SUITE.case("gpt-pp2-zb-h1-start-up-leaves-the-stage", resolves_alike, "gpt", C.pp2, C.ref, 4,
           "zb-h1", worlds=(2,))
SUITE.case("gpt-pp2-trains-as-its-choice", trains_as_its_choice, "gpt", C.pp2, worlds=(2,))

test_auto_resolves_alike_and_trains_as_its_choice = SUITE.test()
