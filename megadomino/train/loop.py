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
the counters, optimizer and RNG states a checkpoint holds, so that a resumed run repeats the
uninterrupted one's losses exactly (`train.checkpoint`).

The device is the current CUDA device when CUDA is available, else the CPU; whoever initialised
the process group chose the backend to match.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from megadomino import overlap
from megadomino.build import build_model
from megadomino.config import CheckpointConfig, Config, ConfigError, ParallelConfig
from megadomino.config.batches import BatchSchedule, sample_counts
from megadomino.config.validate import validate
from megadomino.data.cyclic import loader_order
from megadomino.data.mock import MockDataset
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.models import elementwise
from megadomino.overlap.cuda_graph import capture_layers, release_layers
from megadomino.overlap.domino.autotune import autotune_domino
from megadomino.pipeline.runtime import PipelineRuntime, plan_from_config
from megadomino.pipeline.stage import build_stage
from megadomino.train.checkpoint import (
    TRACKER,
    AsyncCheckpointer,
    CheckpointError,
    TrainingState,
    checkpoint_dir,
    latest_iteration,
    load_checkpoint,
    load_optimizer_state,
    promote_checkpoint,
    save_checkpoint,
)
from megadomino.train.lr_schedule import LRSchedule
from megadomino.train.manual_gc import ManualGC
from megadomino.train.metrics import num_floating_point_operations, peak_tflops
from megadomino.train.profiling import ProfileWindow
from megadomino.train.progress import Progress
from megadomino.train.report import NonFiniteLossError, Reporter
from megadomino.train.step import Dataset, Stepper
from megadomino.train.stopping import StopConditions
from megadomino.train.summary import count_parameters, startup_lines
from megadomino.train.tensorboard import open_writer
from megadomino.train.timers import Timers
from megadomino.zero import ZeroPlusPlus
from megadomino.zero.loss_scaler import StepResult
from megadomino.zero.optimizer import build_engine

ModelInit = Callable[[Config, ParallelDims], nn.Module]
"""Builds this rank's model from the resolved config (default: `build_model` of the family)."""


