"""One training run built in one downward pass (`build_run`), for `train.loop.train`'s loop.

The order is the one every later piece needs: the config checked against the process grid;
the batch schedule (global batch, iterations, micro-batches); the datasets in the order their
samples are read; the RNGs seeded; with `--fp8-linears auto` the layers' linears timed in bf16
and FP8 (train/fp8_linears.py); then this rank's stage of the pipeline plan built (at PP 1 the
whole model, the one chunk of a one-stage plan) and, with `--domino`, its plan timed, before
anything hooks its parameters; the start-up summary; `--load`'s weights into the whole model;
the pipeline runtime, at every pipeline degree (at PP 1 one stage, no transport; with
`--pipeline-schedule auto` its schedule picked by timing the chunks, before anything hooks their
parameters); the data-parallel engine, which takes the parameters over, its optimizer state
and the pipeline codecs' state; the CUDA graphs (after the engine: they read the parameters'
storage as the engine left it); the stepper and the reporter.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megadomino import overlap
from megadomino.build import build_stage
from megadomino.config import CheckpointConfig, Config, ConfigError, ParallelConfig
from megadomino.config.batches import BatchSchedule, sample_counts
from megadomino.config.diloco import site_count
from megadomino.config.pipeline_plan import PipelinePlan
from megadomino.config.validate import validate
from megadomino.data.cyclic import loader_order
from megadomino.data.mock import MockDataset
from megadomino.distributed import ParallelDims, comm
from megadomino.distributed.random import model_parallel_seed
from megadomino.models import StageChunks
from megadomino.overlap.cuda_graph import capture_layers
from megadomino.overlap.domino.autotune import autotune_domino
from megadomino.pipeline.runtime import PipelineRuntime, run_plan
from megadomino.pipeline.schedules import check_schedule
from megadomino.train.checkpoint import (
    TRACKER,
    CheckpointError,
    TrainingState,
    checkpoint_dir,
    latest_iteration,
    load_checkpoint,
    load_codec_state,
    load_optimizer_state,
    shard_path,
)
from megadomino.train.fp8_linears import resolve_fp8_linears
from megadomino.train.lr_schedule import LRSchedule
from megadomino.train.metrics import num_floating_point_operations, peak_tflops
from megadomino.train.report import Reporter
from megadomino.train.step import Dataset, Stepper
from megadomino.train.summary import count_parameters, startup_lines
from megadomino.train.tensorboard import open_writer
from megadomino.train.timers import Timers
from megadomino.zero import ZeroPlusPlus
from megadomino.zero.loss_scaler import StepResult
from megadomino.zero.optimizer import build_engine

ModelInit = Callable[[Config, ParallelDims], nn.Module]
"""Builds this rank's model from the resolved config (default: its stage of the run's plan,
`build_stage`; at PP 1 the whole model)."""


@dataclasses.dataclass
class Run:
    """What the loop drives: built once by `build_run`, never rebuilt."""

    config: Config
    """The resolved config: params_dtype from the precision flags, a timed Domino plan in place."""
    dims: ParallelDims
    log: Callable[[str], None]
    batches: BatchSchedule
    iters: int
    train_data: Dataset
    valid_data: Dataset | None
    """None: the run never evaluates."""
    model: nn.Module
    engine: ZeroPlusPlus
    state: TrainingState
    step: Stepper
    reporter: Reporter
    lr: LearningRate
    history: dict[str, Any]
    writer: Any
    """The TensorBoard writer, or None."""


class LearningRate:
    """The LR schedule as the loop drives it. It advances only on steps that were not skipped,
    and a step's skip may be decided on the device (StepResult): the last step's is read when
    the next one's LR is needed, after its forward and backward are enqueued, so the host never
    waits for a step to finish before it launches the next."""

    def __init__(self, schedule: LRSchedule, state: TrainingState, engine: ZeroPlusPlus):
        self.schedule, self.state, self.engine = schedule, state, engine
        self.pending: list[tuple[StepResult, int]] = []
        self.lr = 0.0

    def stepped(self, result: StepResult, samples: int) -> None:
        """A step over `samples` samples was enqueued; whether it was skipped is read later."""
        self.pending.append((result, samples))

    def settle(self) -> None:
        """Count the enqueued steps that were not skipped (reads their results)."""
        for done, samples in self.pending:
            self.state.scheduler_steps += not done.skipped
            self.state.scheduler_samples += 0 if done.skipped else samples
        self.pending.clear()

    def set(self) -> None:
        """The next step's rates into the engine (the Stepper calls it before the step)."""
        self.settle()
        self.lr, decoupled_lr = self.schedule.rates(self.state.scheduler_samples)
        self.engine.set_lr(self.lr, decoupled_lr)


