"""A pipeline simulator: every stage's action list (schedules.schedule) run against a clock, with
given compute times and link times, predicting a step's time, each stage's bubble and the
micro-batches each stage holds in flight.

The model, the same rules the executor and the transports follow:
- A stage runs its actions in order. A forward of chunk v on stage s takes `forward[s]` / V
  seconds, a backward `backward[s]` / V (the stage's layers split evenly over its V chunks).
  Given `weight`, `backward[s]` is the input-gradient part (B) of a backward and `weight[s]` its
  weight-gradient part (W): a `weight` action takes `weight[s]` / V, a backward whose W is in
  the list (a split backward, schedules.SPLIT_BACKWARD) `backward[s]` / V, any other backward
  their sum; without `weight`, W takes no time.
- `send` and `recv` post a message and return at once; a message is identified by its pass, the
  boundary it crosses (between virtual stages b and b + 1, on the link between the stages that
  hold them: b mod P and (b + 1) mod P, or under ZBV's V placement, `placement`, pipeline_split.py's
  holders) and its micro-batch, as tests/test_pipeline_schedules.py's deadlock check keys it.
- A message moves once both its send and its receive are posted (a rendezvous: gloo and NCCL
  move a message only into a posted receive; `run` also models a send buffered at once), and
  then takes `link` seconds (or, with `link` a mapping, `link[(from stage, to stage)]`: links
  of different speeds) on the link from its sender's stage to its receiver's, one message
  at a time a direction, whatever its pass or boundary (messages queue in the order they become
  ready).
- `wait` blocks the stage until its message has arrived (a receive) or, for a send, arrived
  (NCCL) or started to move (gloo over TCP hands it to the kernel's socket buffer): `sends`.
- A boundary whose messages are collectives (`collectives`: a --pipeline-plan boundary moved by
  broadcast or scatter + all-gather, pipeline/reshard/boundary.py) moves a message once both
  ends posted it, whatever `sends`, and a send's wait ends when it arrived; its communicator
  runs one collective at a time, in the order they were posted (the same on both ends), so a
  message moves only after the one posted before it on that boundary and pass has arrived.
A stage blocked forever is a deadlock: `simulate` raises naming the stages and their actions.

What it leaves out: the tied-embedding all-reduce, the data-parallel reduction and the optimizer
(they do not depend on the schedule); the host's time to issue an action; a link's latency
beyond its time per message. The step is the latest stage's end.

Inputs come from a profiling pass, not from the run being predicted: a stage's forward and
backward time of one micro-batch alone, and one message's time over the link alone
(benchmarks/bench_pipeline.py measures both beside every step it times, and its report prints
the prediction beside the measurement).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from megadomino.config.pipeline_split import holder, placement_of, virtual_stage
from megadomino.pipeline.schedules import Action, schedule

SENDS = ("rendezvous", "handed", "buffered")
"""When a message moves and its send's wait ends (`run`)."""


@dataclass(frozen=True)
class Prediction:
    step: float
    """Seconds from every stage starting to the last one finishing."""
    busy: tuple[float, ...]
    """Each stage's seconds in forwards, backwards and weight-gradient passes."""
    in_flight: tuple[int, ...]
    """Each stage's peak count of (micro-batch, chunk) forwards whose backward has not run: the
    activations it holds, in micro-batches' worth of one chunk."""

    @property
    def bubble(self) -> tuple[float, ...]:
        """Each stage's idle fraction of the step."""
        return tuple(1.0 - busy / self.step if self.step > 0 else 0.0 for busy in self.busy)


def message(stages: int, stage: int, action: Action,
            placement: str = "loop") -> tuple[str, int, int]:
    """The message a send, receive or wait of `stage` names: (pass, boundary, micro-batch)."""
    virtual = virtual_stage(stage, action.chunk or 0, stages, placement)
    op = action.waits if action.op == "wait" else action.op
    below = virtual if (action.pass_ == "F") == (op == "send") else virtual - 1
    return action.pass_, below, action.micro