def train(config: Config, dims: ParallelDims, family: str = "gpt",
          log: Callable[[str], None] = print, train_data: Dataset | None = None,
          valid_data: Dataset | None = None, model_init: ModelInit | None = None,
          data_description: str | None = None) -> dict:
    """Train a `family` model ('gpt' or 'llama') as `config` says; lines go to `log` on rank 0.

    Without `train_data`, both datasets are `MockDataset` splits (`config.train.data.mock_data`);
    with it, `valid_data` None means no evaluation.
    `model_init` replaces `build_model` (say, to start from Hugging Face weights); it runs after
    the RNGs are seeded and before `--load`; with pipeline stages it returns this rank's stage
    (build_stage's, of plan_from_config's plan). `data_description` names the data in the start-up
    summary (default: mock data, or the dataset's type and length). Returns per-iteration lists
    `losses` (DP-averaged), `lrs`, `grad_norms` (nan when a step was skipped), `eval`
    ({iteration, loss, ppl} dicts), `skipped_iterations`, the last interval's `metrics`,
    `exit_reason` (None, or why an early stop ended the run), the final TrainingState `state`,
    the `model` and the `optimizer` (the ZeroPlusPlus engine: at stage 3 the model's parameters
    are empty outside a forward, its `full_state_dict()` gathers them). Raises
    NonFiniteLossError (every rank) when the loss becomes NaN or infinite.
    """
    validate(config, dims.world_size, dims.gpus_per_node, data_given=train_data is not None)
    _check_grid(config.parallel, dims)
    train_config = config.train
    schedule_config, logging = train_config.schedule, train_config.logging
    checkpoint = train_config.checkpoint
    data_dp = config.parallel.data_parallel_size(dims.dp)
    batches = BatchSchedule.from_config(schedule_config, data_dp)
    gbs, iters = batches.global_batch_size, batches.train_iterations(schedule_config)
    num_micro = gbs // (batches.micro_batch_size * data_dp)
    mbs = schedule_config.micro_batch_size
    config = dataclasses.replace(config, model=config.model.replace(
        params_dtype=train_config.precision.params_dtype))
    model_config = config.model
    schedule = LRSchedule.from_config(schedule_config, iters, gbs)
    writer = open_writer(logging.tensorboard_dir, dims.rank)
    if data_description is None:
        data_description = ("mock data" if train_data is None else
                            f"{type(train_data).__name__} of {len(train_data)} samples")
    train_data, valid_data = _default_data(config, train_data, valid_data)
    train_samples, valid_samples, _ = sample_counts(schedule_config, data_dp)
    train_data = loader_order(train_data, train_config.data, mbs, data_dp, train_samples)
    valid_data = (loader_order(valid_data, train_config.data, mbs, data_dp, valid_samples)
                  if valid_samples else None)  # 0: the run never evaluates

    model_parallel_seed(train_config.runtime.seed, dims)
    stages = None  # the pipeline plan, with pipeline stages
    if dims.pp > 1:
        stages = plan_from_config(config.model, config.parallel, dims.world_size)
        model = model_init(config, dims) if model_init is not None else build_stage(
            config.model, dims, stages, family, parallel=config.parallel,
            fp8=train_config.precision.fp8, init_seed=train_config.runtime.seed)
    else:
        model = (model_init or (lambda c, d: _build_model(c, d, family)))(config, dims)
        overlap.apply(model, config.parallel)  # a model_init's model runs as the config says
    model.train()
    device = next(model.parameters()).device
    if config.parallel.domino_auto:  # before the engine hooks the parameters
        plan = autotune_domino(model, mbs, log)
        # the plan that runs; domino_auto stays, the summary says the plan was timed
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                          domino=plan))
    parameters = count_parameters(model, dims)  # whole, before ZeRO-3 partitions them
    if dims.rank == 0:
        for line in startup_lines(family, config, parameters, world=dims.world_size, tp=dims.tp,
                                  pp=dims.pp, dp=dims.dp, backend=dist.get_backend(),
                                  device=_device_name(device), global_batch=gbs,
                                  micro_batches=num_micro, iterations=iters,
                                  data=data_description, plan=stages,
                                  threads=torch.get_num_threads() if device.type == "cpu"
                                  else None):
            log(line)
    state = _resume(checkpoint, model, dims, log)  # the weights, before the engine takes them
    engine = build_engine(model, dims, config)
    if state.iteration > 0 and not checkpoint.no_load_optim:  # resumed a training run
        with _loading(checkpoint.load):
            load_optimizer_state(checkpoint.load, state.iteration, engine, dims, log)
    if config.parallel.enable_cuda_graph:
        # After the engine: it re-points the parameters into its flat buffers, and the graphs
        # read the parameters' storage as it is at capture.
        capture_layers(model, mbs, log=log)
    timers = Timers(device)
    pipeline = None if stages is None else PipelineRuntime(
        model, stages, dims, model_config, config.parallel, config.parallel.pipeline_schedule, mbs,
        num_micro)
    step = Stepper(model, engine, dims, mbs, num_micro, device, timers,
                   per_token_loss=schedule_config.calculate_per_token_loss, pipeline=pipeline)
    padded_vocab = model_config.padded_vocab_size(dims.tp)
    flops = num_floating_point_operations(model_config, gbs, padded_vocab)
    history = {"losses": [], "lrs": [], "grad_norms": [], "eval": [], "skipped_iterations": 0,
               "metrics": {}, "exit_reason": None, "state": state, "model": model,
               "optimizer": engine}
    reporter = Reporter(history, dims, device, log, iters, flops, gbs, model_config.seq_length,
                        peak_tflops(_device_name(device), logging.peak_tflops), timers,
                        writer, engine)

    eval_iters, eval_interval = schedule_config.eval_iters, schedule_config.eval_interval
    evaluating = valid_data is not None and eval_iters > 0 and eval_interval > 0
    profile = ProfileWindow(logging, dims.rank, log)
    saver = (AsyncCheckpointer(checkpoint.save, dims, log)
             if checkpoint.async_save and checkpoint.save else None)
    try:
        with StopConditions(train_config.runtime, device) as stop, \
                ManualGC(train_config.runtime) as manual_gc:
            first_iteration = state.iteration + 1
            # The LR schedule advances only on steps that were not skipped, and a step's skip
            # may be decided on the device (StepResult): the last step's is read when the next
            # one's LR is needed, after its forward and backward are enqueued, so the host never
            # waits for a step to finish before it launches the next.
            pending: list[tuple[StepResult, int]] = []
            lr = 0.0

            def settle() -> None:
                for done, samples in pending:
                    state.scheduler_steps += not done.skipped
                    state.scheduler_samples += 0 if done.skipped else samples
                pending.clear()

            def set_lr() -> None:
                nonlocal lr
                settle()
                lr, decoupled_lr = schedule.rates(state.scheduler_samples)
                engine.set_lr(lr, decoupled_lr)

            for iteration in range(first_iteration, iters + 1):
                batch = batches.global_batch(state.consumed_train_samples)
                profile.before(iteration)
                loss, result = step.train(train_data, state.consumed_train_samples,
                                          batches.micro_batches(state.consumed_train_samples),
                                          before_step=set_lr)
                profile.after(iteration)
                state.iteration = iteration
                state.consumed_train_samples += batch
                pending.append((result, batch))
                reporter.record(loss, result, lr, batch)
                if saver is not None:
                    saver.poll()
                if iteration == first_iteration and config.parallel.compile_layer_pieces \
                        and dims.rank == 0:
                    log(compile_line())
                manual_gc.after_iteration(iteration)
                reason = stop.reason(iteration)
                last = iteration == iters or reason is not None
                if iteration % logging.log_interval == 0 or last:
                    reporter.flush(iteration)
                if evaluating and (iteration % eval_interval == 0 or iteration == iters):
                    with reporter.outside_training(), manual_gc.evaluation():
                        progress = Progress(log if dims.rank == 0 else None,
                                            f"validation at iteration {iteration}",
                                            eval_iters, "batches")
                        valid_loss = step.evaluate(valid_data, state.consumed_valid_samples,
                                                   eval_iters, progress.tick)
                    state.consumed_valid_samples += eval_iters * gbs
                    reporter.validation(iteration, valid_loss)
                interval = checkpoint.save_interval
                if checkpoint.save and (last or interval and iteration % interval == 0):
                    settle()  # the saved schedule state counts this step's skip
                    reporter.check_finite(iteration)  # never save a diverged model
                    with reporter.outside_training():
                        _save(checkpoint, state, model, engine, dims, log,
                              functools.partial(step.probe, train_data,
                                                state.consumed_train_samples - batch), saver)
                if last:
                    settle()
                if reason is not None:
                    history["exit_reason"] = reason
                    if dims.rank == 0:
                        log(f" stopping: {reason}")
                    break
        if saver is not None:
            saver.finish()
        reporter.finish(state.iteration, checkpoint.save, logging.tensorboard_dir)
    except NonFiniteLossError:  # raised on every rank alike: the save in flight can finish
        if saver is not None:
            saver.finish()
        raise
    finally:
        if saver is not None:
            saver.close()
        if config.parallel.enable_cuda_graph:
            release_layers(model)  # before the process group goes: the graphs hold NCCL's
        profile.close()
        if writer is not None:
            writer.close()
    return history


