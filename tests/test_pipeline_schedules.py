"""Pipeline plans and schedules as data (no processes): golden action tables; eager-1F1B's order
for n = 3 equals the schedule in the docstring of Alpa's `OverlapFriendlyPipeDreamSchedule`
(alpa/pipeline_parallel/schedules.py); ZB-H1's order equals torch's
ScheduleInterleavedZeroBubble's with one stage a rank (its ZB1P) and keeps 1F1B's order and
activation bound (eager-zb eager-1F1B's); every schedule runs each forward, backward (and W)
once, in dependency order, and cannot deadlock even where a send completes only once its
receive is posted, nor where every boundary is a collective one whose communicator runs its
collectives in posting order (a simulation of every rank's list), and both ends of every pair
post its messages in the same order (what NCCL, which ignores tags, matches by); the bubble
formulas; Megatron's splits and the one-line refusals of the validator and of zb-h1's split
backward."""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace

import pytest
from test_bad_files import MOCK, run

from configs import make_config
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError, ModelConfig
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.config.pipeline_split import holder, placement_of
from megadomino.config.validate import validate
from megadomino.pipeline.schedules import (
    SPLIT_BACKWARD,
    bubble_fraction,
    compute_order,
    schedule,
    table,
)
from megadomino.pipeline.simulate import message, simulate
from megadomino.pipeline.simulate import run as run_lists

GOLDEN_1F1B = """\
  0 F M0    forward
  1 F M0    send
  2 F M0    wait send
  3 F M1    forward
  4 F M1    send
  5 B M0    recv
  6 F M1    wait send
  7 B M0    wait recv
  8 B M0    backward
  9 F M2    forward
 10 F M2    send
 11 B M1    recv
 12 F M2    wait send
 13 B M1    wait recv
 14 B M1    backward
 15 B M2    recv
 16 B M2    wait recv
 17 B M2    backward
"""

# Eager-1F1B, stage 0 of 2: three forwards before the first backward, and each forward's send is
# waited only after the next forward ran (lines 4, 8, 12); each gradient's receive is posted as
# soon as the previous one was waited (lines 10, 14: prefetched), before the backward between.
GOLDEN_EAGER = """\
  0 F M0    forward
  1 F M0    send
  2 F M1    forward
  3 F M1    send
  4 F M0    wait send
  5 F M2    forward
  6 F M2    send
  7 B M0    recv
  8 F M1    wait send
  9 B M0    wait recv
 10 B M1    recv
 11 B M0    backward
 12 F M2    wait send
 13 B M1    wait recv
 14 B M2    recv
 15 B M1    backward
 16 B M2    wait recv
 17 B M2    backward
"""

# Interleaved, last stage of 2, two chunks, two micro-batches (Megatron: m = P runs every
# forward first); chunk 0's input comes from stage 0's chunk 0, chunk 1's from stage 0's chunk 1.
GOLDEN_INTERLEAVED = """\
  0 F M0 V0 recv
  1 F M0 V0 wait recv
  2 F M0 V0 forward
  3 F M0 V0 send
  4 F M1 V0 recv
  5 F M0 V0 wait send
  6 F M1 V0 wait recv
  7 F M1 V0 forward
  8 F M1 V0 send
  9 F M0 V1 recv
 10 F M1 V0 wait send
 11 F M0 V1 wait recv
 12 F M0 V1 forward
 13 F M1 V1 recv
 14 F M1 V1 wait recv
 15 F M1 V1 forward
 16 B M0 V1 backward
 17 B M0 V1 send
 18 B M0 V1 wait send
 19 B M1 V1 backward
 20 B M1 V1 send
 21 B M0 V0 recv
 22 B M1 V1 wait send
 23 B M0 V0 wait recv
 24 B M0 V0 backward
 25 B M0 V0 send
 26 B M1 V0 recv
 27 B M0 V0 wait send
 28 B M1 V0 wait recv
 29 B M1 V0 backward
 30 B M1 V0 send
 31 B M1 V0 wait send
"""


def test_golden_tables():
    # receives posted just before their compute (--no-overlap-p2p-communication)
    assert table(schedule("1f1b", 2, 0, 3, prefetch=False)) == GOLDEN_1F1B
    assert table(schedule("eager-1f1b", 2, 0, 3)) == GOLDEN_EAGER
    assert table(schedule("interleaved", 2, 1, 2, 2, prefetch=False)) == GOLDEN_INTERLEAVED