def simulate(name: str, stages: int, micro: int, forward: Sequence[float],
             backward: Sequence[float], link: float | Mapping[tuple[int, int], float],
             chunks: int = 1,
             prefetch: bool = True, weight: Sequence[float] | None = None,
             collectives: Collection[tuple[str, int]] = ()) -> Prediction:
    """Run schedule `name` of `stages` stages over `micro` micro-batches (`chunks` virtual
    stages each, receives prefetched or not as schedules.schedule says): `forward[s]` /
    `backward[s]` (and `weight[s]`) one micro-batch's seconds on stage s, `link` one message's
    seconds over a link (or per link: (from stage, to stage) -> seconds), `collectives` the
    (pass, boundary) whose messages are collectives (module docstring)."""
    lists = [schedule(name, stages, s, micro, chunks, prefetch) for s in range(stages)]
    return run(lists, stages, [f / chunks for f in forward], [b / chunks for b in backward],
               link, weight=None if weight is None else [w / chunks for w in weight],
               collectives=collectives, placement=placement_of(name))


def _seconds(times: Sequence[float | Sequence[float]] | None, stage: int, chunk: int) -> float:
    """`times[stage]`, or its chunk's `times[stage][chunk]`; no times: none spent."""
    spent = times[stage] if times is not None else 0.0
    return spent if isinstance(spent, float | int) else spent[chunk]


def run(lists: Sequence[Sequence[Action]], stages: int, forward: Sequence[float | Sequence[float]],
        backward: Sequence[float | Sequence[float]],
        link: float | Mapping[tuple[int, int], float], *, sends: str = "rendezvous",
        weight: Sequence[float | Sequence[float]] | None = None,
        collectives: Collection[tuple[str, int]] = (), placement: str = "loop") -> Prediction:
    """Every stage's `lists[s]` against a clock: `forward[s]` / `backward[s]` / `weight[s]`
    seconds a compute action of stage s (or `forward[s][v]` of its chunk v; a backward's time
    as the module docstring says), `link` seconds a message (module docstring). `sends`, when a
    message moves and when its send's wait ends:
      rendezvous  once both ends posted it; the send's wait ends when it arrived (NCCL);
      handed      once both ends posted it; the send's wait ends when it starts to move (gloo
                  over TCP: after the receiver's ready notice the message goes to the kernel's
                  socket buffer);
      buffered    once its send is posted; the send's wait ends at once.
    `collectives`: the (pass, boundary) whose messages are collectives, moved in posting order
    once both ends posted them (module docstring). `placement`: where the chunks sit
    (pipeline_split.py; the lists' schedule's)."""
    if sends not in SENDS:
        raise ValueError(f"sends must be one of {SENDS}, not {sends!r}")
    clock, at = [0.0] * stages, [0] * stages
    busy, held, peak = [0.0] * stages, [0] * stages, [0] * stages
    ready = [(0.0, s) for s in range(stages)]
    times = {"forward": forward, "backward": backward, "weight": weight}
    split = [{(a.micro, a.chunk or 0) for a in actions if a.op == "weight"} for actions in lists]

    def wake(stage: int, when: float) -> None:
        clock[stage] = max(clock[stage], when)
        heapq.heappush(ready, (clock[stage], stage))

    messages = _Messages(stages, link, sends, frozenset(collectives), wake, placement)
    done, blocked = messages.done, messages.blocked
    while ready:
        _, s = heapq.heappop(ready)
        while at[s] < len(lists[s]):
            action = lists[s][at[s]]
            if action.op in times:
                chunk = action.chunk or 0
                spent = _seconds(times[action.op], s, chunk)
                if action.op == "backward" and (action.micro, chunk) not in split[s]:
                    spent += _seconds(weight, s, chunk)  # unsplit: B and W in one
                clock[s] += spent
                busy[s] += spent
                held[s] += {"forward": 1, "backward": -1}.get(action.op, 0)
                peak[s] = max(peak[s], held[s])
            elif action.op in ("send", "recv"):
                messages.post(message(stages, s, action, placement),
                              0 if action.op == "send" else 1, clock[s])
            else:
                side = (action.waits, message(stages, s, action, placement))
                if side not in done:
                    blocked.setdefault(side, []).append(s)
                    at[s] += 1  # resumes after the wait once the message has moved
                    break
                clock[s] = max(clock[s], done[side])
            at[s] += 1
            if action.op != "wait" and ready and ready[0][0] < clock[s]:
                heapq.heappush(ready, (clock[s], s))  # let stages behind in time go first
                break
    stuck = {s: str(lists[s][at[s] - 1]) for s in range(stages)
             if any(s in waiters for waiters in blocked.values())}
    if stuck:
        raise RuntimeError(f"the schedule deadlocks: stages blocked at {stuck}")
    return Prediction(max(clock), tuple(busy), tuple(peak))


