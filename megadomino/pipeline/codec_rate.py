"""The boundary codecs' settings per link, fixed or adaptive (--pipeline-codec,
--pipeline-codec-interval), and their state in a checkpoint.

Fixed (interval 0): every boundary runs the flag's codec: int8, int4, or adatopk at
k = ceil(density h) per token row (--pipeline-codec-density).

Adaptive (interval N > 0; `auto` always is): each link gets the least compression of its
ladder that brings its predicted transfer per step under the slowest stage's compute per step:

    ladder    none, then the flag's codec: int8; int4; adatopk at any k from h down to the
              density's k (the floor); auto: none, int8, int4, then adatopk (with int8 values
              at k < h / 6 it sends fewer bytes than int4, with int4 values at k < h / 5)
              -- least bytes last
    transfer  for each direction of the link: its messages per step x the setting's message
              bytes (codec.message_bytes) x the link's seconds per byte, the median over the
              window's sends of their own time over their bytes (transport_codec.py's timings:
              no probe traffic); the slower direction counts, and the slowest of the DP
              columns that share the boundary
    compute   the largest over the ranks of the mean seconds per step of their forward,
              backward and weight actions (the executor's timeline; emulated slowdowns
              included)
    choice    the first setting of the ladder whose transfer <= compute; adatopk's k the
              largest that fits; none fitting: the ladder's last (the floor)

Every N steps the ranks gather their timings (all_gather_object over the world), rank 0
decides, and broadcasts the settings; every rank applies them from the next step on, so both
ends of every link change at the same step boundary. The first N steps run the floor on every
link (no timing has been seen yet). `state_dict` holds the settings, the steps since the
last decision and what they measured (the window's compute seconds and send timings), with
the transport's error-feedback residuals: a resumed run decides at the same steps, from a
whole window, and continues from the same settings (the training loop's checkpoints carry it:
train/checkpoint/pipeline_codec.py). Timings are wall-clock: two runs, or a run and its
resume, may decide differently; given the same decisions, the numbers repeat exactly.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

import torch.distributed as dist

from megadomino.distributed import comm
from megadomino.pipeline.codec import Format, Setting, message_bytes
from megadomino.pipeline.transport_codec import CodecTransport

AUTO = "auto"


def floor_setting(codec: str, fmt: Format, density: float) -> Setting:
    """The most compression the flag allows: the fixed setting of `codec` (auto: adatopk)."""
    if codec in ("adatopk", AUTO):
        return Setting("adatopk", fmt.k_of(density))
    return Setting(codec)


def _per_step(setting: Setting, fmt: Format, link: dict) -> float:
    """Predicted seconds per step of a link at `setting`: its slower direction."""
    return max(count * message_bytes(setting, fmt, pass_) * per_byte
               for pass_, (count, per_byte) in link.items())


def _largest_k(fmt: Format, link: dict, budget: float, k_min: int) -> int:
    """adatopk's largest k (k_min at least, h at most) whose transfer fits `budget` (message
    bytes are affine in k, or at int4 values in k rounded up to even: the slope over two
    entries, one less where an odd k's pad overshoots)."""
    best = fmt.hidden
    for pass_, (count, per_byte) in link.items():
        if count * per_byte <= 0:
            continue
        allowed = budget / (count * per_byte)
        base = message_bytes(Setting("adatopk", 0), fmt, pass_)
        step = (message_bytes(Setting("adatopk", 2), fmt, pass_) - base) / 2
        k = int((allowed - base) // step)
        if k > 0 and message_bytes(Setting("adatopk", k), fmt, pass_) > allowed:
            k -= 1
        best = min(best, k)
    return max(k_min, best)


def choose(codec: str, fmt: Format, density: float, link: dict, budget: float) -> Setting:
    """The module docstring's choice for one link: `link` maps a pass ('F', 'B') to (messages
    per step, seconds per byte); `budget`: the slowest stage's compute seconds per step."""
    floor = floor_setting(codec, fmt, density)
    ladder = [Setting("none")] + ([Setting("int8"), Setting("int4")] if codec == AUTO else
                                  [floor] if codec != "adatopk" else [])
    if floor.codec == "adatopk":
        ladder.append(Setting("adatopk", _largest_k(fmt, link, budget, floor.k)))
    chosen, least = floor, None
    for setting in ladder:
        size = sum(message_bytes(setting, fmt, pass_) for pass_ in ("F", "B"))
        if least is not None and size >= least:
            continue  # never more bytes than a setting already passed over
        least = size
        if _per_step(setting, fmt, link) <= budget:
            chosen = setting
            break
    return chosen


def decide(codec: str, fmt: Format, density: float, boundaries: int, reports: list[dict],
           current: tuple[Setting, ...]) -> tuple[Setting, ...]:
    """Every boundary's setting from every rank's report ({'steps', 'compute', 'sends': [(boundary,
    pass, bytes, seconds)]}); a boundary without timed sends keeps its setting."""
    steps = max(1, max(report["steps"] for report in reports))
    budget = max(report["compute"] / max(1, report["steps"]) for report in reports)
    links: dict[tuple[int, int], dict] = {}
    for rank, report in enumerate(reports):
        timed = defaultdict(list)
        for boundary, pass_, nbytes, seconds in report["sends"]:
            timed[(boundary, pass_)].append(seconds / max(1, nbytes))
        for (boundary, pass_), per_byte in timed.items():
            links.setdefault((boundary, rank), {})[pass_] = (len(per_byte) / steps,
                                                             statistics.median(per_byte))
    chosen = list(current)
    for boundary in range(boundaries):
        columns = [link for (b, _), link in links.items() if b == boundary]
        if not columns:
            continue
        settings = [choose(codec, fmt, density, link, budget) for link in columns]
        # the slowest column decides: the fewest bytes
        chosen[boundary] = min(settings, key=lambda s: sum(message_bytes(s, fmt, p)
                                                           for p in ("F", "B")))
    return tuple(chosen)


class CodecRate:
    """The settings of a run's boundaries, adapted every `interval` steps (0: fixed) on the
    `transport` (a CodecTransport, timed when adaptive). Built alike on every rank."""

    def __init__(self, transport, codec: str, fmt: Format, density: float, interval: int,
                 boundaries: int):
        self.transport, self.codec, self.fmt = transport, codec, fmt
        self.density, self.interval, self.boundaries = density, interval, boundaries
        self.steps, self.compute = 0, 0.0
        self.history: list[tuple[int, tuple[Setting, ...]]] = []  # (step applied from, settings)
        self.step_count = 0
        transport.apply((floor_setting(codec, fmt, density),) * boundaries)

    def describe(self) -> str:
        """The start-up line: the codec, how it adapts, the setting now of each boundary
        between consecutive stages (not the interleaved schedule's last-to-first hop)."""
        how = (f"re-estimated every {self.interval} steps" if self.interval else "fixed")
        now = ", ".join(f"boundary {b}: {s.describe(self.fmt.hidden)}"
                        for b, s in enumerate(self.settings[:-1]))
        return f"pipeline codec {self.codec}, {how}; {now}"

    @property
    def settings(self) -> tuple[Setting, ...]:
        return self.transport.settings

    def begin_step(self) -> bool:
        """At every step's start, on every rank: every `interval` steps, the decision (a
        collective over the world), applied from this step on. Whether the settings changed
        (the same on every rank)."""
        if not (self.interval and self.steps >= self.interval):
            return False
        before = self.settings
        report = {"steps": self.steps, "compute": self.compute,
                  "sends": self.transport.timings()}
        reports = comm.all_gather_object(report)
        chosen = None
        if dist.get_rank() == 0:
            chosen = decide(self.codec, self.fmt, self.density, self.boundaries, reports,
                            self.settings)
        chosen = comm.broadcast_object(chosen, src=0)
        self.transport.apply(chosen)
        self.history.append((self.step_count, chosen))
        self.steps, self.compute = 0, 0.0
        return self.settings != before

    def end_step(self, compute_seconds: float) -> None:
        """After every step: this rank's compute seconds in it."""
        self.steps += 1
        self.step_count += 1
        self.compute += compute_seconds

    @property
    def stateful(self) -> bool:
        """Whether a resumed run needs `state_dict` to continue exactly: adaptive settings or
        error-feedback residuals (a fixed codec without feedback has none)."""
        return self.interval > 0 or self.transport.error_feedback

    def identity(self) -> dict:
        """What `state_dict` belongs to, in plain types: the codec flags, this rank's stage of
        the stage count and the boundary activation's shape and dtype (the residuals')."""
        fmt, transport = self.fmt, self.transport
        return {"codec": self.codec, "density": self.density, "values": fmt.values,
                "grad_topk": fmt.grad_topk, "error_feedback": transport.error_feedback,
                "interval": self.interval, "stage": transport.stage, "stages": transport.stages,
                "shape": list(transport.shape), "dtype": str(fmt.dtype)}

    def state_dict(self) -> dict:
        """The settings, the decision window so far (steps, compute seconds, the transport's
        timings) and the transport's residuals; no collective."""
        return {"settings": [(s.codec, s.k) for s in self.settings], "steps": self.steps,
                "compute": self.compute, "step_count": self.step_count,
                "transport": self.transport.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.transport.apply(tuple(Setting(codec, k) for codec, k in state["settings"]))
        self.steps, self.step_count = state["steps"], state["step_count"]
        self.compute = state["compute"]
        self.transport.load_state_dict(state["transport"])


def with_codec(inner, stage: int, stages: int, parallel) -> CodecRate:
    """The CodecTransport over this rank's P2P transport `inner` (transport_p2p.py: its
    `shape`, `dtype`, `device` and receives into a given buffer) and its settings, as the
    --pipeline-codec flags say."""
    fmt = Format(math.prod(inner.shape[:-1]), inner.shape[-1], inner.dtype,
                 parallel.pipeline_codec_values, parallel.pipeline_codec_grad_topk)
    interval = parallel.pipeline_codec_interval
    transport = CodecTransport(inner, stage, stages, inner.shape, fmt, (Setting(),) * stages,
                               parallel.pipeline_codec_error_feedback, timed=interval > 0)
    return CodecRate(transport, parallel.pipeline_codec, fmt, parallel.pipeline_codec_density,
                     interval, stages)