def test_eager_matches_alpa_docstring():
    """Alpa's docstring, n = 3 (clock k: (micro, stage) per mesh, F/B), read per mesh:
    mesh 0: F0 F1 F2 F3 F4 B0 F5 ..., mesh 1: F0 F1 F2 B0 F3 ..., mesh 2: F0 B0 F1 B1 F2 ..."""
    alpa = {0: "F0 F1 F2 F3 F4 B0 F5", 1: "F0 F1 F2 B0 F3", 2: "F0 B0 F1 B1 F2"}
    for stage, expected in alpa.items():
        order = [f"{p}{m}" for p, m, _ in compute_order("eager-1f1b", 3, stage, 6)]
        assert " ".join(order[:len(expected.split())]) == expected
        # min(m, 2 (n - i) - 1) forwards before the first backward
        assert order.index("B0") == min(6, 2 * (3 - stage) - 1)


@pytest.mark.parametrize("name,chunks,prefetch", [("eager-1f1b", 1, True), ("eager-1f1b", 1, False),
                                                  ("1f1b", 1, True), ("interleaved", 2, True)])
def test_receives_are_prefetched(name, chunks, prefetch):
    """Every schedule by default, and eager-1F1B always, posts each receive right after the
    previous receive of its pass was waited (a rendezvous transport moves a message only once
    its receive is posted: so the transfer overlaps the computes between); without prefetch
    1F1B posts it after the compute before its own."""
    for stages, micro in itertools.product((2, 3, 4), (1, 3, 8)):
        if name == "interleaved" and micro % stages:
            continue
        for stage in range(stages):
            actions = schedule(name, stages, stage, micro, chunks, prefetch=prefetch)
            for pass_ in "FB":
                mine = [(i, a) for i, a in enumerate(actions) if a.pass_ == pass_]
                posts = [i for i, a in mine if a.op == "recv"]
                waits = [i for i, a in mine if a.op == "wait" and a.waits == "recv"]
                assert [actions[i + 1].op for i in waits[:-1]] == ["recv"] * len(posts[1:])
                assert [actions[i].micro for i in posts] == [actions[i].micro for i in waits]
    plain = schedule("1f1b", 2, 1, 3, prefetch=False)
    assert [str(a) for a in plain[:3]] == ["F M0    recv", "F M0    wait recv", "F M0    forward"]
    assert str(schedule(name, 2, 1, 2 * chunks, chunks, prefetch=prefetch)[2]) == (
        "F M1    recv" if chunks == 1 else "F M1 V0 recv")


def test_one_f_one_b_warmup():
    for stages, micro in itertools.product((2, 3, 4), (1, 3, 8)):
        for stage in range(stages):
            order = compute_order("1f1b", stages, stage, micro)
            assert [p for p, _, _ in order].index("B") == min(stages - stage - 1, micro) + 1 \
                or micro <= stages - stage - 1


# ZB-H1, last stage of 2, three micro-batches, receives posted just before their compute: its
# W's are delayed by one B (lines 12, 18), and each W runs after its step's posts, before the
# step's waits (line 12 before 13-14): it fills the time the stage would block.
GOLDEN_ZB_H1 = """\
  0 F M0    recv
  1 F M0    wait recv
  2 F M0    forward
  3 B M0    backward
  4 B M0    send
  5 F M1    recv
  6 B M0    wait send
  7 F M1    wait recv
  8 F M1    forward
  9 B M1    backward
 10 B M1    send
 11 F M2    recv
 12 W M0    weight
 13 B M1    wait send
 14 F M2    wait recv
 15 F M2    forward
 16 B M2    backward
 17 B M2    send
 18 W M1    weight
 19 W M2    weight
 20 B M2    wait send
"""


