"""The log line, TensorBoard scalars and the NaN stop, for the training loop.

Each iteration's loss and grad norm stay device tensors until a log boundary (no host sync per
step); there the interval's losses are averaged over DP in one all-reduce, checked for NaN/inf
(every rank sees the same DP mean, so every rank stops alike), and rank 0 logs one line and writes
the scalars. Rank 0 adds a second line from the data-parallel engine (every ZeRO stage, 0
included): what it holds per GPU and, at DP > 1, the bytes per training step it handed to
collectives inside and across nodes (evaluation and checkpoint traffic left out). When the loop
ends (at its last iteration or an early stop, not on an error) rank 0 says how the run went in one
line, `run ended: ...`.

With pipeline stages the schedule runs the micro-batches' forwards and backwards interleaved: it
times each under its phase and the stage's waits (for transfers, and for the reductions after
the schedule) under `wait` (pipeline/executor.py, pipeline/runtime.py), so rank 0's `forward` and
`backward` are its stage's compute. The line adds every stage's compute (forward + backward) and
wait per iteration, each the mean over the stage's ranks: one all-gather of two numbers a rank
per log line. On a GPU these are times on the stream (train/timers.py), read without a further
synchronization: a wait is the stream's stall on a transfer, and a compute includes the stream's
idle gaps while the host is still launching the compute's kernels (a host-bound stage reads
more compute than its kernels take).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch

from megadomino.distributed import ParallelDims, comm
from megadomino.train.checkpoint import checkpoint_dir
from megadomino.train.metrics import peak_memory_gib, throughput
from megadomino.train.step import dp_mean
from megadomino.train.tensorboard import ScalarWriter
from megadomino.train.timers import Timers
from megadomino.zero import ZeroPlusPlus
from megadomino.zero.loss_scaler import StepResult

PHASES = ("data", "forward", "backward", "optimizer")
ZERO_HELD = ("params", "masters", "optimizer_state", "grad_shards")
"""memory_stats() entries the engine holds for the whole run."""
ZERO_SCALARS = ("zero_intra_mb_per_iter", "zero_inter_mb_per_iter", "zero_held_mib",
                "zero_transient_peak_mib")


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite: the run stops."""


