"""The training loop: micro-batch accumulation, overlapped DP reduce, mixed precision, eval,
checkpoints, early stops, logs.

One iteration consumes one global batch of `global_batch_size` samples: `global_batch_size //
(micro_batch_size * dp)` micro-batches per rank, each a forward and a backward of the mean loss
over its loss-mask tokens divided by the number of micro-batches (times the loss scale in fp16).
All but the last backward run under `no_sync()`; the last launches the DP reduction unit by unit
while backward proceeds. Then clip and AdamW step (`train.step`; its docstring gives the
sampler: DP ranks never read the same sample in a step).

The data-parallel engine is `megadomino.zero.ZeroPlusPlus` at the stage --zero-stage names (0,
plain data parallelism, by default; --use-distributed-optimizer is stage 1): stage 0 all-reduces
gradient buckets and steps AdamW on whole fp32 masters, stage 1 reduce-scatters the gradients,
steps AdamW on this DP rank's chunk of the masters and all-gathers the weights, stage 3 gathers
each layer just before use, with ZeRO++'s qwZ, hpZ and qgZ as the --zeropp-* flags say. It is
built after the Domino auto-tune and after --load's weights went into the whole model, which it
then takes over; its optimizer state loads after that (`checkpoint.load_optimizer_state`).

After each iteration, in Megatron-LM's order: the log line at --log-interval (`train.report`:
NaN stop, timers, TensorBoard), validation at --eval-interval, a checkpoint at --save-interval, at
the end of the run and when an early stop (`train.stopping`) ends it. A checkpoint becomes the
latest (`latest_checkpointed_iteration.txt`) only once a forward pass from its weights gave a
finite loss: a diverged step stops the run with the previous checkpoint still the one a requeued
job resumes (`_save`). `--load` resumes from
the counters, optimizer and RNG states a checkpoint holds (and the pipeline codecs' state), so
that a resumed run repeats the uninterrupted one's losses exactly (`train.checkpoint`).

The device is the current CUDA device when CUDA is available, else the CPU; whoever initialised
the process group chose the backend to match.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from torch import nn

from megadomino.config import CheckpointConfig, Config
from megadomino.distributed import ParallelDims
from megadomino.models import elementwise
from megadomino.overlap.cuda_graph import release_layers
from megadomino.train.checkpoint import (
    TRACKER,
    AsyncCheckpointer,
    CodecState,
    TrainingState,
    checkpoint_dir,
    latest_iteration,
    promote_checkpoint,
    save_checkpoint,
)
from megadomino.train.manual_gc import ManualGC
from megadomino.train.profiling import ProfileWindow
from megadomino.train.progress import Progress
from megadomino.train.report import NonFiniteLossError
from megadomino.train.run import ModelInit, Run, build_run
from megadomino.train.step import Dataset
from megadomino.train.stopping import StopConditions
from megadomino.zero import ZeroPlusPlus

__all__ = ["ModelInit", "compile_line", "train"]


def train(config: Config, dims: ParallelDims, family: str = "gpt",
          log: Callable[[str], None] = print, train_data: Dataset | None = None,
          valid_data: Dataset | None = None, model_init: ModelInit | None = None,
          data_description: str | None = None) -> dict:
    """Train a `family` model ('gpt' or 'llama') as `config` says; lines go to `log` on rank 0.

    Without `train_data`, both datasets are `MockDataset` splits (`config.train.data.mock_data`);
    with it, `valid_data` None means no evaluation.
    `model_init` replaces `build_model` (say, to start from Hugging Face weights); it runs after
    the RNGs are seeded and before `--load`; with pipeline stages it returns this rank's stage
    (build_stage's, of run_plan's plan). `data_description` names the data in the start-up
    summary (default: mock data, or the dataset's type and length). Returns per-iteration lists
    `losses` (DP-averaged), `lrs`, `grad_norms` (nan when a step was skipped), `eval`
    ({iteration, loss, ppl} dicts), `skipped_iterations`, the last interval's `metrics`,
    `exit_reason` (None, or why an early stop ended the run), the final TrainingState `state`,
    the `model` and the `optimizer` (the ZeroPlusPlus engine: at stage 3 the model's parameters
    are empty outside a forward, its `full_state_dict()` gathers them). Raises
    NonFiniteLossError (every rank) when the loss becomes NaN or infinite.
    """
    run = build_run(config, dims, family, log, train_data, valid_data, model_init,
                    data_description)
    checkpoint, runtime = run.config.train.checkpoint, run.config.train.runtime
    profile = ProfileWindow(run.config.train.logging, dims.rank, log)
    saver = (AsyncCheckpointer(checkpoint.save, dims, log)
             if checkpoint.async_save and checkpoint.save else None)
    try:
        with StopConditions(runtime, run.reporter.device) as stop, \
                ManualGC(runtime) as manual_gc:
            first = run.state.iteration + 1
            for iteration in range(first, run.iters + 1):
                reason = _iteration(run, iteration, iteration == first, stop, manual_gc,
                                    profile, saver)
                if reason is not None:
                    run.history["exit_reason"] = reason
                    if dims.rank == 0:
                        log(f" stopping: {reason}")
                    break
        if saver is not None:
            saver.finish()
        run.reporter.finish(run.state.iteration, checkpoint.save,
                            run.config.train.logging.tensorboard_dir)
    except NonFiniteLossError:  # raised on every rank alike: the save in flight can finish
        if saver is not None:
            saver.finish()
        raise
    finally:
        if saver is not None:
            saver.close()
        if run.config.parallel.enable_cuda_graph:
            release_layers(run.model)  # before the process group goes: the graphs hold NCCL's
        profile.close()
        if run.writer is not None:
            run.writer.close()
    return run.history


def _iteration(run: Run, iteration: int, first: bool, stop: StopConditions,
               manual_gc: ManualGC, profile: ProfileWindow,
               saver: AsyncCheckpointer | None) -> str | None:
    """One training iteration and what follows it in Megatron-LM's order (module docstring);
    the early stop's reason, or None."""
    state, config, dims = run.state, run.config, run.dims
    batch = run.batches.global_batch(state.consumed_train_samples)
    profile.before(iteration)
    loss, result = run.step.train(run.train_data, state.consumed_train_samples,
                                  run.batches.micro_batches(state.consumed_train_samples),
                                  before_step=run.lr.set)
    profile.after(iteration)
    state.iteration = iteration
    state.consumed_train_samples += batch
    run.lr.stepped(result, batch)
    run.reporter.record(loss, result, run.lr.lr, batch)
    if saver is not None:
        saver.poll()
    if first and config.parallel.compile_layer_pieces and dims.rank == 0:
        run.log(compile_line())
    manual_gc.after_iteration(iteration)
    reason = stop.reason(iteration)
    last = iteration == run.iters or reason is not None
    if iteration % config.train.logging.log_interval == 0 or last:
        run.reporter.flush(iteration)
    schedule = config.train.schedule
    if run.valid_data is not None and schedule.eval_iters > 0 and schedule.eval_interval > 0 \
            and (iteration % schedule.eval_interval == 0 or iteration == run.iters):
        _evaluate(run, iteration, manual_gc)
    checkpoint = config.train.checkpoint
    interval = checkpoint.save_interval
    if checkpoint.save and (last or interval and iteration % interval == 0):
        run.lr.settle()  # the saved schedule state counts this step's skip
        run.reporter.check_finite(iteration)  # never save a diverged model
        with run.reporter.outside_training():
            _save(checkpoint, state, run.model, run.engine, dims, run.log,
                  functools.partial(run.step.probe, run.train_data,
                                    state.consumed_train_samples - batch), saver,
                  codec=run.step.pipeline.codec)
    if last:
        run.lr.settle()
    return reason


def _evaluate(run: Run, iteration: int, manual_gc: ManualGC) -> None:
    """Validation over --eval-iters batches, outside the training timers."""
    eval_iters = run.config.train.schedule.eval_iters
    with run.reporter.outside_training(), manual_gc.evaluation():
        progress = Progress(run.log if run.dims.rank == 0 else None,
                            f"validation at iteration {iteration}", eval_iters, "batches")
        valid_loss = run.step.evaluate(run.valid_data, run.state.consumed_valid_samples,
                                       eval_iters, progress.tick)
    run.state.consumed_valid_samples += eval_iters * run.batches.global_batch_size
    run.reporter.validation(iteration, valid_loss)


def _save(config: CheckpointConfig, state: TrainingState, model: nn.Module,
          engine: ZeroPlusPlus, dims: ParallelDims, log: Callable[[str], None],
          probe: Callable[[], float], saver: AsyncCheckpointer | None = None,
          codec: CodecState | None = None) -> None:
    """Save, then promote the checkpoint to latest once a forward pass from the saved weights
    (`probe`: the last batch again) gives a finite loss. The step that produced the weights may
    have diverged though its own loss, taken before it, was finite: then NonFiniteLossError, and
    the iteration file keeps naming the last good checkpoint, which a requeued job resumes.
    With `saver` (--async-save) the files are written in the background from a snapshot taken
    here, and the promotion waits for them (`AsyncCheckpointer`). `codec`: the pipeline
    codecs, whose state the checkpoint holds (the probe leaves it untouched)."""
    if dims.rank == 0:  # a large checkpoint takes minutes
        log(f" saving checkpoint {checkpoint_dir(config.save, state.iteration)}")
    options = dict(save_rng=not config.no_save_rng, save_optim=not config.no_save_optim,
                   codec=codec)
    if saver is not None:
        path = saver.start(state, model, engine, **options)
    else:
        path = save_checkpoint(config.save, state, model, engine, dims, promote=False,
                               megatron_dist=config.ckpt_format == "torch_dist", **options)
    loss = probe()
    if not math.isfinite(loss):
        if saver is not None:
            saver.finish()  # its files complete, not promoted
        previous = latest_iteration(config.save)
        raise NonFiniteLossError(
            f"the weights saved at iteration {state.iteration} give the loss {loss} (the step "
            f"after the last finite loss diverged): stopping the run; {path} is kept but not "
            f"made the latest, {TRACKER} still names "
            + (f"iteration {previous}" if previous is not None else "no checkpoint")
            + " (lower --lr, or check the data and the precision)")
    if saver is not None:
        saver.promote()
        return
    promote_checkpoint(config.save, state.iteration, dims)
    if dims.rank == 0:
        log(f" saved checkpoint {path} (iteration {state.iteration})")


def compile_line() -> str:
    """What compiling the layer pieces cost, printed after the first step (which compiles them)."""
    seconds = elementwise.compile_seconds()
    spent = "" if seconds is None else f" in {seconds:.1f} s"
    return f" compiled the layer pieces (torch.compile){spent} during the first step"
