"""megadomino.pipeline.simulate: with free transfers every schedule's predicted step and bubble
are the ideal pipeline's ((m + p - 1) (F + B), interleaved (v m + p - 1) (F + B) / v, the bubble
schedules.bubble_fraction gives); the micro-batches a stage holds are its warm-up plus one
(1F1B: p - s, eager-1F1B: 2 (p - s) - 1); ZB-H1's step is the paper's (its bubble a third of
1F1B's when F = B = W); eager-zb's is ZB-H1's over free links and no slower than ZB-H1's or
eager-1F1B's over slow ones (B at least F); a slow link costs time, a buffered link (gloo over
TCP) never more than a rendezvous (NCCL); ZBV's bubble is half ZB-H1's (F = B = W), every stage
holding 1F1B's peak; the slowest stage sets the pace; a list that
deadlocks is named, also one that only a collective boundary's posting order deadlocks."""

from __future__ import annotations

import itertools

import pytest

from megadomino.pipeline.schedules import Action, bubble_fraction, schedule
from megadomino.pipeline.simulate import run, simulate

SHAPES = [("1f1b", 2, 8, 1), ("1f1b", 4, 7, 1), ("eager-1f1b", 3, 5, 1), ("eager-1f1b", 4, 8, 1),
          ("interleaved", 2, 6, 2), ("interleaved", 4, 8, 3)]


@pytest.mark.parametrize("name,stages,micro,chunks", SHAPES)
def test_free_transfers_give_the_ideal_pipeline(name, stages, micro, chunks):
    forward, backward = 1.0, 2.0
    got = simulate(name, stages, micro, [forward] * stages, [backward] * stages, 0.0, chunks)
    bubble = bubble_fraction(stages, micro, chunks)
    assert got.step == pytest.approx(micro * (forward + backward) / (1 - bubble))
    assert got.bubble == pytest.approx((bubble,) * stages)


@pytest.mark.parametrize("name,held", [("1f1b", lambda p, s: p - s),
                                       ("eager-1f1b", lambda p, s: 2 * (p - s) - 1)])
def test_a_stage_holds_its_warm_up_plus_one(name, held):
    got = simulate(name, 4, 8, [1.0] * 4, [2.0] * 4, 0.0)
    assert got.in_flight == tuple(held(4, s) for s in range(4))


def test_a_slow_link_costs_time_and_earlier_sends_never_more():
    for name, chunks in (("1f1b", 1), ("eager-1f1b", 1), ("interleaved", 2)):
        steps = [simulate(name, 2, 8, [1.0, 1.0], [2.0, 2.0], link, chunks).step
                 for link in (0.0, 0.5, 2.0)]
        assert steps == sorted(steps) and steps[0] < steps[-1], (name, steps)
        lists = [schedule(name, 2, s, 8, chunks) for s in range(2)]
        times = ([1.0 / chunks] * 2, [2.0 / chunks] * 2)
        rendezvous = run(lists, 2, *times, 0.5).step
        handed = run(lists, 2, *times, 0.5, sends="handed").step
        buffered = run(lists, 2, *times, 0.5, sends="buffered").step
        assert buffered <= handed + 1e-12 and handed <= rendezvous + 1e-12, name


def test_the_slowest_stage_sets_the_pace():
    even = simulate("1f1b", 2, 16, [1.0, 1.0], [2.0, 2.0], 0.0).step
    slow = simulate("1f1b", 2, 16, [1.0, 2.0], [2.0, 4.0], 0.0).step
    assert slow >= 16 * 6.0 and slow > even


def test_a_deadlock_names_the_blocked_stages():
    wait_first = [[Action("F", "recv", 0), Action("F", "wait", 0, waits="recv")],
                  [Action("F", "recv", 0), Action("F", "wait", 0, waits="recv")]]
    with pytest.raises(RuntimeError, match="deadlocks: stages blocked at"):
        run(wait_first, 2, [1.0, 1.0], [1.0, 1.0], 0.0)


def test_each_chunk_may_take_its_own_time():
    """Interleaved stages with a heavier second chunk (the output layer's) take longer than
    the even split of the same total; equal chunk times give the even split's step."""
    even = simulate("interleaved", 2, 4, [2.0, 2.0], [4.0, 4.0], 0.0, chunks=2).step
    lists = [schedule("interleaved", 2, s, 4, 2) for s in range(2)]
    same = run(lists, 2, [[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2, 0.0).step
    uneven = run(lists, 2, [[1.0, 1.0], [0.5, 1.5]], [[2.0, 2.0], [1.0, 3.0]], 0.0).step
    assert same == pytest.approx(even) and uneven > even


ZB_TIMES = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0)]
"""(F, B, W) of one micro-batch: B the input-gradient part of a backward, W <= F (the
paper's case)."""


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_zb_h1_free_transfers_give_its_ideal_bubble(stages, prefetch):
    """ZB-H1, free transfers: m >= P micro-batches take m (F + B + W) + (P - 1) (F + B - W), the
    paper's bubble (P - 1) (F + B - W); with F = B = W a third of 1F1B's (P - 1) (F + B + W).
    Fewer take (m + P - 1) (F + B) + W: the last micro-batch's forwards and B's through every
    stage, then stage 0's last W. A stage holds 1F1B's P - s micro-batches before their B."""
    for micro in range(1, 12):
        for forward, backward, weight in ZB_TIMES:
            times = ([forward] * stages, [backward] * stages, 0.0)
            zb = simulate("zb-h1", stages, micro, *times, prefetch=prefetch,
                          weight=[weight] * stages)
            one = simulate("1f1b", stages, micro, *times, prefetch=prefetch,
                           weight=[weight] * stages)
            busy = micro * (forward + backward + weight)
            ideal = max(busy + (stages - 1) * (forward + backward - weight),
                        (micro + stages - 1) * (forward + backward) + weight)
            assert zb.step == pytest.approx(ideal), (micro, forward, backward, weight)
            assert one.step == pytest.approx((micro + stages - 1) * (forward + backward + weight))
            assert zb.busy == pytest.approx((busy,) * stages)
            if micro >= stages and forward == backward == weight:
                assert zb.step - busy == pytest.approx((one.step - busy) / 3)
            assert zb.in_flight == tuple(min(stages - s, micro) for s in range(stages))


