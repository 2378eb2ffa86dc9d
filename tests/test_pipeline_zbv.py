"""ZBV, the V-shaped zero-bubble schedule (no processes): the V placement of the chunks (stage s
holds virtual stages s and 2 P - 1 - s) in the plan, the layer split and the transport's
channels; its order equals torch's ScheduleZBVZeroBubble's; the last stage hands its chunk 0's
output to its chunk 1 without a transfer and stage 0 computes the loss; it holds at most 2 P
micro-batches of one chunk before their B on every stage; its late send waits leave at most one
send a channel unwaited while the rank computes; its loading list and its evaluation order run
to the end with every send waited at once; what it cannot run with is one line. That every
schedule (ZBV included) runs to the end under rendezvous and collective transfers, and on
NCCL-ordered channels, is tests/test_pipeline_schedules.py's and test_pipeline_channels.py's;
its step, tests/test_pipeline_simulate.py's; its gradients, tests/test_pipeline_equivalence.py's.
"""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace

import pytest

from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.config.pipeline_split import holder, virtual_stage
from megadomino.pipeline.schedules import compute_order, schedule, table, with_transfers
from megadomino.pipeline.simulate import run

# ZBV, last stage of 2, three micro-batches, receives posted just before their compute: chunk 0's
# forward feeds chunk 1's on the rank (lines 2-3: no transfer), chunk 1's B feeds chunk 0's
# (13, 18); a send is waited once the next send of its pass and chunk is posted (line 11 after
# 9), the last ones at the end.
GOLDEN_ZBV = """\
  0 F M0 V0 recv
  1 F M0 V0 wait recv
  2 F M0 V0 forward
  3 F M0 V1 forward
  4 F M0 V1 send
  5 F M1 V0 recv
  6 F M1 V0 wait recv
  7 F M1 V0 forward
  8 F M1 V1 forward
  9 F M1 V1 send
 10 B M0 V1 recv
 11 F M0 V1 wait send
 12 B M0 V1 wait recv
 13 B M0 V1 backward
 14 F M2 V0 recv
 15 W M0 V1 weight
 16 F M2 V0 wait recv
 17 F M2 V0 forward
 18 B M0 V0 backward
 19 B M0 V0 send
 20 W M0 V0 weight
 21 F M2 V1 forward
 22 F M2 V1 send
 23 B M1 V1 recv
 24 F M1 V1 wait send
 25 B M1 V1 wait recv
 26 B M1 V1 backward
 27 W M1 V1 weight
 28 B M1 V0 backward
 29 B M1 V0 send
 30 B M2 V1 recv
 31 B M0 V0 wait send
 32 B M2 V1 wait recv
 33 B M2 V1 backward
 34 B M2 V0 backward
 35 B M2 V0 send
 36 W M1 V0 weight
 37 W M2 V1 weight
 38 W M2 V0 weight
 39 B M1 V0 wait send
 40 F M2 V1 wait send
 41 B M2 V0 wait send
"""