class _Messages:
    """`run`'s messages: when each is posted, moves over its link and may be waited (the
    module docstring's rules). `wake(stage, when)` resumes a stage blocked on a message."""

    def __init__(self, stages: int, link: float | Mapping[tuple[int, int], float], sends: str,
                 collectives: frozenset[tuple[str, int]], wake: Callable[[int, float], None],
                 placement: str = "loop"):
        self.stages, self.links, self.sends, self.collectives = stages, link, sends, collectives
        self.placement = placement
        self.wake = wake
        self.posted: dict[tuple, list[float | None]] = {}  # message -> [send, receive] posted
        self.done: dict[tuple, float] = {}              # (side, message) -> its wait may end
        self.blocked: dict[tuple, list[int]] = {}       # (side, message) -> stages waiting
        self.link_free: dict[tuple[int, int], float] = {}  # (from, to stage) -> when free
        self.queued: dict[tuple, list[tuple]] = {}      # a collectives' (pass, boundary) ->
        self.channel_free: dict[tuple, float] = {}      # its posted sends; its last's arrival

    def finish(self, side: tuple, when: float) -> None:
        self.done[side] = when
        for waiter in self.blocked.pop(side, []):
            self.wake(waiter, when)

    def lane(self, key: tuple) -> tuple[int, int]:
        """The link a message crosses: (from stage, to stage)."""
        low, high = (holder(b, self.stages, self.placement)[0] for b in (key[1], key[1] + 1))
        return (low, high) if key[0] == "F" else (high, low)

    def seconds(self, lane: tuple[int, int]) -> float:
        """One message's time over `lane`: `link`, or its entry when `link` is per lane."""
        return self.links if isinstance(self.links, (int, float)) else self.links[lane]

    def post(self, key: tuple, side: int, when: float) -> None:
        """Side 0 (the send) or 1 (the receive) of message `key` posted at `when`."""
        times = self.posted.setdefault(key, [None, None])
        times[side] = when
        if key[:2] in self.collectives:
            if side == 0:
                self.queued.setdefault(key[:2], []).append(key)
            self._collectives(key[:2])
            return
        send, receive = times
        buffered = self.sends == "buffered"
        if send is None or ("recv", key) in self.done or (receive is None and not buffered):
            return
        lane = self.lane(key)
        start = max(send if buffered else max(send, receive), self.link_free.get(lane, 0.0))
        end = start + self.seconds(lane)
        self.link_free[lane] = end
        self.finish(("recv", key), end)
        self.finish(("send", key), {"buffered": send, "handed": start}.get(self.sends, end))

    def _collectives(self, channel: tuple) -> None:
        """Move the channel's collectives in posting order while the first has both ends."""
        line = self.queued.get(channel, [])
        while line and None not in self.posted[line[0]]:
            key = line.pop(0)
            lane = self.lane(key)
            start = max(*self.posted[key], self.link_free.get(lane, 0.0),
                        self.channel_free.get(channel, 0.0))
            end = start + self.seconds(lane)
            self.link_free[lane] = self.channel_free[channel] = end
            self.finish(("recv", key), end)
            self.finish(("send", key), end)