def _build_model(config: Config, dims: ParallelDims, family: str) -> nn.Module:
    return build_model(config.model, dims, family, parallel=config.parallel,
                       fp8=config.train.precision.fp8)


def _default_data(config: Config, train_data: Dataset | None,
                  valid_data: Dataset | None) -> tuple[Dataset, Dataset | None]:
    """The datasets given (valid None: no evaluation), or mock train and valid splits."""
    if train_data is not None:
        return train_data, valid_data
    if not config.train.data.mock_data:
        raise ConfigError("no training data: pass --mock-data, or build datasets from "
                          "--data-path and hand them to train()")
    seq, vocab = config.model.seq_length, config.model.vocab_size
    seed = config.train.runtime.seed
    return MockDataset(seq, vocab, seed, "train"), MockDataset(seq, vocab, seed, "valid")


@contextlib.contextmanager
def _loading(directory: str) -> Iterator[None]:
    """A checkpoint --load names that cannot be loaded (missing or damaged shards, another
    architecture, layout or optimizer: CheckpointError, raised on every rank alike) is bad input:
    a ConfigError naming the flag, which the launcher prints as one line, exit status 2."""
    try:
        yield
    except CheckpointError as err:
        raise ConfigError(f"--load={directory}: {err}") from None


def _resume(config: CheckpointConfig, model: nn.Module, dims: ParallelDims,
            log: Callable[[str], None]) -> TrainingState:
    """The state to start from: fresh (iteration 0: also after --finetune or a release
    checkpoint), or what --load's checkpoint holds: the weights, counters and RNG states (see
    load_checkpoint); the engine's state loads once it is built."""
    if config.load is None:
        return TrainingState()
    with _loading(config.load):
        if dims.rank == 0 and (saved := latest_iteration(config.load)) is not None:
            log(f" loading checkpoint {checkpoint_dir(config.load, saved)}")  # large: minutes
        state = load_checkpoint(config.load, model, dims, load_rng=not config.no_load_rng,
                                finetune=config.finetune, log=log)
    if state is not None:
        return state
    if config.exit_on_missing_checkpoint:
        raise CheckpointError(f"--load={config.load} holds no {TRACKER} and "
                              "--exit-on-missing-checkpoint is set")
    if dims.rank == 0:
        start = ("the --hf-checkpoint weights" if config.hf_checkpoint is not None
                 else "scratch")
        log(f" no checkpoint in --load={config.load} ({TRACKER} is missing): starting from "
            f"{start}")
    return TrainingState()