def torch_zb1p_order(stages: int, stage: int, micro: int) -> list[tuple[str, int, int]]:
    """Torch's ScheduleInterleavedZeroBubble (the paper's ZB1P, ZB-H1 generalised to several
    stages a rank) for one stage a rank: the per-rank order its constructor computes. The
    constructor needs live pipeline stages, so its method runs on the attributes it reads."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    zero_bubble = getattr(schedules, "ScheduleInterleavedZeroBubble", None)
    if zero_bubble is None or not hasattr(zero_bubble, "_calculate_single_rank_operations"):
        pytest.skip("this torch has no ScheduleInterleavedZeroBubble order to compare with")
    rounds = max(1, micro // stages)
    attributes = SimpleNamespace(n_local_stages=1, pp_group_size=stages, _n_microbatches=micro,
                                 microbatches_per_round=micro // rounds)
    ops = zero_bubble._calculate_single_rank_operations(attributes, stage)
    ours = {"F": "F", "I": "B", "W": "W"}  # torch's I is the input-gradient backward
    return [(ours[op.computation_type.value], op.microbatch_index, 0) for op in ops
            if op is not None]


def test_zb_h1_is_torchs_zero_bubble_order():
    assert table(schedule("zb-h1", 2, 1, 3, prefetch=False)) == GOLDEN_ZB_H1
    for stages, micro in itertools.product(range(1, 6), range(1, 12)):
        for stage in range(stages):
            assert compute_order("zb-h1", stages, stage, micro) == torch_zb1p_order(
                stages, stage, micro), (stages, stage, micro)


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("name,base,held", [
    ("zb-h1", "1f1b", lambda p, s: p - s),
    ("eager-zb", "eager-1f1b", lambda p, s: 2 * (p - s) - 1)])
def test_deferred_weights_keep_the_order_and_memory(name, base, held, stages):
    """The paper's ZB-H1 (and eager-zb): 1F1B's (eager-1F1B's) forwards and B's in its order,
    every W after its B, in the B's order, all of them in the step; at most min(P - s, m)
    micro-batches whose B has not run on stage s (1F1B's count; eager-zb: eager-1F1B's
    2 (P - s) - 1) and s more whose W has not run: min(P, m) on every stage under ZB-H1 (1F1B's
    peak, stage 0's)."""
    for micro, stage in itertools.product(range(1, 10), range(stages)):
        order = compute_order(name, stages, stage, micro)
        assert [c for c in order if c[0] != "W"] == compute_order(base, stages, stage, micro)
        assert [m for p, m, _ in order if p == "W"] == list(range(micro))
        for m in range(micro):
            assert order.index(("B", m, 0)) < order.index(("W", m, 0))
        before_b = before_w = peak_b = peak_w = 0
        for pass_, _, _ in order:
            before_b += {"F": 1, "B": -1}.get(pass_, 0)
            before_w += {"F": 1, "W": -1}.get(pass_, 0)
            peak_b, peak_w = max(peak_b, before_b), max(peak_w, before_w)
        bound = held(stages, stage)
        assert (peak_b, peak_w) == (min(bound, micro), min(bound + stage, micro))


def test_zb_h1_refuses_what_its_split_backward_cannot_defer():
    """--pipeline-schedule zb-h1 is one `error:` line, exit status 2, before any process group,
    with what tp/wgrad.py's split cannot defer (Domino, --tp-comm-overlap) and with virtual
    stages; accepted otherwise."""
    base = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "1", "--num-layers",
            "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]
    assert parse_args(base, "gpt")[0].parallel.pipeline_schedule == "zb-h1"
    refused = {("--domino-batch-slices", "2"): "--domino-batch-slices is off with "
               "--pipeline-schedule zb-h1",
               ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                "--tp-comm-overlap"): "--tp-comm-overlap is off with --pipeline-schedule zb-h1",
               ("--virtual-pipeline-model-parallel-size", "2"): "--pipeline-schedule=zb-h1 is "
               "invalid: it must be 'interleaved' or 'zbv' with virtual stages"}
    for extra, said in refused.items():
        with pytest.raises(ConfigError, match=re.escape(said)) as error:
            parse_args([*base, *extra], "gpt")
        assert "\n" not in str(error.value)
    code, errors = run([*MOCK, "--num-layers", "2", "--pipeline-model-parallel-size", "2",
                        "--pipeline-schedule", "zb-h1", "--domino-batch-slices", "2"])
    assert code == 2 and len(errors) == 1 and "--pipeline-schedule zb-h1" in errors[0], errors


CASES = [(name, stages, micro, chunks)
         for name, chunks in (("1f1b", 1), ("eager-1f1b", 1), ("interleaved", 2),
                              ("interleaved", 3), ("zb-h1", 1), ("eager-zb", 1), ("zbv", 2))
         for stages in (2, 3, 4) for micro in range(1, 9)
         if name != "interleaved" or micro % stages == 0]


def channels(name: str, stages: int, micro: int, chunks: int, prefetch: bool = True) -> dict:
    """Per (sender, receiver, direction): the messages in the order the sender posts its sends
    and in the order the receiver posts its receives."""
    out: dict = {}
    placement = placement_of(name)
    for s in range(stages):
        for action in schedule(name, stages, s, micro, chunks, prefetch):
            if action.op not in ("send", "recv"):
                continue
            key = message(stages, s, action, placement)  # (pass, boundary, micro-batch)
            toward_next = (action.pass_ == "F") == (action.op == "send")
            peer = holder(key[1] + 1 if toward_next else key[1], stages, placement)[0]
            assert peer != s
            pair = (s, peer) if action.op == "send" else (peer, s)
            out.setdefault((*pair, action.pass_, action.op), []).append(key)
    return out


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("name,stages,micro,chunks", CASES)
def test_every_schedule_runs_to_the_end(name, stages, micro, chunks, prefetch):
    # every rank's list with rendezvous sends (a message moves once both ends posted it):
    # simulate raises naming the blocked stages when they deadlock
    simulate(name, stages, micro, [0.0] * stages, [0.0] * stages, 0.0, chunks, prefetch)
    # every boundary a collective one (--pipeline-reshard broadcast or scatter-gather): each
    # moves once both ends posted it, one at a time per boundary and pass, in posting order
    boundaries = {(p, b) for p in "FB" for b in range(stages * chunks)}
    simulate(name, stages, micro, [1.0] * stages, [2.0] * stages, 0.5, chunks, prefetch,
             collectives=boundaries)
    simulate(name, stages, micro, [1.0] * stages, [2.0] * stages, 0.5, chunks, prefetch,
             weight=[1.5] * stages)
    # Backends that ignore tags (NCCL) match a pair's messages in posting order: the same order
    # on both ends.
    posted = channels(name, stages, micro, chunks, prefetch)
    for (src, dst, pass_, op), keys in posted.items():
        if op == "send":
            assert keys == posted[(src, dst, pass_, "recv")], (src, dst, pass_)
    for stage in range(stages):
        actions = schedule(name, stages, stage, micro, chunks, prefetch)
        computes = [(a.pass_, a.micro, a.chunk or 0) for a in actions
                    if a.op in ("forward", "backward", "weight")]
        passes = "FBW" if name in SPLIT_BACKWARD else "FB"
        expected = {(p, m, v) for p in passes for m in range(micro) for v in range(chunks)}
        assert sorted(computes) == sorted(expected)
        for m, v in itertools.product(range(micro), range(chunks)):
            assert computes.index(("F", m, v)) < computes.index(("B", m, v))
            if name in SPLIT_BACKWARD:
                assert computes.index(("B", m, v)) < computes.index(("W", m, v))
        posted = [(a.pass_, a.op, a.micro, a.chunk) for a in actions if a.op in ("send", "recv")]
        waited = [(a.pass_, a.waits, a.micro, a.chunk) for a in actions if a.op == "wait"]
        assert sorted(posted) == sorted(waited) and len(set(posted)) == len(posted)


def test_bubble():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 5) == 0.0