def torch_zbv_order(stages: int, stage: int, micro: int) -> list[tuple[str, int, int]]:
    """Torch's ScheduleZBVZeroBubble: the per-rank order its constructor computes, as (pass,
    micro-batch, chunk), chunk 0 being the rank's stage `stage` and chunk 1 its 2 P - 1 - stage.
    The constructor needs live pipeline stages, so its method runs on the attributes it
    reads."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    zbv = getattr(schedules, "ScheduleZBVZeroBubble", None)
    if zbv is None or not hasattr(zbv, "_calculate_single_rank_operations"):
        pytest.skip("this torch has no ScheduleZBVZeroBubble order to compare with")
    attributes = SimpleNamespace(pp_group_size=stages, _n_microbatches=micro,
                                 num_stages=2 * stages)
    ops = zbv._calculate_single_rank_operations(attributes, stage)
    ours = {"F": "F", "I": "B", "W": "W"}  # torch's I is the input-gradient backward
    return [(ours[op.computation_type.value], op.microbatch_index,
             0 if op.stage_index == stage else 1) for op in ops if op is not None]


def test_zbv_is_torchs_order():
    assert table(schedule("zbv", 2, 1, 3, 2, prefetch=False)) == GOLDEN_ZBV
    for stages, micro in itertools.product(range(1, 6), range(1, 13)):
        for stage in range(stages):
            assert compute_order("zbv", stages, stage, micro, 2) == torch_zbv_order(
                stages, stage, micro), (stages, stage, micro)


def test_the_v_placement():
    """Stage s holds virtual stages s and 2 P - 1 - s: the plan's layers, its last stage (the
    loss's: stage 0), and virtual_stage / holder inverse to each other."""
    plan = uniform_plan(8, 2, 1, 2, chunks=2, placement="v")
    assert [s.layers for s in plan.stages] == [((0, 2), (6, 8)), ((2, 4), (4, 6))]
    assert plan.last_stage == 0 and uniform_plan(8, 2, 1, 2, chunks=2).last_stage == 1
    for stages, placement in itertools.product((1, 2, 3, 4), ("loop", "v")):
        for stage, chunk in itertools.product(range(stages), range(2)):
            virtual = virtual_stage(stage, chunk, stages, placement)
            assert holder(virtual, stages, placement) == (stage, chunk)
        assert sorted(virtual_stage(s, v, stages, "v") for s in range(stages)
                      for v in range(2)) == list(range(2 * stages))


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_zbv_hands_over_on_the_last_stage_and_keeps_1f1bs_peak(stages):
    """No transfer across the V's turn (the last stage's chunk 0 to its chunk 1, and back) nor
    into stage 0's chunk 1's backward (the loss); every W after its B; at most 2 P micro-batches
    of one chunk whose B has not run, on every stage (2 m with fewer)."""
    for micro, stage in itertools.product(range(1, 12), range(stages)):
        actions = schedule("zbv", stages, stage, micro, 2)
        moved = {(a.pass_, a.chunk) for a in actions if a.op in ("send", "recv")}
        if stage == stages - 1:
            assert ("F", 0) not in {(a.pass_, a.chunk) for a in actions if a.op == "send"}
            assert ("F", 1) not in {(a.pass_, a.chunk) for a in actions if a.op == "recv"}
            assert ("B", 0) not in {(a.pass_, a.chunk) for a in actions if a.op == "recv"}
        if stage == 0:
            assert ("F", 0) not in {(a.pass_, a.chunk) for a in actions if a.op == "recv"}
            assert ("B", 1) not in {(a.pass_, a.chunk) for a in actions if a.op == "recv"}
        assert moved, (stage, micro)
        order = compute_order("zbv", stages, stage, micro, 2)
        for m, chunk in itertools.product(range(micro), range(2)):
            assert order.index(("B", m, chunk)) < order.index(("W", m, chunk))
        held = peak = 0
        for pass_, _, _ in order:
            held += {"F": 1, "B": -1}.get(pass_, 0)
            peak = max(peak, held)
        assert peak <= min(2 * stages, 2 * micro), (stage, micro, peak)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_late_sends_leave_one_send_a_channel(stages):
    """At every forward and backward at most one send of each (pass, chunk) is posted and not
    waited (a step's W's run after its posts, before its waits, so they may see two); every
    send is waited."""
    for micro, stage in itertools.product(range(1, 10), range(stages)):
        unwaited: dict = {}
        for action in schedule("zbv", stages, stage, micro, 2):
            key = (action.pass_, action.chunk)
            if action.op == "send":
                unwaited.setdefault(key, []).append(action.micro)
            elif action.op == "wait" and action.waits == "send":
                unwaited[key].remove(action.micro)
            elif action.op in ("forward", "backward"):
                assert all(len(sent) <= 1 for sent in unwaited.values()), (stage, action)
        assert not any(unwaited.values())


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_forward_only_order_runs_with_sends_waited_at_once(stages):
    """The runtime's evaluation under the V (chunk 0's forwards, then chunk 1's, every send
    waited at once) runs to the end with rendezvous transfers."""
    for micro in range(1, 9):
        lists = [with_transfers([[("F", m, v)] for v in range(2) for m in range(micro)], stages,
                                s, 2, placement="v") for s in range(stages)]
        run(lists, stages, [1.0] * stages, [0.0] * stages, 0.5, placement="v")


def test_zbv_refuses_what_it_cannot_run_with():
    """One line each: exactly 2 chunks a stage (none, 3), no --pipeline-codec, an even split,
    the split backward's refusals; accepted with 2 chunks, and at PP 1 (one stage runs no
    schedule)."""
    base = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "1", "--num-layers",
            "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"]
    two = ["--virtual-pipeline-model-parallel-size", "2"]
    assert parse_args([*base, *two], "gpt")[0].parallel.pipeline_schedule == "zbv"
    parse_args([*base[:-4], "--pipeline-schedule", "zbv"], "gpt")
    chunks = "--pipeline-schedule=zbv is invalid: it must be run with exactly 2 model chunks"
    refused = {(): chunks, ("--virtual-pipeline-model-parallel-size", "4"): chunks,
               (*two, "--pipeline-codec", "int8"): chunks,
               (*two, "--decoder-first-pipeline-num-layers", "2"): "virtual stages need a "
               "uniform plan",
               (*two, "--num-layers", "6"): "--num-layers=6 is invalid with a virtual pipeline",
               (*two, "--domino-batch-slices", "2"): "--domino-batch-slices is off with "
               "--pipeline-schedule zbv"}
    for extra, said in refused.items():
        with pytest.raises(ConfigError, match=re.escape(said)) as error:
            parse_args([*base, *extra], "gpt")
        assert "\n" not in str(error.value)
