"""Sample-based LR schedules, WSD, decoupled LRs and the batch-size ramp-up, step by step equal to
Megatron-LM's formulas, written out below from its source:

- NVIDIA/Megatron-LM megatron/core/num_microbatches_calculator.py (commit 00caa53af309):
  `RampupBatchsizeNumMicroBatchesCalculator.__init__` and `update`;
- the same file at commit d98e8a64ddf3: `StepBatchsizeNumMicroBatchesCalculator` (`_parse_schedule`,
  `_parse_numeric_value`, `_get_batch_size_for_samples`), and training.py's `update_train_iters`
  at that commit for a stepped schedule;
- megatron/core/optimizer_param_scheduler.py (commit 00caa53af309): `OptimizerParamScheduler.
  get_lr` and `step` (init_lr 0: --lr-warmup-init's default);
- megatron/training/training.py (commit 001b00c2734d): `update_train_iters`,
  `get_optimizer_param_scheduler`, and the loop's order: `update_num_microbatches(consumed)`
  before each step, `consumed += current global batch` after it, the scheduler stepped by that
  batch after each successful step;
- megatron/core/optimizer/__init__.py `_update_min_and_max_lr_in_param_groups`: the decoupled
  groups' max_lr / min_lr (--decoupled-min-lr defaults to --min-lr).

Then the loop itself (one gloo rank): its LRs, batches, the samples it reads and a resume under
a ramp-up are the reference's.
"""

from __future__ import annotations

import math
import re

import pytest

from megadomino.cli.arguments import parse_args
from megadomino.config import ScheduleConfig
from megadomino.config.batches import BatchSchedule
from megadomino.data.mock import MockDataset
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train
from megadomino.train.lr_schedule import LRSchedule

pytestmark = pytest.mark.usefixtures("single_process_group")  # the loop's tests need a group

# ---- Megatron-LM's formulas, transcribed -----------------------------------------------------


class MegatronRampup:
    """RampupBatchsizeNumMicroBatchesCalculator without its logging and asserts."""

    def __init__(self, gbs: int, mbs: int, dp: int, start: int, increment: int, samples: int):
        self.gbs, self.mbs, self.dp = gbs, mbs, dp
        self.start, self.increment, self.samples = start, increment, samples
        num_increments = (gbs - start) // increment
        self.rampup_samples_per_increment = samples / num_increments
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        if consumed_samples > self.samples:
            self.current_global_batch_size = self.gbs
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = self.start + steps * self.increment
        self.num_micro_batches = self.current_global_batch_size // (self.mbs * self.dp)