def test_plans():
    plan = uniform_plan(7, 4, 2, 2, first=4)
    assert [s.layers for s in plan.stages] == [((0, 4),), ((4, 7),)]
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    assert not plan.uniform and plan.same_layout
    plan = uniform_plan(8, 2, 1, 2, chunks=2)
    assert [s.layers for s in plan.stages] == [((0, 2), (4, 6)), ((2, 4), (6, 8))]
    assert plan.uniform and plan.chunks == 2
    assert [s.layers for s in uniform_plan(5, 4, 1, 4, last=2).stages] == [
        ((0, 1),), ((1, 2),), ((2, 3),), ((3, 5),)]
    assert plan.table().startswith("stage 0: ranks [0] tp 1 layers [0, 2) [4, 6)")


def _refusal(**leaves) -> str:
    model = ModelConfig.preset("gpt-tiny", num_layers=leaves.pop("num_layers", 8))
    world = leaves.pop("world", 4)
    with pytest.raises(ConfigError) as error:
        validate(make_config(model, micro_batch_size=1, mock_data=True,
                             **{"train_iters": 1, **leaves}), world)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_validator_refusals():
    assert "--pipeline-model-parallel-size" in _refusal(pipeline_model_parallel_size=3)
    assert "--decoder-first-pipeline-num-layers" in _refusal(
        pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=8)
    assert "--pipeline-schedule" in _refusal(pipeline_model_parallel_size=2,
                                             pipeline_schedule="interleaved")
    assert "--pipeline-schedule" in _refusal(pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=2)
    assert "--global-batch-size" in _refusal(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
        pipeline_schedule="interleaved", global_batch_size=3, world=2)
    assert "--zero-stage" in _refusal(pipeline_model_parallel_size=2, stage=3, world=4)
    assert "--num-layers-per-virtual-pipeline-stage" in _refusal(
        pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3)