class Reporter:
    """Collects per-iteration values into `history` and reports at log boundaries."""

    def __init__(self, history: dict, dims: ParallelDims, device: torch.device,
                 log: Callable[[str], None], iters: int, flops_per_iteration: float,
                 global_batch: int, seq_length: int, peak_tflops: float | None, timers: Timers,
                 writer: ScalarWriter | None, zero: ZeroPlusPlus):
        self.history, self.dims, self.device, self.log = history, dims, device, log
        self.iters, self.flops = iters, flops_per_iteration
        self.global_batch, self.peak_tflops = global_batch, peak_tflops
        self.tokens = global_batch * seq_length  # a full batch's; flops_per_iteration likewise
        self.timers, self.writer, self.zero = timers, writer, zero
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []
        self.results: list[StepResult] = []  # the interval's steps (skips read at flush)
        self.skipped = 0
        self.batches: list[int] = []  # the interval's global batches
        self.start = self.began = time.perf_counter()
        self.excluded = 0.0
        self.timed_seconds = 0.0  # the run's iterations, evaluation and checkpoints left out
        self.timed_tokens = 0
        self.excluded_bytes = {"intra": 0, "inter": 0}
        zero.comm.reset()  # the counts start with training, not with a checkpoint load

    def record(self, loss: torch.Tensor, result: StepResult, lr: float,
               batch: int) -> None:
        """One iteration's values; `batch`: its global batch, which scales its tokens and FLOPs
        against the full one's (below 1 during a ramp-up or a stepped schedule's early steps)."""
        self.losses.append(loss)
        self.batches.append(batch)
        no_norm = torch.full((), math.nan, device=self.device)
        self.norms.append(no_norm if result.grad_norm is None else result.grad_norm)
        self.results.append(result)  # its skip may be pending: read at the flush
        self.history["lrs"].append(lr)

    @contextlib.contextmanager
    def outside_training(self) -> Iterator[None]:
        """Evaluation, saving: time (and ZeRO bytes) that the per-iteration figures must not
        count."""
        began, before = time.perf_counter(), self._zero_bytes()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - began
            after = self._zero_bytes()
            for side in self.excluded_bytes:
                self.excluded_bytes[side] += after[side] - before[side]

    def _zero_bytes(self) -> dict[str, int]:
        return self.zero.comm.totals()

    def check_finite(self, iteration: int) -> list[float]:
        """The DP-mean losses since the last log line; NonFiniteLossError (on every rank) naming
        the first iteration whose loss is NaN or infinite."""
        losses = dp_mean(torch.stack(self.losses), self.dims).tolist() if self.losses else []
        for offset, loss in enumerate(losses):
            if not math.isfinite(loss):
                bad = iteration - len(losses) + 1 + offset
                raise NonFiniteLossError(f"the loss is {loss} at iteration {bad}: stopping the run "
                                         "(lower --lr, or check the data and the precision)")
        return losses

    def flush(self, iteration: int) -> None:
        """Log: the interval's mean loss, the current lr and grad norm, mean time per iteration,
        and the per-phase times; the engine's memory and bytes per iteration."""
        losses = self.check_finite(iteration)
        norms = torch.stack(self.norms).tolist()
        self.skipped = sum(result.skipped for result in self.results)
        self.history["skipped_iterations"] += self.skipped
        self.history["losses"] += losses
        self.history["grad_norms"] += norms
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        count = len(losses)
        elapsed = time.perf_counter() - self.start - self.excluded
        seconds = elapsed / count
        self.timed_seconds += elapsed
        self.timed_tokens += self.tokens * sum(self.batches) // self.global_batch
        fraction = sum(self.batches) / count / self.global_batch
        metrics = throughput(self.flops * fraction, self.tokens * fraction, seconds,
                             self.dims.world_size, self.peak_tflops)
        metrics.update(loss=sum(losses) / count, lr=self.history["lrs"][-1],
                       grad_norm=norms[-1], ms_per_iter=1e3 * seconds,
                       global_batch=self.batches[-1],
                       peak_memory_gib=peak_memory_gib(self.device))
        phases = self.timers.flush()
        metrics.update({f"{phase}_ms": 1e3 * phases.get(phase, 0.0) / count for phase in PHASES})
        if self.dims.pp > 1:
            metrics["stage_ms"] = self._stage_times(phases, count)
        metrics.update(self._zero_metrics(count))
        scaler = self.zero.loss_scaler
        scale = scaler.scale if scaler is not None else None
        self.history["metrics"] = metrics
        if self.dims.rank == 0:
            self.log(self._line(iteration, metrics, scale))
            self.log(self._zero_line(metrics))
        if self.writer is not None:
            first = iteration - count + 1
            for offset, loss in enumerate(losses):
                self.writer.write({"train/loss": loss}, first + offset)
            scalars = {"train/lr": metrics["lr"], "train/grad_norm": metrics["grad_norm"],
                       "throughput/tokens_per_s": metrics["tokens_per_s"],
                       "throughput/ms_per_iter": metrics["ms_per_iter"],
                       "memory/peak_gib": metrics["peak_memory_gib"],
                       **{f"timers/{phase}_ms": metrics[f"{phase}_ms"] for phase in PHASES}}
            for stage, (compute, wait) in enumerate(metrics.get("stage_ms", ())):
                scalars[f"timers/stage{stage}_compute_ms"] = compute
                scalars[f"timers/stage{stage}_wait_ms"] = wait
            if scale is not None:
                scalars["train/loss_scale"] = scale
            if self.device.type == "cuda":
                scalars["throughput/tflops_per_gpu"] = metrics["tflops_per_gpu"]
            scalars.update({f"zero/{key.removeprefix('zero_')}": metrics[key]
                            for key in ZERO_SCALARS})
            self.writer.write(scalars, iteration)
        self.losses, self.norms, self.skipped, self.batches = [], [], 0, []
        self.results = []
        self.start, self.excluded = time.perf_counter(), 0.0
        self.excluded_bytes = {"intra": 0, "inter": 0}

    def _stage_times(self, phases: dict[str, float], count: int) -> list[tuple[float, float]]:
        """Each pipeline stage's (compute, wait) in ms per iteration over `count` iterations:
        its ranks' mean of forward + backward and of wait. Collective over the world."""
        mine = torch.tensor([phases.get("forward", 0.0) + phases.get("backward", 0.0),
                             phases.get("wait", 0.0)], dtype=torch.float64, device=self.device)
        gathered = mine.new_empty(2 * self.dims.world_size)
        comm.all_gather_single(gathered, mine)
        per_rank = gathered.view(-1, 2).tolist()  # [rank] -> [compute, wait], seconds
        return [tuple(1e3 * sum(per_rank[rank][kind] for rank in ranks) / len(ranks) / count
                      for kind in (0, 1))
                for ranks, _ in self.dims.stages]

    def _zero_metrics(self, count: int) -> dict[str, float]:
        """This rank's data-parallel bytes per iteration since the last flush (then reset) and
        the memory the engine holds, in GiB."""
        totals = self.zero.comm.totals()
        self.zero.comm.reset()
        memory = self.zero.memory_stats()
        held = sum(memory[key] for key in ZERO_HELD)
        return {"zero_intra_mb_per_iter": (totals["intra"] - self.excluded_bytes["intra"])
                / count / 1e6,
                "zero_inter_mb_per_iter": (totals["inter"] - self.excluded_bytes["inter"])
                / count / 1e6,
                "zero_held_mib": held / 2**20,
                "zero_transient_peak_mib": memory["transient_peak"] / 2**20,
                **{f"zero_{key}_mib": memory[key] / 2**20 for key in ZERO_HELD}}

    def _zero_line(self, metrics: dict) -> str:
        stage = self.zero.config.stage
        parts = ", ".join(f"{key.replace('_', ' ')} {metrics[f'zero_{key}_mib']:.1f}"
                          for key in ZERO_HELD)
        line = (f" ZeRO-{stage} per rank: held {metrics['zero_held_mib']:.1f} MiB ({parts}), "
                f"transient peak {metrics['zero_transient_peak_mib']:.1f} MiB")
        if self.dims.dp == 1:  # no data-parallel traffic to count
            return line
        return (line + f" | per iteration: {metrics['zero_intra_mb_per_iter']:.2f} MB "
                f"intra-node, {metrics['zero_inter_mb_per_iter']:.2f} MB inter-node")

    def _line(self, iteration: int, metrics: dict, scale: float | None) -> str:
        # TFLOP/s is a GPU figure, MFU one against a known peak; on CPU they say nothing.
        flops = (f"{metrics['tflops_per_gpu']:.2f} TFLOP/s/GPU | "
                 if self.device.type == "cuda" else "")
        if flops and "mfu" in metrics:
            flops += f"MFU {100 * metrics['mfu']:.2f}% | "
        line = (f" iteration {iteration:8d}/{self.iters:8d} | loss {metrics['loss']:.6E} | "
                f"lr {metrics['lr']:.3E} | global batch {metrics['global_batch']} | "
                f"grad norm {metrics['grad_norm']:.3f} | "
                f"{metrics['ms_per_iter']:.1f} ms/iter | "
                f"{metrics['tokens_per_s']:.0f} tokens/s | {flops}"
                f"peak mem {metrics['peak_memory_gib']:.2f} GiB")
        if scale is not None:
            line += f" | loss scale {scale:.1f} | skipped {self.skipped}"
        elif self.skipped:  # the engine skips a step whose gradients hold inf/NaN
            line += f" | skipped {self.skipped}"
        line += " | time (ms): " + " ".join(
            f"{phase} {metrics[f'{phase}_ms']:.1f}" for phase in PHASES)
        if "stage_ms" in metrics:
            line += " | pipeline (ms): " + " | ".join(
                f"stage {stage} compute {compute:.1f} wait {wait:.1f}"
                for stage, (compute, wait) in enumerate(metrics["stage_ms"]))
        return line

    def validation(self, iteration: int, loss: float) -> None:
        ppl = math.exp(min(20.0, loss))
        self.history["eval"].append({"iteration": iteration, "loss": loss, "ppl": ppl})
        if self.dims.rank == 0:
            self.log(f" validation at iteration {iteration} | loss {loss:.6E} | ppl {ppl:.6E}")
        if self.writer is not None:
            self.writer.write({"valid/loss": loss, "valid/ppl": ppl}, iteration)

    def finish(self, iteration: int, save: str | None, tensorboard_dir: str | None) -> None:
        """Rank 0's last line, once the loop ended (at its last iteration or an early stop):
        `iteration` its last. The loop saves at its last iteration whenever `save` (--save) is
        given, so a run of at least one iteration wrote `checkpoint_dir(save, iteration)`."""
        if self.dims.rank == 0:
            self.log(self.end_line(iteration, save, tensorboard_dir))

    def end_line(self, iteration: int, save: str | None, tensorboard_dir: str | None) -> str:
        """The iterations this process ran (of the run's), wall time since training began, mean
        tokens/s over the timed iterations, the last log interval's mean loss, the last
        validation loss, the last checkpoint and the TensorBoard directory, the last three where
        there are some. No `iteration N/M`: log parsers take that for an iteration's line."""
        ran = len(self.history["losses"])
        wall = time.perf_counter() - self.began
        span = (f"iterations {iteration - ran + 1}-{iteration}" if ran > 1
                else f"iteration {iteration}" if ran else f"no iteration left at {iteration}")
        head = f" run ended: {span} of {self.iters} in {wall:.1f} s"
        if self.timed_seconds > 0:
            head += f", {self.timed_tokens / self.timed_seconds:.0f} tokens/s"
        parts = [head]
        if self.history["exit_reason"] is not None:
            parts.append(f"stopped early: {self.history['exit_reason']}")
        if ran:
            parts.append(f"train loss {self.history['metrics']['loss']:.6E}")
        if self.history["eval"]:
            last = self.history["eval"][-1]
            parts.append(f"validation loss {last['loss']:.6E} (iteration {last['iteration']})")
        if save and ran:
            parts.append(f"checkpoint {checkpoint_dir(save, iteration)}")
        if tensorboard_dir:
            parts.append(f"TensorBoard events in {tensorboard_dir}")
        return " | ".join(parts)
