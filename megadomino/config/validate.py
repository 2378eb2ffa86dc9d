"""The one validator: every rule a configuration must meet, each checked once, in pure
arithmetic on the config tree (and a look at the directories --save, --load, --tensorboard-dir
and --data-cache-path name), so that every rank refuses alike with one line naming the flag
before any collective starts. The command line runs it after parsing
(`cli.arguments.parse_args`) and again with the world size at launch; the library's
`train.loop.train` runs it with the process grid's world before it builds anything.

    validate(config)                                   # the configuration alone
    validate(config, world_size, gpus_per_node)        # and the process grid

Rules within one section live with the section (ModelConfig.validate, ZeroConfig, DominoPlan);
the rules across sections are here. Also here: the arithmetic the loop derives from a valid
config (`batch_plan`, `train_iterations`).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from megadomino.config.batches import BatchSchedule
from megadomino.config.check import ConfigError, check, check_writable
from megadomino.config.diloco import check_diloco
from megadomino.config.model import ModelConfig
from megadomino.config.parallel import ParallelConfig, check_degrees, check_gpus_per_node
from megadomino.config.pipeline_auto import check_auto
from megadomino.config.pipeline_codec import check_codec
from megadomino.config.pipeline_plan import AUTO, PipelinePlan, plan_rules
from megadomino.config.pipeline_split import layer_split, placement_of
from megadomino.config.train import (
    DATALOADER_TYPES,
    FP8_AUTO,
    FP8_ROLES,
    WSD_STYLES,
    FP8Recipe,
    ScheduleConfig,
    TrainConfig,
)
from megadomino.config.tree import Config


def validate(config: Config, world_size: int | None = None, gpus_per_node: int | None = None, *,
             finetune: bool = False, data_given: bool = False,
             plan: PipelinePlan | None = None) -> None:
    """Raise ConfigError (naming the flag, the value and what works) if `config` cannot run;
    with `world_size`, also on that many ranks, `gpus_per_node` of them a node (None: all of
    them, unless --gpus-per-node says otherwise). `finetune`: finetune_llama.py's rules;
    `data_given`: datasets are handed to train(), so no data flag is needed; `plan`: the run's
    plan as already resolved (config/pipeline_plan.py), whose --pipeline-plan file is then not
    read again (None: read here)."""
    _train_rules(config.train, finetune, data_given)
    _parallel_rules(config.model, config.parallel, config.train.precision.fp8)
    for tp in plan_rules(config, world_size, plan, gpus_per_node):  # each plan stage's TP
        validate_layers(config.model, config.parallel, tp, config.train.precision.fp8)
    check_auto(config, world_size if plan is None else None)  # a planned plan: plan_rules'
    check_codec(config.parallel, config.model)
    if world_size is not None:
        _world_rules(config, world_size, gpus_per_node)
    check_diloco(config, world_size, gpus_per_node)


def _parallel_rules(model: ModelConfig, parallel: ParallelConfig, fp8: FP8Recipe | None) -> None:
    """The layers at the run's TP degree, and what ZeRO and the start-up Domino tuner allow
    beside them."""
    _pipeline_rules(model, parallel)
    validate_layers(model, parallel, parallel.tensor_model_parallel_size, fp8)
    domino = parallel.domino
    if parallel.zero.fp8_param_gather and fp8 is None:
        raise ConfigError("--fp8-param-gather gathers the weights of the FP8 linears: add "
                          "--fp8-format hybrid (or e4m3)")
    if parallel.domino_auto and fp8 is not None:
        raise ConfigError("--domino-batch-slices auto may pick a Domino plan, whose schedule "
                          "runs high-precision GEMMs: it is off with --fp8-format")
    if parallel.enable_cuda_graph and parallel.domino_auto:
        raise ConfigError("--domino-batch-slices auto times the plans eagerly, not as the "
                          "graphs --enable-cuda-graph replays: give an explicit plan "
                          "(--domino-batch-slices N --domino-hidden-slices K) with it")
    if parallel.zero.fp8_param_gather and parallel.enable_cuda_graph:
        raise ConfigError("--fp8-param-gather hands each step's gathered codes to the linears "
                          "from the host, which the layers' CUDA graphs would not see: drop "
                          "--enable-cuda-graph or --fp8-param-gather")
    if parallel.zero.stage == 3 and parallel.enable_cuda_graph:
        raise ConfigError("--enable-cuda-graph captures the layers, but --zero-stage 3 gathers "
                          "each layer's parameters from host-side hooks: use --zero-stage 1 "
                          "(or --use-distributed-optimizer) with CUDA graphs")
    if parallel.zero.overlap_param_gather and (domino.enabled or parallel.domino_auto
                                               or parallel.enable_cuda_graph):
        raise ConfigError("--overlap-param-gather waits for each layer's gather in the layer's "
                          "forward hook, which Domino's schedule and CUDA graphs bypass: drop "
                          "one of them")
    if parallel.zero.stage == 3 and (domino.enabled or parallel.domino_auto):
        which = ("--domino-batch-slices auto (it may pick a Domino plan)" if parallel.domino_auto
                 else "Domino (--domino, --domino-batch-slices, --domino-hidden-slices, "
                 "--domino-explicit-backward)")
        raise ConfigError("--zero-stage 3 gathers each layer in the layer's forward hook, which "
                          f"the Domino schedule bypasses: {which} runs with --zero-stage 1 only")


PIPELINE_SCHEDULES = ("1f1b", "interleaved", "eager-1f1b", "zb-h1", "eager-zb", "zbv", "auto")
"""--pipeline-schedule's values; 'auto' is picked at start-up among those the stages can run
(pipeline/schedule_auto.py): with virtual stages the interleaved schedule (zbv places the
chunks in a V, which is fixed when the stages are built, before auto's profile)."""


def _pipeline_rules(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The pipeline's split of the layers, its schedule, and what runs inside a stage."""
    pp = parallel.pipeline_model_parallel_size
    check(pp >= 1, "--pipeline-model-parallel-size", pp, "an integer >= 1")
    check(parallel.pipeline_schedule in PIPELINE_SCHEDULES, "--pipeline-schedule",
          parallel.pipeline_schedule, "one of " + ", ".join(PIPELINE_SCHEDULES))
    vpp, per = (parallel.virtual_pipeline_model_parallel_size,
                parallel.num_layers_per_virtual_pipeline_stage)
    if vpp is not None and per is not None:
        raise ConfigError("--virtual-pipeline-model-parallel-size and "
                          "--num-layers-per-virtual-pipeline-stage are exclusive: give one")
    if per is not None:
        check(per >= 1 and model.num_layers % (per * pp) == 0,
              "--num-layers-per-virtual-pipeline-stage", per,
              f"a divisor of --num-layers ({model.num_layers}) / "
              f"--pipeline-model-parallel-size ({pp})")
    if vpp is not None:
        check(vpp >= 1, "--virtual-pipeline-model-parallel-size", vpp, "an integer >= 1")
    chunks = parallel.virtual_chunks(model.num_layers)
    interleaved = parallel.pipeline_schedule == "interleaved"
    check(chunks == 1 or pp > 1, "--virtual-pipeline-model-parallel-size", chunks,
          "1 without pipeline parallelism (--pipeline-model-parallel-size > 1)")
    check(not interleaved or chunks > 1, "--pipeline-schedule", parallel.pipeline_schedule,
          "'interleaved' only with virtual stages (--virtual-pipeline-model-parallel-size or "
          "--num-layers-per-virtual-pipeline-stage)")
    zbv = parallel.pipeline_schedule == "zbv"
    check(not zbv or pp == 1 or (chunks == 2 and parallel.pipeline_codec == "none"),
          "--pipeline-schedule", "zbv", "run with exactly 2 model chunks a stage (its V: "
          "--virtual-pipeline-model-parallel-size 2) and no --pipeline-codec (the codecs' links "
          "are the loop placement's)")
    check(interleaved or zbv or parallel.pipeline_schedule == "auto" or chunks == 1,
          "--pipeline-schedule", parallel.pipeline_schedule,
          "'interleaved' or 'zbv' with virtual stages (1f1b, eager-1f1b, zb-h1 and eager-zb run "
          "one chunk a stage)")
    if parallel.pipeline_plan is None:  # a plan gives each stage's layers (plan_rules)
        layer_split(model.num_layers, pp, chunks, parallel.decoder_first_pipeline_num_layers,
                    parallel.decoder_last_pipeline_num_layers,
                    placement_of(parallel.pipeline_schedule))
    if pp == 1 and parallel.pipeline_plan != AUTO:  # auto plans 2 stages or more
        return
    check(not parallel.domino_auto, "--domino-batch-slices", "auto", "an explicit plan with "
          "pipeline parallelism (--domino-batch-slices N --domino-hidden-slices K): the "
          "start-up timing runs on a whole model")
    check(not parallel.enable_cuda_graph, "--enable-cuda-graph", True,
          "off with pipeline parallelism: graphs of a stage's chunks are not captured yet")
    check(parallel.zero.stage in (0, 1), "--zero-stage", parallel.zero.stage,
          "0 or 1 with pipeline parallelism: stage 3 gathers each layer in forward hooks and "
          "reduces every backward, which the pipeline's interleaved micro-batches would repeat")


def validate_layers(model: ModelConfig, parallel: ParallelConfig, tp: int,
                    fp8: FP8Recipe | None = None) -> None:
    """The architecture at tensor-parallel degree `tp`, and the way `parallel` runs its layers
    (recompute, the TP overlap, sequence parallelism, CUDA graphs) and `fp8` casts their GEMMs:
    what a model checks when it is built."""
    model.validate(tp=tp)
    check(parallel.recompute_granularity in (None, "full", "selective"),
          "--recompute-granularity", parallel.recompute_granularity, "'full' or 'selective'")
    if parallel.recompute_granularity == "full":
        check(parallel.recompute_method in ("uniform", "block"), "--recompute-method",
              parallel.recompute_method,
              "'uniform' or 'block' (required with --recompute-granularity full)")
        n = parallel.recompute_num_layers
        check(n is not None and 1 <= n <= model.num_layers, "--recompute-num-layers", n,
              f"an integer in [1, --num-layers ({model.num_layers})]")
    domino = parallel.domino
    domino.validate(model.ffn_hidden_size, tp)
    check(not parallel.tp_comm_overlap or parallel.sequence_parallel, "--tp-comm-overlap",
          parallel.tp_comm_overlap,
          "used with --sequence-parallel (it fuses sequence-parallel collectives)")
    check(not (parallel.tp_comm_overlap and domino.enabled), "--tp-comm-overlap",
          parallel.tp_comm_overlap,
          "off with Domino (--domino-*): they are two ways to overlap the same collectives")
    if parallel.sequence_parallel:
        check(model.seq_length % tp == 0, "--seq-length", model.seq_length,
              f"a multiple of --tensor-model-parallel-size ({tp}) with --sequence-parallel")
    if parallel.enable_cuda_graph:
        check(parallel.recompute_granularity is None, "--recompute-granularity",
              parallel.recompute_granularity, "unset with --enable-cuda-graph (recompute saves "
              "and restores RNG states, which a CUDA graph cannot capture)")
    if fp8 is not None:
        _fp8_rules(parallel, fp8)
        _fp8_linears_rules(fp8, model.num_layers)


def _fp8_rules(parallel: ParallelConfig, fp8: FP8Recipe) -> None:
    """FP8's recipe, and what runs beside it: the paths that run their own high-precision GEMMs
    are off with it."""
    check(fp8.format in ("hybrid", "e4m3"), "--fp8-format", fp8.format, "'hybrid' or 'e4m3'")
    check(fp8.recipe in ("delayed", "tensorwise"), "--fp8-recipe", fp8.recipe,
          "'delayed' or 'tensorwise'")
    check(fp8.amax_history_len >= 1, "--fp8-amax-history-len", fp8.amax_history_len,
          "a positive integer")
    check(fp8.amax_compute_algo in ("max", "most_recent"), "--fp8-amax-compute-algo",
          fp8.amax_compute_algo, "'max' or 'most_recent'")
    check(fp8.margin >= 0, "--fp8-margin", fp8.margin, "a non-negative integer")
    check(fp8.interval >= 1, "--fp8-interval", fp8.interval, "a positive integer")
    domino = "Domino's schedule runs its own high-precision GEMMs on the layers' weights"
    plan = parallel.domino
    why = {"--domino-batch-slices": (plan.batch_slices, plan.batch_slices > 1, domino),
           "--domino-hidden-slices": (plan.hidden_slices, plan.hidden_slices > 1, domino),
           "--domino-explicit-backward": (True, plan.explicit_backward, domino),
           "--tp-comm-overlap": (True, parallel.tp_comm_overlap,
                                 "its fused all-gather / reduce-scatter GEMMs are high-precision")}
    for flag, (value, on, reason) in why.items():
        check(not on, flag, value, f"off with --fp8-format: {reason}")
    check(not (fp8.recipe == "delayed" and parallel.recompute_granularity == "full"),
          "--recompute-granularity", parallel.recompute_granularity,
          "not 'full' with --fp8-recipe delayed: the recomputed forward would advance the "
          "delayed-scaling state a second time (use selective, or --fp8-recipe tensorwise)")


def _fp8_linears_rules(fp8: FP8Recipe, num_layers: int) -> None:
    """Which linears run FP8: known roles (none: what auto may choose), or 'auto'; bf16 end
    layers within the model."""
    linears = fp8.linears
    roles = ", ".join(FP8_ROLES)
    check(linears == FP8_AUTO or (isinstance(linears, (tuple, list))
                                  and all(role in FP8_ROLES for role in linears)),
          "--fp8-linears", linears if isinstance(linears, str) else ",".join(map(str, linears)),
          f"'all', 'auto' or a comma list of {roles}")
    if fp8.first_last_layers_bf16:
        for flag, count in (("--num-layers-at-start-in-bf16", fp8.num_layers_at_start_in_bf16),
                            ("--num-layers-at-end-in-bf16", fp8.num_layers_at_end_in_bf16)):
            check(0 <= count <= num_layers, flag, count,
                  f"in [0, --num-layers ({num_layers})] with --first-last-layers-bf16")


def _world_rules(config: Config, world_size: int, local_world_size: int | None) -> None:
    """On `world_size` ranks, `local_world_size` of them a node (None: all of them) unless
    --gpus-per-node says otherwise: the world must tile into TP x PP x DP, a TP group must fit in
    a node, the Domino plan in the micro-batch, the global batch must be a multiple of micro batch
    x DP and give at least one iteration, and hpZ's partition must be a node's DP ranks."""
    parallel, schedule, logging = config.parallel, config.train.schedule, config.train.logging
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dp = world_size // (tp * pp) if tp >= 1 and pp >= 1 and world_size % (tp * pp) == 0 else -1
    if parallel.pipeline_plan is not None:  # the plan tiles the world (plan_rules); the
        dp = 1  # micro-batch holds every DP rank's sequences: one replica of the pipeline
    else:
        check_degrees(world_size, tp, pp, dp)
    if parallel.gpus_per_node is not None:
        check_gpus_per_node(world_size, tp, parallel.gpus_per_node)
    batches = BatchSchedule.from_config(schedule, dp)
    batches.train_iterations(schedule)
    parallel.domino.validate(config.model.ffn_hidden_size, tp, schedule.micro_batch_size)
    interleaved = parallel.pipeline_schedule != "zbv"  # zbv runs any micro-batch count
    if parallel.virtual_chunks(config.model.num_layers) > 1 and pp > 1 and interleaved:
        global_batch, num_micro = batch_plan(schedule, dp)
        check(num_micro % pp == 0, "--global-batch-size", global_batch,
              f"a multiple of --micro-batch-size x data-parallel size x "
              f"--pipeline-model-parallel-size ({schedule.micro_batch_size * dp * pp}) with "
              f"the interleaved schedule: its micro-batches ({num_micro}) go in groups of the "
              f"pipeline size")
        tile = schedule.micro_batch_size * dp * pp
        rampup = schedule.rampup_batch_size
        check(rampup is None or (rampup[0] % tile == 0 and rampup[1] % tile == 0),
              "--rampup-batch-size", rampup, f"START and INCREMENT multiples of "
              f"--micro-batch-size x data-parallel size x --pipeline-model-parallel-size "
              f"({tile}) with the interleaved schedule: every step's micro-batches go in groups "
              f"of the pipeline size")
        for _, batch in batches.steps or ():
            check(batch % tile == 0, "--step-batch-size-schedule batch", batch,
                  f"a multiple of --micro-batch-size x data-parallel size x "
                  f"--pipeline-model-parallel-size ({tile}) with the interleaved schedule: every "
                  f"step's micro-batches go in groups of the pipeline size")
    if logging.profile:
        outside = [r for r in logging.profile_ranks if not 0 <= r < world_size]
        if outside:
            raise ConfigError(f"--profile-ranks {outside[0]} is invalid: ranks are 0 to "
                              f"{world_size - 1}")
    gpus = parallel.gpus_per_node or local_world_size or world_size
    # The DP ranks of one node, as ParallelDims cuts the grid.
    parallel.zero.check_dims(
        SimpleNamespace(tp=tp, gpus_per_node=gpus, dp_per_node=max(1, min(dp, gpus // tp))))


def batch_plan(config: ScheduleConfig, dp: int) -> tuple[int, int]:
    """(global batch size, micro-batches per rank per iteration) once any ramp-up or stepped
    schedule is over; ConfigError if they don't tile (the rule validate() checks with the
    world)."""
    batches = BatchSchedule.from_config(config, dp)
    return batches.global_batch_size, batches.final_micro_batches


def train_iterations(config: ScheduleConfig, global_batch_size: int) -> int:
    """--train-iters, or --train-samples // global batch size (a fixed batch; with ramp-up the
    run length is `BatchSchedule.train_iterations`)."""
    return BatchSchedule(global_batch_size, 1, 1).train_iterations(config)


def _train_rules(train: TrainConfig, finetune: bool, data_given: bool) -> None:
    """Megatron-LM's cross-flag rules for the run length, schedule, precision, data, logging,
    runtime and checkpoints."""
    schedule, runtime, logging = train.schedule, train.runtime, train.logging
    checkpoint = train.checkpoint
    if train.precision.bf16 and train.precision.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive: choose one")
    if (schedule.train_iters is None) == (schedule.train_samples is None):
        raise ConfigError("give exactly one of --train-iters and --train-samples")
    for name in ("train_iters", "train_samples"):
        value = getattr(schedule, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} is invalid: it must be >= 1")
    _schedule_rules(schedule)
    check(train.data.dataloader_type in DATALOADER_TYPES, "--dataloader-type",
          train.data.dataloader_type, " or ".join(DATALOADER_TYPES))
    if not data_given:
        _check_data(train, finetune)
    if logging.profile and logging.profile_step_end <= logging.profile_step_start:
        raise ConfigError(f"--profile-step-end={logging.profile_step_end} is invalid: it must "
                          f"be > --profile-step-start ({logging.profile_step_start})")
    if runtime.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval={runtime.manual_gc_interval} is invalid: it "
                          "must be >= 0")
    if not runtime.manual_gc and (runtime.manual_gc_interval or not runtime.manual_gc_eval):
        raise ConfigError("--manual-gc-interval and --no-manual-gc-eval apply to --manual-gc: "
                          "add --manual-gc")
    for name, value in (("save_interval", checkpoint.save_interval),
                        ("exit_interval", runtime.exit_interval)):
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} is invalid: it must be >= 1")
    if not runtime.distributed_timeout_minutes > 0:
        raise ConfigError(f"--distributed-timeout-minutes={runtime.distributed_timeout_minutes} "
                          "is invalid: it must be > 0 (fractions of a minute are fine)")
    if runtime.exit_duration_in_mins is not None and runtime.exit_duration_in_mins < 0:
        raise ConfigError(f"--exit-duration-in-mins={runtime.exit_duration_in_mins} is invalid: "
                          "it must be >= 0")
    cache = train.data.data_cache_path if train.data.data_path and not finetune else None
    for flag, directory in (("--save", checkpoint.save), ("--data-cache-path", cache),
                            ("--tensorboard-dir", logging.tensorboard_dir)):
        if directory is not None:
            check_writable(flag, directory)
    if checkpoint.load is not None and os.path.isfile(checkpoint.load):
        raise ConfigError(f"--load={checkpoint.load} is a file, not a directory: give the "
                          "directory --save wrote (it holds latest_checkpointed_iteration.txt)")
    if checkpoint.ckpt_format not in ("torch", "torch_dist"):
        raise ConfigError(f"--ckpt-format={checkpoint.ckpt_format!r} is invalid: it must be torch "
                          "or torch_dist")
    if checkpoint.async_save and checkpoint.save is None:
        raise ConfigError("--async-save applies to --save: give --save DIR")
    if checkpoint.async_save and checkpoint.ckpt_format == "torch_dist":
        raise ConfigError("--async-save writes this project's checkpoint files in the background; "
                          "--ckpt-format torch_dist's files are written synchronously: drop "
                          "--async-save")
    if checkpoint.load is None:
        for name in ("finetune", "no_load_optim", "no_load_rng", "exit_on_missing_checkpoint"):
            if getattr(checkpoint, name):
                raise ConfigError(f"--{name.replace('_', '-')} applies to --load: give --load DIR")


def _schedule_rules(schedule: ScheduleConfig) -> None:
    """Megatron-LM's rules for the LR schedule: iteration-based flags with --train-iters,
    sample-based ones (and the batch ramp-up) with --train-samples; the decoupled LRs."""
    by_samples = schedule.train_samples is not None
    iteration_flags = {"--lr-decay-iters": schedule.lr_decay_iters is not None,
                       "--lr-warmup-iters": schedule.lr_warmup_iters != 0,
                       "--lr-wsd-decay-iters": schedule.lr_wsd_decay_iters is not None}
    sample_flags = {"--lr-decay-samples": schedule.lr_decay_samples is not None,
                    "--lr-warmup-samples": schedule.lr_warmup_samples != 0,
                    "--lr-wsd-decay-samples": schedule.lr_wsd_decay_samples is not None,
                    "--rampup-batch-size": schedule.rampup_batch_size is not None}
    wrong = next((flag for flag, on in (iteration_flags if by_samples else sample_flags).items()
                  if on), None)
    if wrong is not None:
        run, other = (("--train-samples", "--train-iters") if by_samples
                      else ("--train-iters", "--train-samples"))
        raise ConfigError(f"{wrong} does not apply to a run of {run}: use the "
                          f"{'sample' if by_samples else 'iteration'}-based flags, or {other}")
    if schedule.rampup_batch_size is not None or schedule.step_batch_size_schedule is not None:
        BatchSchedule.from_config(schedule, dp=1)  # its tiling over DP: with the world
    warmup = "--lr-warmup-samples" if by_samples else "--lr-warmup-iters"
    if schedule.lr_warmup_fraction is not None and (schedule.lr_warmup_samples
                                                    or schedule.lr_warmup_iters):
        raise ConfigError(f"give one of --lr-warmup-fraction and {warmup}, not both")
    for name in ("lr_decay_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples"):
        value = getattr(schedule, name)
        check(value is None or value >= 1, f"--{name.replace('_', '-')}", value, ">= 1")
    check(schedule.lr_warmup_samples >= 0, "--lr-warmup-samples", schedule.lr_warmup_samples,
          ">= 0")
    wsd = schedule.lr_wsd_decay_samples if by_samples else schedule.lr_wsd_decay_iters
    if schedule.lr_decay_style == "WSD" and wsd is None:
        raise ConfigError("--lr-decay-style WSD needs the length of its annealing phase: "
                          f"--lr-wsd-decay-{'samples' if by_samples else 'iters'}")
    if schedule.lr_decay_style != "WSD" and wsd is not None:
        raise ConfigError(f"--lr-wsd-decay-{'samples' if by_samples else 'iters'} applies to "
                          "--lr-decay-style WSD")
    check(schedule.lr_wsd_decay_style in WSD_STYLES, "--lr-wsd-decay-style",
          schedule.lr_wsd_decay_style, " or ".join(WSD_STYLES))
    check(schedule.lr_decay_style == "WSD"
          or schedule.lr_wsd_decay_style == ScheduleConfig.lr_wsd_decay_style,
          "--lr-wsd-decay-style", schedule.lr_wsd_decay_style,
          "given with --lr-decay-style WSD only (it shapes WSD's annealing)")
    if not 0.0 <= schedule.min_lr <= schedule.lr:
        raise ConfigError(f"--min-lr={schedule.min_lr} is invalid: it must be in [0, --lr "
                          f"({schedule.lr})]")
    if schedule.decoupled_lr is None and schedule.decoupled_min_lr is not None:
        raise ConfigError("--decoupled-min-lr is the end of --decoupled-lr's decay: add "
                          "--decoupled-lr")
    if schedule.decoupled_lr is not None:
        low = schedule.min_lr if schedule.decoupled_min_lr is None else schedule.decoupled_min_lr
        if not 0.0 <= low <= schedule.decoupled_lr:
            raise ConfigError(f"--decoupled-min-lr={low} is invalid: it must be in [0, "
                              f"--decoupled-lr ({schedule.decoupled_lr})] (it defaults to "
                              "--min-lr)")


def _check_data(train: TrainConfig, finetune: bool) -> None:
    config = train.data
    if config.mock_data and config.data_path:
        raise ConfigError("--mock-data and --data-path exclude each other: choose one")
    if not config.mock_data and not config.data_path:
        raise ConfigError("no data source: pass --data-path (with --tokenizer-type) or "
                          "--mock-data")
    if config.data_path and config.tokenizer_type is None:
        raise ConfigError("--data-path needs --tokenizer-type (and its files): the tokenizer "
                          "gives the end-of-document id and the vocabulary size")
    if finetune and config.eod_mask_loss:
        raise ConfigError("--eod-mask-loss is refused by finetune_llama.py: a response's "
                          "end-of-document token is what teaches the model to stop")
    if finetune and "{prompt}" not in config.prompt_template:
        raise ConfigError(f"--prompt-template={config.prompt_template!r} is invalid: it must "
                          "contain {prompt}")