def _save(config: CheckpointConfig, state: TrainingState, model: nn.Module,
          engine: ZeroPlusPlus, dims: ParallelDims, log: Callable[[str], None],
          probe: Callable[[], float], saver: AsyncCheckpointer | None = None) -> None:
    """Save, then promote the checkpoint to latest once a forward pass from the saved weights
    (`probe`: the last batch again) gives a finite loss. The step that produced the weights may
    have diverged though its own loss, taken before it, was finite: then NonFiniteLossError, and
    the iteration file keeps naming the last good checkpoint, which a requeued job resumes.
    With `saver` (--async-save) the files are written in the background from a snapshot taken
    here, and the promotion waits for them (`AsyncCheckpointer`)."""
    if dims.rank == 0:  # a large checkpoint takes minutes
        log(f" saving checkpoint {checkpoint_dir(config.save, state.iteration)}")
    options = dict(save_rng=not config.no_save_rng, save_optim=not config.no_save_optim)
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


def _check_grid(config: ParallelConfig, dims: ParallelDims) -> None:
    """The process grid must be the one the config describes."""
    if config.pipeline_model_parallel_size != dims.pp:
        raise ConfigError(f"--pipeline-model-parallel-size="
                          f"{config.pipeline_model_parallel_size} disagrees with the process "
                          f"grid's pp={dims.pp}")
    if config.tensor_model_parallel_size != dims.tp and config.pipeline_plan is None:
        raise ConfigError(f"--tensor-model-parallel-size={config.tensor_model_parallel_size}"
                          f" disagrees with the process grid's tp={dims.tp}")
    if config.gpus_per_node not in (None, dims.gpus_per_node):
        raise ConfigError(f"--gpus-per-node={config.gpus_per_node} disagrees with the process "
                          f"grid's gpus_per_node={dims.gpus_per_node}")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