def build_run(config: Config, dims: ParallelDims, family: str, log: Callable[[str], None],
              train_data: Dataset | None, valid_data: Dataset | None,
              model_init: ModelInit | None, data_description: str | None) -> Run:
    """The run `train` describes (module docstring for the order)."""
    validate(config, dims.world_size, dims.gpus_per_node, data_given=train_data is not None,
             plan=dims.plan)
    check_schedule(config.parallel)
    _check_grid(config.parallel, dims)
    train_config = config.train
    config = dataclasses.replace(config, model=config.model.replace(
        params_dtype=train_config.precision.params_dtype))
    data_dp = config.parallel.data_parallel_size(dims.dp)
    batches = BatchSchedule.from_config(train_config.schedule, data_dp)
    iters = batches.train_iterations(train_config.schedule)
    if data_description is None:
        data_description = ("mock data" if train_data is None else
                            f"{type(train_data).__name__} of {len(train_data)} samples")
    train_data, valid_data = _ordered_data(config, data_dp, train_data, valid_data)
    model_parallel_seed(train_config.runtime.seed, dims)
    # --fp8-linears auto: the roles FP8 is faster in, which the model is built with
    config = resolve_fp8_linears(config, dims, batches.global_batch_size // (
        batches.micro_batch_size * data_dp), log)
    config, model, plan = _model(config, dims, family, model_init, log)
    stages = plan if plan.size > 1 else None  # the summary's pipeline plan
    device = next(model.parameters()).device
    mbs, gbs = batches.micro_batch_size, batches.global_batch_size
    num_micro = gbs // (mbs * data_dp)
    parameters = count_parameters(model, dims)  # collective; whole, before ZeRO-3 partitions
    if dims.rank == 0:
        _summary(config, dims, family, device, parameters, stages, gbs, num_micro, iters,
                 data_description, log)
    state = _resume(train_config.checkpoint, model, dims, log)  # before the engine takes them
    chunks = model if plan.size > 1 else StageChunks([model], plan.stages[0])
    # before the engine hooks the parameters: --pipeline-schedule auto times the chunks here
    pipeline = PipelineRuntime(chunks, plan, dims, config.model, config.parallel,
                               config.parallel.pipeline_schedule, mbs, num_micro)
    for line in pipeline.start_lines() if dims.rank == 0 else ():
        log(f" {line}")
    engine = build_engine(model, dims, config)
    _load_training_state(train_config.checkpoint, state.iteration, engine, pipeline, dims, log)
    if config.parallel.enable_cuda_graph:
        capture_layers(model, mbs, log=log)  # after the engine (module docstring)
    if plan.size > 1:  # the stages start step 1 together: its waits are the schedule's, not
        comm.barrier(group=dims.pp_group)  # the stages' unequal set-up times (engine, graphs)
    timers = Timers(device)
    step = Stepper(model, engine, dims, mbs, num_micro, device, timers,
                   per_token_loss=train_config.schedule.calculate_per_token_loss,
                   pipeline=pipeline)
    history = {"losses": [], "lrs": [], "grad_norms": [], "eval": [], "skipped_iterations": 0,
               "metrics": {}, "exit_reason": None, "state": state, "model": model,
               "optimizer": engine}
    writer = open_writer(train_config.logging.tensorboard_dir, dims.rank)
    flops = num_floating_point_operations(config.model, gbs,
                                          config.model.padded_vocab_size(dims.tp))
    reporter = Reporter(history, dims, device, log, iters, flops, gbs, config.model.seq_length,
                        peak_tflops(device_name(device), train_config.logging.peak_tflops),
                        timers, writer, engine)
    lr = LearningRate(LRSchedule.from_config(train_config.schedule, iters, gbs), state, engine)
    return Run(config, dims, log, batches, iters, train_data, valid_data, model, engine, state,
               step, reporter, lr, history, writer)