def test_a_collective_boundary_moves_in_posting_order():
    """Stage 0 posts micro-batch 1's send before 0's, stage 1 waits 0 before posting 1's
    receive: point-to-point messages (matched by tag) move, a collective boundary (one
    communicator, matched by order) waits for 1 first and deadlocks."""
    lists = [[Action("F", "send", 1), Action("F", "send", 0),
              Action("F", "wait", 1, waits="send"), Action("F", "wait", 0, waits="send")],
             [Action("F", "recv", 0), Action("F", "wait", 0, waits="recv"),
              Action("F", "recv", 1), Action("F", "wait", 1, waits="recv")]]
    times = ([1.0, 1.0], [1.0, 1.0], 0.5)
    assert run(lists, 2, *times).step == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="deadlocks: stages blocked at"):
        run(lists, 2, *times, collectives={("F", 0)})


@pytest.mark.parametrize("sends", ["rendezvous", "handed"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_eager_zb_keeps_both_gains(stages, sends):
    """Eager-zb (eager-1F1B's forwards, ZB-H1's deferred W's), B at least F: ZB-H1's step over
    free links, and never slower than eager-1F1B or ZB-H1 over slow ones; strictly faster than
    both somewhere (a message as long as a forward)."""
    faster = False
    for micro, link in itertools.product(range(1, 11), (0.0, 0.2, 0.5, 1.0, 2.0)):
        for forward, backward, weight in ((1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0)):
            times = ([forward] * stages, [backward] * stages, link)
            lists = {name: [schedule(name, stages, s, micro) for s in range(stages)]
                     for name in ("eager-zb", "zb-h1", "eager-1f1b")}
            step = {name: run(each, stages, *times, sends=sends, weight=[weight] * stages).step
                    for name, each in lists.items()}
            if link == 0.0:
                assert step["eager-zb"] == pytest.approx(step["zb-h1"]), (micro, step)
            assert step["eager-zb"] <= min(step["zb-h1"], step["eager-1f1b"]) + 1e-9, step
            faster |= step["eager-zb"] < min(step["zb-h1"], step["eager-1f1b"]) - 1e-9
    assert faster


def test_links_of_different_speeds():
    """`link` per (from stage, to stage): every lane at one time is the single time; one slow
    boundary costs less than every boundary slow, and more than none."""
    stages, micro, f, b = 4, 8, [1.0] * 4, [2.0] * 4
    lanes = [(s, s + 1) for s in range(stages - 1)] + [(s + 1, s) for s in range(stages - 1)]
    for name in ("1f1b", "eager-1f1b"):
        single = simulate(name, stages, micro, f, b, 0.5).step
        assert simulate(name, stages, micro, f, b, dict.fromkeys(lanes, 0.5)).step == single
        one_slow = dict.fromkeys(lanes, 0.1) | {(1, 2): 3.0, (2, 1): 3.0}
        step = simulate(name, stages, micro, f, b, one_slow).step
        assert simulate(name, stages, micro, f, b, 0.1).step < step
        assert step < simulate(name, stages, micro, f, b, 3.0).step


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_zbv_free_transfers_give_half_zb_h1s_bubble(stages, prefetch):
    """ZBV (2 chunks a stage in a V), F = B = W = t a stage (t / 2 a chunk), free transfers,
    m >= 2 P - 1 micro-batches: the step is (3 m + (P - 1) / 2) t, half ZB-H1's bubble; every
    stage holds 2 P micro-batches of one chunk before their B (1F1B's peak, stage 0's P whole
    stages); no message crosses the V's turn (a per-lane link of only the stages' neighbours
    gives the single link's step)."""
    times = ([1.0] * stages, [1.0] * stages)
    for micro in range(2 * stages - 1, 13):
        zbv = simulate("zbv", stages, micro, *times, 0.0, 2, prefetch, weight=[1.0] * stages)
        zb = simulate("zb-h1", stages, micro, *times, 0.0, prefetch=prefetch,
                      weight=[1.0] * stages)
        assert zbv.step == pytest.approx(3 * micro + (stages - 1) / 2), micro
        assert zbv.step - 3 * micro == pytest.approx((zb.step - 3 * micro) / 2)
        assert zbv.busy == pytest.approx((3.0 * micro,) * stages)
        assert zbv.in_flight == (2 * stages,) * stages
    lanes = {(s, s + d): 0.3 for s in range(stages) for d in (-1, 1) if 0 <= s + d < stages}
    single = simulate("zbv", stages, 8, *times, 0.3, 2, weight=[1.0] * stages).step
    assert simulate("zbv", stages, 8, *times, lanes, 2, weight=[1.0] * stages).step == single
    assert single > simulate("zbv", stages, 8, *times, 0.0, 2, weight=[1.0] * stages).step