class MegatronSteps:
    """StepBatchsizeNumMicroBatchesCalculator without its logging and asserts."""

    def __init__(self, schedule: list, mbs: int, dp: int):
        self.schedule, self.mbs, self.dp = [tuple(pair) for pair in schedule], mbs, dp
        self.samples = None  # not a ramp: update_train_iters takes the stepped branch
        self.update(0)

    @staticmethod
    def parse(schedule_str: str, seq_length: int) -> list[tuple[int, int]]:
        def number(value_str: str) -> int:
            value_str = value_str.strip().upper()
            multiplier = 1
            for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
                if value_str.endswith(suffix):
                    multiplier, value_str = scale, value_str[:-1]
                    break
            return int(float(value_str) * multiplier)
        schedule = []
        for entry in schedule_str.strip().replace(',', ' ').split():
            threshold_str, batch_size_str = entry.split(':', 1)
            schedule.append((number(threshold_str) // seq_length, number(batch_size_str)))
        schedule.sort(key=lambda x: x[0])
        return schedule

    def update(self, consumed_samples: int) -> None:
        batch_size = self.schedule[0][1]
        for threshold, bs in self.schedule:
            if consumed_samples >= threshold:
                batch_size = bs
            else:
                break
        self.current_global_batch_size = batch_size
        self.num_micro_batches = batch_size // (self.mbs * self.dp)


def megatron_train_iters(train_samples: int, gbs: int,
                         rampup: MegatronRampup | MegatronSteps | None) -> int:
    """training.py's update_train_iters."""
    if isinstance(rampup, MegatronSteps):
        iterations = consumed_samples = 0
        while consumed_samples < train_samples:
            rampup.update(consumed_samples)
            consumed_samples += rampup.current_global_batch_size
            iterations += 1
        rampup.update(0)
        return iterations
    if rampup is None:
        return train_samples // gbs
    iterations, consumed_samples = 0, 0
    while consumed_samples <= rampup.samples:
        rampup.update(consumed_samples)
        consumed_samples += rampup.current_global_batch_size
        iterations += 1
    rampup.update(0)
    iterations += (train_samples - consumed_samples) // gbs
    return iterations


class MegatronScheduler:
    """OptimizerParamScheduler.get_lr for one param group (init_lr 0)."""

    def __init__(self, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                 wsd_decay_steps=None, lr_wsd_decay_style=None):
        self.init_lr, self.max_lr, self.min_lr = 0.0, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.num_steps = 0

    def get_lr(self, param_group: dict) -> float:
        max_lr = param_group.get('max_lr', self.max_lr)
        min_lr = param_group.get('min_lr', self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (
                (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))
        if self.lr_decay_style == 'constant':
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        num_steps_ = self.num_steps - self.lr_warmup_steps
        decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
        decay_ratio = float(num_steps_) / float(decay_steps_)
        delta_lr = max_lr - min_lr
        if self.lr_decay_style == 'linear':
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD
            wsd_anneal_start_ = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= wsd_anneal_start_:
                coeff = 1.0
            else:
                wsd_steps = self.num_steps - wsd_anneal_start_
                wsd_decay_ratio = float(wsd_steps) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - wsd_decay_ratio
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(wsd_decay_ratio)
        return min_lr + coeff * delta_lr


def megatron_scheduler(s: ScheduleConfig, train_iters: int | None, gbs: int) -> MegatronScheduler:
    """training.py's get_optimizer_param_scheduler (with its WSD lengths)."""
    if s.train_iters:
        lr_decay_iters = s.lr_decay_iters if s.lr_decay_iters is not None else s.train_iters
        lr_decay_steps = lr_decay_iters * gbs
        wsd_decay_steps = None
        if s.lr_wsd_decay_iters is not None:
            wsd_decay_steps = s.lr_wsd_decay_iters * gbs
        if s.lr_warmup_fraction is not None:
            lr_warmup_steps = s.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = s.lr_warmup_iters * gbs
    else:
        lr_decay_steps = s.lr_decay_samples if s.lr_decay_samples is not None else s.train_samples
        wsd_decay_steps = s.lr_wsd_decay_samples
        if s.lr_warmup_fraction is not None:
            lr_warmup_steps = s.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = s.lr_warmup_samples
    return MegatronScheduler(s.lr, s.min_lr, lr_warmup_steps, lr_decay_steps, s.lr_decay_style,
                             wsd_decay_steps, s.lr_wsd_decay_style)


def megatron_run(s: ScheduleConfig, dp: int) -> list[tuple[int, int, float, float | None]]:
    """Per iteration of Megatron's loop: (consumed before it, micro-batches, lr, decoupled lr)."""
    gbs = s.global_batch_size
    rampup = None if s.rampup_batch_size is None else MegatronRampup(
        gbs, s.micro_batch_size, dp, *s.rampup_batch_size)
    if s.step_batch_size_schedule is not None:  # sample-based: gbs is not read
        rampup = MegatronSteps(s.step_batch_size_schedule, s.micro_batch_size, dp)
    iters = s.train_iters or megatron_train_iters(s.train_samples, gbs, rampup)
    scheduler = megatron_scheduler(s, iters, gbs)
    decoupled = None if s.decoupled_lr is None else {
        'max_lr': s.decoupled_lr,
        'min_lr': s.min_lr if s.decoupled_min_lr is None else s.decoupled_min_lr}
    consumed, rows = 0, []
    for _ in range(iters):
        if rampup is not None:
            rampup.update(consumed)
        micro = rampup.num_micro_batches if rampup else gbs // (s.micro_batch_size * dp)
        rows.append((consumed, micro, scheduler.get_lr({}),
                     None if decoupled is None else scheduler.get_lr(decoupled)))
        increment = micro * s.micro_batch_size * dp
        consumed += increment
        scheduler.num_steps += increment
    return rows


def ours(s: ScheduleConfig, dp: int) -> list[tuple[int, int, float, float | None]]:
    batches = BatchSchedule.from_config(s, dp)
    iters = batches.train_iterations(s)
    schedule = LRSchedule.from_config(s, iters, batches.global_batch_size)
    consumed, rows = 0, []
    for _ in range(iters):
        rows.append((consumed, batches.micro_batches(consumed), *schedule.rates(consumed)))
        consumed += batches.global_batch(consumed)
    return rows


SCHEDULES = {
    "iters-warmup-cosine": dict(train_iters=40, global_batch_size=12, lr_warmup_iters=5,
                                lr_decay_iters=30, lr_decay_style="cosine"),
    "iters-fraction-linear": dict(train_iters=37, global_batch_size=6, lr_warmup_fraction=0.13,
                                  lr_decay_style="linear"),
    "samples-warmup-cosine": dict(train_samples=1000, global_batch_size=12,
                                  lr_warmup_samples=50, lr_decay_samples=900,
                                  lr_decay_style="cosine"),
    "samples-fraction-linear": dict(train_samples=777, global_batch_size=6,
                                    lr_warmup_fraction=0.07, lr_decay_style="linear"),
    "samples-decoupled": dict(train_samples=500, global_batch_size=10, lr_warmup_samples=33,
                              lr_decay_style="cosine", decoupled_lr=5e-3,
                              decoupled_min_lr=4.5e-4),
    "samples-decoupled-default-min": dict(train_samples=300, global_batch_size=10,
                                          lr_decay_style="linear", decoupled_lr=2e-3),
    "iters-decoupled-constant": dict(train_iters=20, global_batch_size=4, lr_warmup_iters=3,
                                     lr_decay_style="constant", decoupled_lr=5e-4),
    "rampup": dict(train_samples=1000, global_batch_size=24, rampup_batch_size=[6, 6, 301],
                   lr_warmup_samples=40, lr_decay_style="cosine"),
    "rampup-uneven-samples": dict(train_samples=431, global_batch_size=18,
                                  rampup_batch_size=[2, 4, 100], lr_decay_samples=400,
                                  lr_decay_style="linear", decoupled_lr=1e-2),
    "rampup-short": dict(train_samples=100, global_batch_size=8, rampup_batch_size=[2, 2, 1],
                         lr_decay_style="cosine"),
    "steps": dict(train_samples=433, step_batch_size_schedule=[[0, 6], [37, 12], [100, 24]],
                  lr_warmup_samples=40, lr_decay_style="cosine"),
    "steps-overrun": dict(train_samples=101, step_batch_size_schedule=[[0, 2], [7, 10]],
                          lr_decay_samples=90, lr_decay_style="linear", decoupled_lr=1e-2),
    "steps-one": dict(train_samples=50, step_batch_size_schedule=[[0, 4]],
                      lr_decay_style="cosine"),
    **{f"wsd-samples-{style}": dict(train_samples=600, global_batch_size=10,
                                    lr_warmup_samples=20, lr_decay_style="WSD",
                                    lr_wsd_decay_samples=170, lr_wsd_decay_style=style)
       for style in ("linear", "cosine", "exponential", "minus_sqrt")},
    "wsd-iters": dict(train_iters=50, global_batch_size=4, lr_warmup_iters=4, lr_decay_style="WSD",
                      lr_wsd_decay_iters=13, lr_wsd_decay_style="cosine"),
}


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_equals_megatron_step_by_step(name, dp):
    """Every iteration's consumed samples, micro-batches, LR and decoupled LR are Megatron's,
    exactly (the same float operations)."""
    s = ScheduleConfig(micro_batch_size=1, lr=3e-3, min_lr=3e-4, **SCHEDULES[name])
    want, got = megatron_run(s, dp), ours(s, dp)
    assert len(got) == len(want) > 0
    for iteration, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"iteration {iteration + 1}: ours {a}, Megatron-LM's {b}"


@pytest.mark.parametrize("text, seq_length", [
    ("0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048),  # Megatron-LM's GPT-3 175B
    ("0:768,250B:1536 500B:3072 750B:6144", 4096),
    ("1.5k:16 0:8 3M:24 0.5T:32", 1000),
    ("0:2 63:4 64:6", 64),
])
def test_step_schedule_text_reads_as_megatron_reads_it(text, seq_length):
    from megadomino.config.batches import parse_step_schedule
    assert [tuple(pair) for pair in parse_step_schedule(text, seq_length)] == \
        MegatronSteps.parse(text, seq_length)


def test_step_schedule_with_train_iters_counts_lr_in_its_last_batch():
    """A --train-iters run: each step takes its stage's batch, the LR lengths are iterations x
    the last batch (what --global-batch-size, when the script repeats it, says)."""
    s = ScheduleConfig(micro_batch_size=1, lr=3e-3, min_lr=3e-4, train_iters=12,
                       lr_warmup_iters=2, lr_decay_style="linear",
                       step_batch_size_schedule=[[0, 2], [9, 6]])
    batches = BatchSchedule.from_config(s, dp=1)
    assert batches.global_batch_size == 6 and batches.train_iterations(s) == 12
    consumed, sizes = 0, []
    for _ in range(12):
        sizes.append(batches.global_batch(consumed))
        consumed += sizes[-1]
    assert sizes == [2] * 5 + [6] * 7 and batches.samples_in(12) == consumed
    schedule, reference = LRSchedule.from_config(s, 12, 6), megatron_scheduler(s, 12, 6)
    for n in (0, 6, 12, 30, 72):
        reference.num_steps = n
        assert schedule.rates(n)[0] == reference.get_lr({})


def test_rampup_batches_grow_then_hold():
    batches = BatchSchedule.from_config(ScheduleConfig(
        micro_batch_size=1, global_batch_size=24, rampup_batch_size=[6, 6, 301],
        train_samples=1000), dp=2)
    # three increments, one every 301 / 3 samples
    sizes = [batches.global_batch(c) for c in (0, 100, 101, 200, 201, 302)]
    assert sizes == [6, 6, 12, 12, 18, 24]
    assert batches.samples_in(3) == 6 + 6 + 6


# ---- the loop --------------------------------------------------------------------------------

RAMPUP = ["--model-preset", "gpt-tiny", "--seq-length", "16", "--mock-data",
          "--micro-batch-size", "2", "--global-batch-size", "8", "--train-samples", "60",
          "--rampup-batch-size", "2", "2", "20", "--lr", "4e-3", "--min-lr", "4e-4",
          "--lr-warmup-samples", "6", "--lr-decay-style", "cosine", "--decoupled-lr", "1e-2",
          "--log-interval", "100", "--eval-interval", "1000", "--eval-iters", "0"]


class RecordingData(MockDataset):
    """Mock data that remembers which samples were read, in order."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: list[int] = []

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int):
        self.read.append(index)
        return super().__getitem__(index)


def _run(*extra: str) -> tuple[dict, RecordingData]:
    config, _ = parse_args([*RAMPUP, *extra], "gpt")
    data = RecordingData(16, config.model.vocab_size, 1234)
    run = train(config, ParallelDims(tp=1), "gpt", log=lambda line: None, train_data=data)
    return run, data


def test_loop_follows_rampup_and_sample_schedule():
    """The LRs the loop set are the reference's; each iteration read the next global batch of
    the ramp, in order; the decoupled groups ran at their own LR."""
    run, data = _run()
    config, _ = parse_args(RAMPUP, "gpt")
    want = megatron_run(config.train.schedule, dp=1)
    assert run["lrs"] == [lr for _, _, lr, _ in want]
    assert run["state"].consumed_train_samples == sum(m * 2 for _, m, _, _ in want)
    assert data.read == list(range(run["state"].consumed_train_samples))
    groups = run["optimizer"].optimizer.optimizer.param_groups
    assert {group.get("decoupled", False): group["lr"] for group in groups} == {
        False: want[-1][2], True: want[-1][3]}


def test_resume_inside_the_rampup_repeats_the_run(tmp_path):
    """Stopped inside the ramp (--exit-interval), saved and resumed: the same losses and LRs."""
    straight, _ = _run()
    first, _ = _run("--save", str(tmp_path), "--exit-interval", "3")
    second, _ = _run("--load", str(tmp_path), "--save", str(tmp_path))
    assert first["state"].iteration == 3
    assert first["losses"] + second["losses"] == straight["losses"]
    assert first["lrs"] + second["lrs"] == straight["lrs"]


STEPS = [*RAMPUP[:RAMPUP.index("--global-batch-size")], "--train-samples", "60",
         "--step-batch-size-schedule", "0:2 64:4 160:8", "--lr", "4e-3", "--min-lr", "4e-4",
         "--lr-warmup-samples", "6", "--lr-decay-style", "cosine", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "0"]
"""16-token sequences: the batch is 2 from sample 0, 4 from sample 4, 8 from sample 10."""


def _run_steps(*extra: str) -> tuple[dict, RecordingData, list[str]]:
    config, _ = parse_args([*STEPS, *extra], "gpt")
    data, lines = RecordingData(16, config.model.vocab_size, 1234), []
    run = train(config, ParallelDims(tp=1), "gpt", log=lines.append, train_data=data)
    return run, data, lines


def test_loop_follows_the_stepped_schedule_and_logs_each_batch():
    """The loop's LRs and batches are Megatron's; it read every sample once, in order; each log
    line names the iteration's global batch."""
    run, data, lines = _run_steps()
    config, _ = parse_args(STEPS, "gpt")
    want = megatron_run(config.train.schedule, dp=1)
    assert run["lrs"] == [lr for _, _, lr, _ in want]
    assert run["state"].consumed_train_samples == sum(m * 2 for _, m, _, _ in want) == 60
    assert data.read == list(range(60))
    logged = [int(b) for b in re.findall(r"\| global batch (\d+) \|", "\n".join(lines))]
    assert logged == [2, 2, 4, 4, 8, 8, 8, 8, 8, 8]
    assert any("stepped: 2 from sample 0, 4 from sample 4, 8 from sample 10" in line
               for line in lines)


def test_resume_inside_a_step_repeats_the_run(tmp_path):
    """Stopped in the batch-4 stage (--exit-interval 3), saved and resumed: the same losses,
    LRs and batches as the run that was not interrupted."""
    straight, _, _ = _run_steps()
    first, _, _ = _run_steps("--save", str(tmp_path), "--exit-interval", "3")
    second, _, lines = _run_steps("--load", str(tmp_path), "--save", str(tmp_path))
    assert first["state"].iteration == 3 and first["state"].consumed_train_samples == 8
    assert first["losses"] + second["losses"] == straight["losses"]
    assert first["lrs"] + second["lrs"] == straight["lrs"]
    assert re.search(r"iteration +4/ +10 \| .*\| global batch 4 \|", "\n".join(lines))
