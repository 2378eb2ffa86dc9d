"""The plain pipeline transport under NCCL's ordering rule (no processes): a communicator runs
its operations one after the other, in posting order, and matches a send with a receive by that
order alone (tags are ignored). Every schedule's action lists run on a model of it: each channel
(transport_p2p.channel's (pass, boundary)) a FIFO on both ends; an operation at the head of a
sender's channel moves once the receiver's same channel has its receive at the head. Every
schedule, prefetched or not, runs to the end there and both ends name the same message at every
match. The same model with one FIFO for every message between two stages (one pipeline
communicator, the transport before its channels) hangs prefetched 1F1B, interleaved and ZB-H1:
what 2 and 4 GPUs did, so the model sees the hang."""

from __future__ import annotations

import pytest

from megadomino.config.pipeline_split import holder, placement_of
from megadomino.pipeline.schedules import schedule
from megadomino.pipeline.simulate import message
from megadomino.pipeline.transport_p2p import channel

CASES = [(name, chunks, stages, micro)
         for name, chunks in (("1f1b", 1), ("eager-1f1b", 1), ("zb-h1", 1), ("eager-zb", 1),
                              ("interleaved", 2), ("interleaved", 3), ("zbv", 2))
         for stages in (2, 3, 4, 5)
         for micro in (stages, 2 * stages, 3 * stages, 4 * stages + (chunks == 1))]


def _programs(name: str, stages: int, micro: int, chunks: int, prefetch: bool, shared: bool):
    """Each stage's posts (queue, message) and waits; `shared`: one queue per pair of stages."""
    programs = []
    for stage in range(stages):
        program = []
        for action in schedule(name, stages, stage, micro, chunks, prefetch=prefetch):
            if action.op in ("send", "recv"):
                pass_, boundary = channel(action.pass_, action.op == "send", stage, stages,
                                          action.chunk or 0, placement_of(name))
                queue = ("pair", boundary) if shared else (pass_, boundary)
                program.append(("post", queue, action))
            elif action.op == "wait":
                program.append(("wait", (action.waits, action.pass_, action.micro, action.chunk)))
        programs.append(program)
    return programs


def _peer(action, stage: int, stages: int, placement: str) -> int:
    """The stage at the other end of the boundary the action's message crosses."""
    _, boundary, _ = message(stages, stage, action, placement)
    up = (action.pass_ == "F") == (action.op == "send")
    return holder(boundary + 1 if up else boundary, stages, placement)[0]


def run_fifo(name: str, stages: int, micro: int, chunks: int, prefetch: bool,
             shared: bool = False) -> bool:
    """True when every stage reaches the end of its list; asserts both ends of every match
    name one message."""
    programs = _programs(name, stages, micro, chunks, prefetch, shared)
    placement = placement_of(name)
    at = [0] * stages
    queues: list[dict] = [{} for _ in range(stages)]
    done: list[set] = [set() for _ in range(stages)]
    moved = True
    while moved:
        moved = False
        for stage, program in enumerate(programs):
            while at[stage] < len(program):
                kind, what, *action = program[at[stage]]
                if kind == "post":
                    queues[stage].setdefault(what, []).append(action[0])
                elif what not in done[stage]:
                    break
                at[stage] += 1
                moved = True
        for stage in range(stages):
            for queue, posted in queues[stage].items():
                if not posted or posted[0].op != "send":
                    continue
                peer = _peer(posted[0], stage, stages, placement)
                other = queues[peer].get(queue, [])
                if (not other or other[0].op != "recv"
                        or _peer(other[0], peer, stages, placement) != stage):
                    continue
                send, receive = posted.pop(0), other.pop(0)
                assert (message(stages, stage, send, placement)
                        == message(stages, peer, receive, placement)), (queue, send, receive)
                done[stage].add(("send", send.pass_, send.micro, send.chunk))
                done[peer].add(("recv", receive.pass_, receive.micro, receive.chunk))
                moved = True
    return all(at[s] == len(programs[s]) for s in range(stages))


@pytest.mark.parametrize("prefetch", [True, False])
def test_every_schedule_runs_on_fifo_channels(prefetch):
    stuck = [case for case in CASES if not run_fifo(*case[:1], case[2], case[3], case[1],
                                                    prefetch)]
    assert not stuck, f"hangs on NCCL-ordered channels: {stuck}"


def test_one_communicator_per_pair_hangs_prefetched_schedules():
    for name, chunks in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
        assert not run_fifo(name, 2, 8, chunks, prefetch=True, shared=True), name
        assert not run_fifo(name, 4, 8, chunks, prefetch=True, shared=True), name


def test_channels_name_the_boundary_a_message_crosses():
    assert channel("F", True, 1, 4) == ("F", 1)    # stage 1 -> 2
    assert channel("F", False, 1, 4) == ("F", 0)   # stage 0 -> 1
    assert channel("B", True, 1, 4) == ("B", 0)    # stage 1 -> 0
    assert channel("B", False, 1, 4) == ("B", 1)   # stage 2 -> 1
    assert channel("F", True, 3, 4) == ("F", 3)    # wrap-around: last -> first
    assert channel("F", False, 0, 4) == ("F", 3)
    # ZBV's V over 4 stages: chunk 0 of stage s is virtual stage s, chunk 1 virtual 7 - s; each
    # virtual boundary between two stages is its own channel, one direction
    assert channel("F", True, 1, 4, 0, "v") == ("F", 1)   # virtual 1 -> 2: stage 1 -> 2
    assert channel("F", True, 1, 4, 1, "v") == ("F", 6)   # virtual 6 -> 7: stage 1 -> 0
    assert channel("F", False, 1, 4, 1, "v") == ("F", 5)  # virtual 5 -> 6: stage 2 -> 1
    assert channel("B", True, 0, 4, 1, "v") == ("B", 6)   # virtual 7 -> 6: stage 0 -> 1
