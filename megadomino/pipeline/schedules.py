"""Pipeline schedules as data: the actions one stage runs for one global batch, in order.

The executor (executor.py) runs this list and nothing else, so the printed list is the schedule.
An `Action(pass_, op, micro, chunk)` is printed as Domino's actions are (`table`, one a line):

    F M3 V1 recv      post the receive of micro-batch 3's activation for chunk 1 (async)
    F M3 V1 wait recv block until that activation is in
    F M3 V1 forward   run chunk 1 on it (the last chunk of the last stage: the loss)
    F M3 V1 send      post the send of its output to the next stage (async)
    B M3 V1 recv      post the receive of the gradient of that output
    B M3 V1 backward  autograd backward of the chunk's output with that gradient
    B M3 V1 send      post the send of the input's gradient to the previous stage
    W M3 V1 weight    the weight gradients of that backward (tp/wgrad.py's W), deferred: where a
                      list has it, `B M3 V1 backward` is the input-gradient part (B) alone
    F/B ... wait send block until that send has gone

`chunk` is None without a virtual pipeline. Compute orders: 1F1B (PipeDream-Flush, Megatron's
non-interleaved schedule: stage s of P runs min(P - s - 1, m) warm-up forwards), interleaved
1F1B (Megatron's: chunks of P micro-batches per model chunk, (P - s - 1) * 2 + (V - 1) * P
warm-up forwards, all of them when m = P; its steady state pairs a forward with a backward in one
step of transfers), eager-1F1B (Alpa's overlap-friendly PipeDream schedule, arXiv 2211.05322:
min(m, 2 (P - s) - 1) warm-up forwards; a forward's send is waited only after the next compute,
so it overlaps it; backward sends are waited at once), ZB-H1 (Qi et al., "Zero Bubble
Pipeline Parallelism", arXiv 2401.10241: 1F1B with each backward split into B and W, the W's
deferred; `_deferred_weights`), eager-zb (eager-1F1B's forwards with ZB-H1's deferred W's) and
ZBV (the same paper's V-shaped schedule on two chunks a stage placed in a V, `_zbv`).
Every schedule prefetches its receives by default (`with_transfers`' `prefetch`;
--no-overlap-p2p-communication turns it off but for eager-1F1B and eager-zb, which are defined
with it): a transfer moves only once its receive is posted, so
without it a slow link's transfer cannot overlap the receiver's computes (BENCHMARKS.md).

Transfers (`with_transfers`), one rule for every order: after a compute, post its send, then post
the receive the next compute needs, then wait (the sends to wait now, then the receive). Every
receive is posted before the rank blocks, which keeps the schedule free of deadlocks even where
a send completes only once its receive is posted (NCCL; tests/test_pipeline_schedules.py
simulates that for every schedule); it is the pairing of Megatron's
send_forward_recv_backward / send_backward_recv_forward. ZBV waits a send later, once the next
send of its pass and chunk is posted (`late_sends`; `_zbv` says why), and its loading list runs
the micro-batches one after the other (`one_at_a_time`). A weight-gradient pass moves nothing: it
belongs to the step before it and runs after that step's posts, before its waits, so that it
fills the time the stage would block (the rule that gives ZB-H1's ideal bubble with receives
prefetched or not, tests/test_pipeline_simulate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from megadomino.config import ConfigError, ParallelConfig
from megadomino.config.pipeline_split import holder, placement_of, virtual_stage
from megadomino.overlap.domino.actions import table
from megadomino.tp.wgrad import check_split_backward

SCHEDULES = ("1f1b", "interleaved", "eager-1f1b", "zb-h1", "eager-zb", "zbv")
SPLIT_BACKWARD = ("zb-h1", "eager-zb", "zbv")
"""The schedules whose backward is split into B (input gradients) and W (weight gradients)."""
EAGER = ("eager-1f1b", "eager-zb")
"""The schedules with eager-1F1B's warm-up, whose forward sends are waited after the next
compute and whose receives are always prefetched."""

__all__ = ["EAGER", "SCHEDULES", "SPLIT_BACKWARD", "Action", "bubble_fraction", "check_schedule",
           "compute_order", "compute_steps", "schedule", "table", "with_transfers"]


@dataclass(frozen=True)
class Action:
    pass_: str                 # "F" (activations), "B" (gradients) or "W" (weight gradients)
    op: str                    # forward backward weight send recv wait
    micro: int
    chunk: int | None = None
    waits: str | None = None   # wait: "send" or "recv"

    def __str__(self) -> str:
        where = " ".join(f"{name}{value}" for name, value in (("M", self.micro),
                                                              ("V", self.chunk))
                         if value is not None)
        what = f"wait {self.waits}" if self.op == "wait" else self.op
        return f"{self.pass_} {where:<5} {what}"


Compute = tuple[str, int, int]   # ("F", "B" or "W", micro, chunk)
COMPUTE_OPS = {"F": "forward", "B": "backward", "W": "weight"}


def compute_order(name: str, stages: int, stage: int, micro: int,
                  chunks: int = 1) -> list[Compute]:
    """The forwards and backwards of `stage` in the order `name` runs them."""
    return [c for step in compute_steps(name, stages, stage, micro, chunks) for c in step]


def compute_steps(name: str, stages: int, stage: int, micro: int,
                  chunks: int = 1) -> list[list[Compute]]:
    """The compute order in steps of transfers: one compute a step, except the interleaved
    schedule's steady state, whose forward and backward share one step (Megatron's
    send_forward_backward_recv_forward_backward), and a weight-gradient pass, which shares the
    step of the compute before it (module docstring)."""
    if name == "interleaved":
        return _interleaved(stages, stage, micro, chunks)
    if name == "zbv":
        return _zbv(stages, stage, micro, chunks)
    if chunks != 1:
        raise ConfigError(f"--pipeline-schedule {name} runs one model chunk per stage: a "
                          f"virtual pipeline needs --pipeline-schedule interleaved")
    if name in ("1f1b", "zb-h1"):
        warmup = min(stages - stage - 1, micro)
    elif name in EAGER:
        # min(m, 2 (P - s) - 1) forwards before the first backward, then backward and forward
        # in turn: the steady state of 1F1B with one forward fewer in its warm-up.
        warmup = min(micro, 2 * (stages - stage) - 1) - 1
    else:
        raise ConfigError(f"--pipeline-schedule {name} is unknown: choose one of "
                          f"{', '.join(SCHEDULES)}")
    steps = _one_f_one_b([("F", m, 0) for m in range(micro)],
                         [("B", m, 0) for m in range(micro)], warmup, paired=False)
    return _deferred_weights(steps, stage, micro) if name in SPLIT_BACKWARD else steps


def _one_f_one_b(forwards: list[Compute], backwards: list[Compute], warmup: int,
                 paired: bool) -> list[list[Compute]]:
    """`warmup` forwards, then one forward and one backward in turn (`paired`: in one step),
    then the backwards left."""
    steps = [[f] for f in forwards[:warmup]]
    for k in range(len(forwards) - warmup):
        pair = [forwards[warmup + k], backwards[k]]
        steps += [pair] if paired else [[c] for c in pair]
    return steps + [[b] for b in backwards[len(forwards) - warmup:]]


def _deferred_weights(steps: list[list[Compute]], stage: int,
                      micro: int) -> list[list[Compute]]:
    """The split backward's W's placed into a one-chunk order of F's and B's (ZB-H1's rule):
    each B of stage s followed by the W of the micro-batch s B's before it (stage s runs its
    first s B's without a W), the W's left at the end.

    ZB-H1 is 1F1B's order with this rule (min(P - s - 1, m) warm-up forwards, then forward and
    B in turn); eager-zb is eager-1F1B's (min(m, 2 (P - s) - 1) forwards before the first B,
    each forward's send overlapping the next compute), which keeps both gains: the W's fill the
    cool-down as ZB-H1's do, and a slow link's transfers overlap the extra warm-up forwards (the
    simulator, where B takes at least F: ZB-H1's step over free links, never above eager-1F1B's
    or ZB-H1's over slow ones, tests/test_pipeline_simulate.py; where B is shorter than F its
    extra warm-up forwards delay the first B's). It holds eager-1F1B's 2 (P - s) - 1
    micro-batches before their B, and at most s more whose W is pending.

    Why: B alone is on the critical path, so the gradients reach stage 0 sooner than 1F1B's
    whole backwards do, and the W's a stage delays fill its cool-down, where it waits for the B's
    of the stages after it (the later the stage, the more W's it has left). Memory: stage s
    holds at most min(P - s, m) micro-batches whose B has not run, 1F1B's count, and
    min(P, m) whose W has not run, 1F1B's peak (stage 0's), on every stage: the paper's bound.
    With F = B = W = t and m >= P the step is (3 m + P - 1) t, a bubble of (P - 1) t, a third of
    1F1B's 3 (P - 1) t. Torch's ScheduleInterleavedZeroBubble with one stage a rank (its ZB1P)
    runs ZB-H1's order (tests/test_pipeline_schedules.py)."""
    placed = [step + [("W", m - stage, 0) for p, m, _ in step if p == "B" and m >= stage]
              for step in steps]
    placed[-1] += [("W", m, 0) for m in range(max(micro - stage, 0), micro)]
    return placed


def _interleaved(stages: int, stage: int, micro: int, chunks: int) -> list[list[Compute]]:
    """Megatron's interleaved order: the k-th forward runs chunk (k // P) % V on micro-batch
    (k // (P V)) P + k % P; backwards run the chunks in reverse."""
    if micro % stages:
        raise ConfigError(f"the interleaved schedule needs the number of micro-batches "
                          f"({micro}) to be a multiple of --pipeline-model-parallel-size "
                          f"({stages})")
    total = micro * chunks

    def micro_of(k: int) -> int:
        return (k // (stages * chunks)) * stages + k % stages

    forwards = [("F", micro_of(k), (k // stages) % chunks) for k in range(total)]
    backwards = [("B", micro_of(k), chunks - 1 - (k // stages) % chunks) for k in range(total)]
    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    if micro == stages:  # Megatron's rule: one group of micro-batches runs all its forwards first
        warmup = total
    return _one_f_one_b(forwards, backwards, warmup, paired=True)


def _zbv(stages: int, stage: int, micro: int, chunks: int) -> list[list[Compute]]:
    """ZBV (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 6; the
    order of torch's ScheduleZBVZeroBubble, tests/test_pipeline_schedules.py) on the V
    placement: chunk 0 of stage s is virtual stage s, chunk 1 virtual stage 2 P - 1 - s, so the
    last stage hands its chunk 0's output to its own chunk 1 and stage 0 computes the loss.
    The order is written for n = max(m, 2 P - 1) micro-batches, those >= m then left out:
      warm-up    2 (P - s) - 1 forwards of chunk 0; s times a forward of chunk 1, then one of
                 chunk 0; P - s times a forward, B and W of chunk 1
      steady     while chunk 0 has forwards left or chunk 1 has run fewer: a forward of chunk 0
                 (while it has any left), B and W of chunk 0, a forward, B and W of chunk 1
      cool-down  s times B of chunk 0 and B of chunk 1, their W's deferred; P - s times B of
                 chunk 0 and chunk 0's oldest deferred W; chunk 1's deferred W's, chunk 0's
    Each W shares the step of the compute before it (module docstring: after that step's posts,
    before its waits, where it fills the time the stage would block).

    Sends are waited late (with_transfers' `late_sends`: in the step that posts the next send
    of the same pass and chunk), not at once: stage s sends 2 (P - s) - 1 warm-up forwards up
    while stage s + 1 receives them between forwards of its chunk 1, which wait on stage s's
    receive of a chunk-1 activation that stage s posts only after its warm-up; a send waited at
    once, where a send completes only once its receive is posted (gloo, NCCL), deadlocks there
    (torch's runtime waits its sends at the step's end). One send a channel left in flight
    frees each output one send later than at once.

    Why: the V keeps both ends of the model on stage 0, so a micro-batch's B starts on the stage
    whose forward just ended, and the W's fill the warm-up's and cool-down's gaps. With
    F = B = W = t a stage (t / 2 a chunk), free links and m >= 2 P - 1 the simulator's step is
    (3 m + (P - 1) / 2) t, half ZB-H1's bubble (tests/test_pipeline_simulate.py). Memory: stage
    s holds at most 2 P micro-batches of one chunk (half its layers) whose B has not run, 1F1B's
    peak (stage 0's P whole-stage activations), on every stage (tests/test_pipeline_schedules.py).
    """
    if chunks != 2:
        raise ConfigError(f"--pipeline-schedule zbv runs exactly 2 model chunks a stage, placed "
                          f"in a V, not {chunks}: give --virtual-pipeline-model-parallel-size 2")
    full = max(micro, 2 * stages - 1)
    count = {(pass_, chunk): 0 for pass_ in "FBW" for chunk in (0, 1)}
    order: list[Compute] = []

    def run(pass_: str, chunk: int, times: int = 1) -> None:
        for _ in range(times):
            order.append((pass_, count[pass_, chunk], chunk))
            count[pass_, chunk] += 1

    run("F", 0, 2 * (stages - stage) - 1)
    for _ in range(stage):
        run("F", 1), run("F", 0)
    for _ in range(stages - stage):
        run("F", 1), run("B", 1), run("W", 1)
    while count["F", 0] < full or count["F", 1] < count["F", 0]:
        if count["F", 0] < full:
            run("F", 0)
        run("B", 0), run("W", 0), run("F", 1), run("B", 1), run("W", 1)
    for _ in range(stage):
        run("B", 0), run("B", 1)
    for _ in range(stages - stage):
        run("B", 0), run("W", 0)
    run("W", 1, count["B", 1] - count["W", 1])
    run("W", 0, count["B", 0] - count["W", 0])
    steps: list[list[Compute]] = []
    for compute in (c for c in order if c[1] < micro):
        if compute[0] == "W" and steps:
            steps[-1].append(compute)
        else:
            steps.append([compute])
    return steps


def _receives(pass_: str, stage: int, chunk: int, stages: int, chunks: int,
              placement: str = "loop") -> bool:
    """Does this compute need an input from another stage (activation or output gradient)?
    Not where its producer, the virtual stage before (F) or after it (B), is on this stage:
    the V placement's turn on the last stage, which the executor hands over locally."""
    if pass_ == "W":
        return False
    producer = virtual_stage(stage, chunk, stages, placement) + (-1 if pass_ == "F" else 1)
    return (0 <= producer < stages * chunks
            and holder(producer, stages, placement)[0] != stage)


def _sends(pass_: str, stage: int, chunk: int, stages: int, chunks: int,
           placement: str = "loop") -> bool:
    opposite = "B" if pass_ == "F" else "F"
    return pass_ != "W" and _receives(opposite, stage, chunk, stages, chunks, placement)


def with_transfers(steps: list[list[Compute]], stages: int, stage: int, chunks: int,
                   eager: bool = False, prefetch: bool = False, loading: bool = False,
                   placement: str = "loop", late_sends: bool = False) -> list[Action]:
    """The computes, in steps, with their sends, receives and waits (module docstring's rule,
    applied per step: a step is one compute, or the interleaved schedule's steady-state
    forward + backward pair, with the weight-gradient passes that follow it, which run after
    the step's posts and before its waits). `eager`: a forward's send is waited after the next
    step instead of at once. `prefetch`: each receive is posted right after the previous
    receive of its pass (F or B) was waited, one compute of that pass ahead, instead of after
    the compute before it: gloo and NCCL move a message only once its receive is posted, so
    without it a transfer cannot overlap the receiver's computes, and a send waited at once
    blocks until the receiver gets to its post. Receives keep their order either way.
    `loading`: no message in flight on the rank at any compute (schedule's `loading`): no
    prefetch, no late send waits, and a step's weight-gradient passes after its waits.
    `placement`: where the chunks sit (pipeline_split.py), which says which computes move a
    message. `late_sends` (ZBV's): a send is waited in the step that posts the next send of its
    pass and chunk (its channel), the last ones at the end (`_zbv` says why)."""
    eager, prefetch = eager and not loading, prefetch and not loading
    late_sends = late_sends and not loading
    def moves(pass_: str, chunk: int, sends: bool = False) -> bool:
        return (_sends if sends else _receives)(pass_, stage, chunk, stages, chunks, placement)

    def action(pass_: str, op: str, micro: int, chunk: int, waits: str | None = None):
        return Action(pass_, op, micro, chunk if chunks > 1 else None, waits)

    received = [c for step in steps for c in step if moves(c[0], c[2])]
    ahead = {p: iter([c for c in received if c[0] == p][1:] if prefetch else []) for p in "FB"}
    early: set[Compute] = set()

    def receives(step: list[Compute]) -> tuple[list[Action], list[Action]]:
        needed = [c for c in step if moves(c[0], c[2])]
        waits = []
        for pass_, micro, chunk in needed:
            waits.append(action(pass_, "wait", micro, chunk, "recv"))
            following = next(ahead[pass_], None)
            if following is not None:
                early.add(following)
                waits.append(action(*following[:1], "recv", *following[1:]))
        return ([action(p, "recv", m, v) for p, m, v in needed if (p, m, v) not in early],
                waits)

    out: list[Action] = []
    deferred: list[Action] = []
    unwaited: dict[tuple[str, int], Action] = {}  # late_sends: (pass, chunk) -> its last send
    if steps:
        posts, waits = receives(steps[0])
        out += posts + waits
    for index, step in enumerate(steps):
        waits = list(deferred)
        deferred = []
        fill = [action(p, COMPUTE_OPS[p], m, v) for p, m, v in step if p == "W"]
        for pass_, micro, chunk in step:
            if pass_ != "W":
                out.append(action(pass_, COMPUTE_OPS[pass_], micro, chunk))
        for pass_, micro, chunk in step:
            if moves(pass_, chunk, sends=True):
                out.append(action(pass_, "send", micro, chunk))
                sent = action(pass_, "wait", micro, chunk, "send")
                if late_sends:
                    earlier = unwaited.pop((pass_, chunk), None)
                    waits += [earlier] if earlier is not None else []
                    unwaited[pass_, chunk] = sent
                    continue
                (deferred if eager and pass_ == "F" else waits).append(sent)
        posts, receive = receives(steps[index + 1]) if index + 1 < len(steps) else ([], [])
        out += posts + waits + receive + fill if loading else posts + fill + waits + receive
    return out + deferred + list(unwaited.values())


def schedule(name: str, stages: int, stage: int, micro: int, chunks: int = 1,
             prefetch: bool = True, loading: bool = False) -> list[Action]:
    """The action list of `stage` (0-based) of `stages` for `micro` micro-batches; `prefetch`:
    receives posted one compute ahead (with_transfers; --no-overlap-p2p-communication turns it
    off), which the EAGER schedules always do. `loading`: the same computes in the same order
    with no message in flight on the rank while it computes (with_transfers' `loading`), for a
    step that may launch a kernel for the first time:
    CUDA loads a kernel at its first launch and the load waits for the device's queued work,
    which a receive posted ahead keeps queued until the peer sends, and the peer may be waiting
    on this rank (PipelineRuntime.actions). ZBV's loading list runs its computes in another
    order, `one_at_a_time`'s: its own order needs a send in flight while the rank computes."""
    eager, placement = name in EAGER, placement_of(name)
    if loading and placement == "v":
        steps = one_at_a_time(stages, stage, micro, chunks, placement, name in SPLIT_BACKWARD)
    else:
        steps = compute_steps(name, stages, stage, micro, chunks)
    return with_transfers(steps, stages, stage, chunks, eager=eager, prefetch=prefetch or eager,
                          loading=loading, placement=placement, late_sends=name == "zbv")


def one_at_a_time(stages: int, stage: int, micro: int, chunks: int, placement: str,
                  split: bool = False) -> list[list[Compute]]:
    """`stage`'s part of the micro-batches run one after the other through the whole model: a
    micro-batch's forwards over the virtual stages in order, then its backwards in reverse
    (`split`: each B with its W in its step). One stage computes at a time, and the compute
    after a send is its receiver's, whose receive is already posted: it runs with every send
    waited at once and nothing in flight at a compute, whatever the placement (ZBV's loading
    list; the pipeline's stages idle but one, for the one step that runs it)."""
    virtual = range(stages * chunks)
    mine = [v for v in virtual if holder(v, stages, placement)[0] == stage]
    steps: list[list[Compute]] = []
    for m in range(micro):
        steps += [[("F", m, holder(v, stages, placement)[1])] for v in mine]
        steps += [[("B", m, chunk)] + ([("W", m, chunk)] if split else [])
                  for chunk in (holder(v, stages, placement)[1] for v in reversed(mine))]
    return steps


def check_schedule(parallel: ParallelConfig) -> None:
    """Refuse, as one line before any process group, what the pipeline's schedule cannot run
    with: a split backward (SPLIT_BACKWARD) refuses the ways of running the layers whose
    backward computes weight gradients in its own kernels or graphs (tp/wgrad.py). Virtual
    stages with a schedule other than interleaved are config/validate.py's refusal. 'auto'
    (schedule_auto.py) leaves out of its candidates what is refused, and is itself refused
    with --pipeline-plan auto, whose planner predicts each plan's step under the schedule it is
    given."""
    name = parallel.pipeline_schedule
    if name == "auto" and parallel.pipeline_plan == "auto":
        raise ConfigError("--pipeline-schedule auto cannot be used with --pipeline-plan auto: "
                          "the planner predicts each plan's step under one given schedule; "
                          "give --pipeline-schedule 1f1b, eager-1f1b or zb-h1")
    if parallel.pipeline_model_parallel_size > 1 and name in SPLIT_BACKWARD:
        check_split_backward(parallel, parallel.tensor_model_parallel_size,
                             f"--pipeline-schedule {name}")


def bubble_fraction(stages: int, micro: int, chunks: int = 1) -> float:
    """The idle fraction of a stage in the ideal pipeline: (p - 1) / (m + p - 1), and with
    interleaving (p - 1) / (v m + p - 1). Eager-1F1B has 1F1B's bubble (it reorders no
    compute across the critical path; it overlaps the forward sends)."""
    return (stages - 1) / (chunks * micro + stages - 1)