def _ordered_data(config: Config, data_dp: int, train_data: Dataset | None,
                  valid_data: Dataset | None) -> tuple[Dataset, Dataset | None]:
    """The datasets (or mock splits) in the order their samples are read; valid None when the
    run never evaluates."""
    schedule, data = config.train.schedule, config.train.data
    train_data, valid_data = _default_data(config, train_data, valid_data)
    train_samples, valid_samples, _ = sample_counts(schedule, data_dp)
    mbs = schedule.micro_batch_size
    train_data = loader_order(train_data, data, mbs, data_dp, train_samples)
    valid_data = (loader_order(valid_data, data, mbs, data_dp, valid_samples)
                  if valid_samples else None)  # 0: the run never evaluates
    return train_data, valid_data


def _model(config: Config, dims: ParallelDims, family: str, model_init: ModelInit | None,
           log: Callable[[str], None]) -> tuple[Config, nn.Module, PipelinePlan]:
    """This rank's stage of the run's plan (at PP 1 the whole model, its one chunk), in
    training mode, and the plan; with --domino its plan timed and put into the config that
    runs. At PP > 1 every stage draws its weights from --seed (build_stage); at PP 1 the whole
    model draws them from the default generator as model_parallel_seed left it."""
    plan = run_plan(config, dims)
    if model_init is not None:
        model = model_init(config, dims)
    else:
        seed = config.train.runtime.seed if plan.size > 1 else None
        model = build_stage(config.model, dims, plan, family, parallel=config.parallel,
                            fp8=config.train.precision.fp8, init_seed=seed)
    if plan.size == 1:
        model = model[0] if isinstance(model, StageChunks) else model
        overlap.apply(model, config.parallel)  # a model_init's model runs as the config says
    model.train()
    if config.parallel.domino_auto:  # before the engine hooks the parameters
        domino = autotune_domino(model, config.train.schedule.micro_batch_size, log)
        # the plan that runs; domino_auto stays, the summary says the plan was timed
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                          domino=domino))
    return config, model, plan


def _summary(config: Config, dims: ParallelDims, family: str, device: torch.device,
             parameters, stages, gbs: int, num_micro: int, iters: int, data_description: str,
             log: Callable[[str], None]) -> None:
    """The start-up summary (rank 0); `parameters`: count_parameters' (every rank counts)."""
    for line in startup_lines(family, config, parameters,
                              world=dims.world_size, tp=dims.tp, pp=dims.pp, dp=dims.dp,
                              backend=dist.get_backend(), device=device_name(device),
                              global_batch=gbs, micro_batches=num_micro,
                              iterations=iters, data=data_description, plan=stages,
                              threads=torch.get_num_threads() if device.type == "cpu"
                              else None, sites=dims.sites):
        log(line)


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


def _load_training_state(config: CheckpointConfig, iteration: int, engine: ZeroPlusPlus,
                         pipeline: PipelineRuntime, dims: ParallelDims,
                         log: Callable[[str], None]) -> None:
    """A resumed training run's (`iteration` > 0) state beyond the weights, once the engine
    is built on them: the optimizer's (unless --no-load-optim) and the pipeline codecs'
    (checkpoint/pipeline_codec.py: they start afresh when the checkpoint's do not fit)."""
    if iteration == 0:
        return
    with _loading(config.load):
        if not config.no_load_optim:
            load_optimizer_state(config.load, iteration, engine, dims, log)
        source = checkpoint_dir(config.load, iteration)
        load_codec_state(source, shard_path(source, dims.tp_rank, dims.pp_rank, dims.pp),
                         pipeline.codec, dims, log)


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
    sites = site_count(config, dims.world_size, dims.gpus_per_node)
    if sites != dims.sites:
        raise ConfigError(f"--diloco-inner-steps / --diloco-sites make {sites} DiLoCo site(s), "
                          f"the process grid has {dims.sites}: build it with "
                          f"ParallelDims(sites={sites})")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