@pytest.mark.parametrize("leaves, flag", [
    (dict(rampup_batch_size=[1, 1, 8], train_iters=None, train_samples=64, world=2,
          global_batch_size=8, virtual_pipeline_model_parallel_size=2,
          pipeline_schedule="interleaved"), "--rampup-batch-size"),
])
def test_features_not_composed_with_stages_are_refused(leaves, flag):
    """What the pipeline runtime does not run yet (or not with these values: the interleaved
    schedule's ramp-up steps must hold whole groups of micro-batches) is one line naming the
    flag, before anything starts."""
    assert flag in _refusal(pipeline_model_parallel_size=2, **leaves)


def test_validator_accepts_uneven_and_interleaved():
    model = ModelConfig.preset("gpt-tiny", num_layers=7)
    validate(make_config(model, micro_batch_size=1, train_iters=1, mock_data=True,
                         pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=4),
             2)
    model = ModelConfig.preset("gpt-tiny", num_layers=8)
    validate(make_config(model, micro_batch_size=1, global_batch_size=4, train_iters=1,
                         mock_data=True, pipeline_model_parallel_size=2,
                         num_layers_per_virtual_pipeline_stage=2,
                         pipeline_schedule="interleaved"), 2)
    for leaves in (dict(calculate_per_token_loss=True), dict(decoupled_lr=1e-3),
                   dict(ckpt_format="torch_dist", save="/tmp"),
                   dict(overlap_param_gather=True, stage=1, world=4),
                   dict(rampup_batch_size=[4, 4, 8], train_iters=None, train_samples=64,
                        global_batch_size=8, virtual_pipeline_model_parallel_size=2,
                        pipeline_schedule="interleaved")):
        world = leaves.pop("world", 2)
        validate(make_config(model, micro_batch_size=1, mock_data=True,
                             pipeline_model_parallel_size=2, **{"train_iters": 1, **leaves}),
                 world)


@pytest.mark.parametrize("name,stages,micro,chunks", CASES)
def test_loading_lists_compute_alike_with_nothing_in_flight(name, stages, micro, chunks):
    """A step that may launch a kernel for the first time (`loading`): the schedule's computes
    in its order, no message posted and not yet waited on the rank at any compute (CUDA's
    first launch waits for the rank's queued work, a posted message included), every message
    posted once and waited, and the lists run to the end with rendezvous sends and with
    collective boundaries."""
    lists = [schedule(name, stages, s, micro, chunks, loading=True) for s in range(stages)]
    for s, actions in enumerate(lists):
        def computes(acts):
            return [(a.pass_, a.op, a.micro, a.chunk) for a in acts
                    if a.op in ("forward", "backward", "weight")]
        mine, own = computes(actions), computes(schedule(name, stages, s, micro, chunks))
        if name == "zbv":  # its loading order: one micro-batch after the other (one_at_a_time)
            mine, own = sorted(mine, key=str), sorted(own, key=str)
        assert mine == own
        in_flight: set = set()
        for a in actions:
            if a.op in ("send", "recv"):
                in_flight.add((a.pass_, a.op, a.micro, a.chunk))
            elif a.op == "wait":
                in_flight.remove((a.pass_, a.waits, a.micro, a.chunk))
            else:
                assert not in_flight, (s, str(a), in_flight)
        assert not in_flight
    placement = placement_of(name)
    run_lists(lists, stages, [1.0] * stages, [2.0] * stages, 0.5, placement=placement)
    boundaries = {(p, b) for p in "FB" for b in range(stages * chunks)}
    run_lists(lists, stages, [1.0] * stages, [2.0] * stages, 0.5, collectives=boundaries,
              placement=placement)
