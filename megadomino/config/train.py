"""The training run's sections, under Megatron-LM's flag names: optimizer, schedule (batches,
run length, learning rate, evaluation), precision (fp16/bf16, loss scaling, FP8), data,
checkpoint, logging, and the process's runtime (seed, garbage collection, stopping, timeouts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megadomino.config.check import ConfigError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
"""How WSD anneals (Megatron-LM's --lr-wsd-decay-style choices)."""
DATALOADER_TYPES = ("single", "cyclic")
"""The sample orders DataConfig.dataloader_type names (Megatron-LM's --dataloader-type but
'external', a loader of the caller's own)."""


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    """'adam' (torch's AdamW) or 'sgd' (torch's SGD with `sgd_momentum`)."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    """The global gradient norm is clipped to this (0: no clipping)."""


@dataclass
class ScheduleConfig:
    """How long, in what batches, at what learning rate, evaluated how often."""

    micro_batch_size: int = 1
    global_batch_size: int | None = None
    """Defaults to micro_batch_size * data-parallel size * gradient_accumulation_steps (1 when
    None)."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per data-parallel rank per step, as a DeepSpeed JSON config gives them
    (--deepspeed_config): they set the global batch with the world's data-parallel size, or must
    agree with a given one (DeepSpeed's rule). None: no accumulation unless the global batch
    asks for it."""
    train_iters: int | None = None
    train_samples: int | None = None
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    """'constant', 'linear' (Megatron-LM's default, from Python and the CLI alike), 'cosine' or
    'WSD' (warmup, stable, then `lr_wsd_decay_style` over the last WSD decay steps)."""
    lr_decay_iters: int | None = None
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    lr_decay_samples: int | None = None
    """With --train-samples: decay length in samples; default the whole run."""
    lr_warmup_samples: int = 0
    """With --train-samples: linear warmup in samples."""
    lr_wsd_decay_style: str = "exponential"
    """WSD's annealing shape: 'linear', 'cosine', 'exponential' or 'minus_sqrt'."""
    lr_wsd_decay_iters: int | None = None
    """WSD's annealing phase at the end of the decay, in steps (with --train-iters)."""
    lr_wsd_decay_samples: int | None = None
    """WSD's annealing phase at the end of the decay, in samples (with --train-samples)."""
    decoupled_lr: float | None = None
    """Peak LR of the word embedding and the output layer (Megatron's decoupled param groups);
    None: they follow --lr."""
    decoupled_min_lr: float | None = None
    """Their LR at the end of decay; None: --min-lr."""
    rampup_batch_size: list[int] | None = None
    """[start, increment, samples]: the global batch grows from `start` by `increment` in equal
    steps over `samples` consumed samples, then stays --global-batch-size (Megatron's ramp-up)."""
    step_batch_size_schedule: list[list[int]] | None = None
    """[[threshold, batch], ...], thresholds in consumed samples, the first 0: from each
    threshold on the global batch is that batch (Megatron's stepped schedule; its last batch is
    the global batch)."""
    calculate_per_token_loss: bool = False
    """The global batch's loss is the sum of its token losses over its non-masked tokens (across
    micro-batches and DP ranks), not the mean of per-micro-batch means."""
    eval_interval: int = 1000
    eval_iters: int = 100


FP8_ROLES = ("qkv", "proj", "fc1", "fc2")
"""A transformer layer's linears, as FP8Recipe.linears names them: the attention's fused QKV
projection and output projection, the MLP's fc1 and fc2."""
FP8_AUTO = "auto"


@dataclass(frozen=True)
class FP8Recipe:
    """How the transformer layers' linears cast to FP8 (Megatron-LM's defaults), and which of
    them do: a linear runs FP8 when its role is in `linears` and its layer is not one of the
    bf16 ends (`bf16_layer`); every other linear runs in the model's dtype."""

    format: str = "hybrid"
    """'hybrid': e4m3 forward, e5m2 gradients; 'e4m3': e4m3 everywhere."""
    recipe: str = "delayed"
    """'delayed' (scales from an amax history) or 'tensorwise' (from each tensor's amax)."""
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    """'max' (of the history) or 'most_recent' (delayed)."""
    margin: int = 0
    """Scales are divided by 2^margin (delayed): headroom for amax growth between updates."""
    interval: int = 1
    """Steps between scale updates (delayed)."""
    linears: tuple[str, ...] | str = FP8_ROLES
    """The roles (FP8_ROLES) of each layer's linears that run FP8, or 'auto': the training
    run's start-up times each role at the run's shapes and keeps FP8 where it is faster
    (train/fp8_linears.py); the model is built with the roles it chose."""
    first_last_layers_bf16: bool = False
    """Keep every linear of the first `num_layers_at_start_in_bf16` and the last
    `num_layers_at_end_in_bf16` layers (global indices, whatever the pipeline split) in the
    model's dtype (Megatron-LM's rule)."""
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3

    def runs_fp8(self, role: str) -> bool:
        """Whether the linears of `role` run FP8 (outside the bf16 end layers); 'auto' must be
        resolved first, since the model is built with the chosen roles."""
        if self.linears == FP8_AUTO:
            raise ConfigError("--fp8-linears auto is resolved by the training run's start-up "
                              "(train.loop.train): build the model with the roles it chose, "
                              "or name them (e.g. fc1,fc2)")
        return role in self.linears

    def bf16_layer(self, layer: int, num_layers: int) -> bool:
        """Whether layer `layer` (global, 0-based) of `num_layers` keeps all its linears in the
        model's dtype: one of the first or last layers under first_last_layers_bf16."""
        if not self.first_last_layers_bf16:
            return False
        return (layer < self.num_layers_at_start_in_bf16
                or layer >= num_layers - self.num_layers_at_end_in_bf16)


@dataclass
class PrecisionConfig:
    bf16: bool = False
    fp16: bool = False
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    fp8: FP8Recipe | None = None
    """FP8 GEMMs in the transformer layers' linears (megadomino/tp/fp8.py); None: off."""

    @property
    def params_dtype(self) -> str:
        """The dtype the model's parameters are created in."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


@dataclass
class DataConfig:
    mock_data: bool = False
    data_path: list[str] = field(default_factory=list)
    split: str = "969, 30, 1"
    """Train/valid/test weights of --data-path's documents (Megatron-LM's default)."""
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    eod_mask_loss: bool = False
    """Leave end-of-document tokens out of the loss."""
    data_cache_path: str | None = None
    dataloader_type: str = "single"
    """The order samples are read in: 'single', consecutively (the iteration after `consumed`
    samples reads samples [consumed, consumed + global batch)); 'cyclic', Megatron-LM's cyclic
    loader, the same positions read through a permutation per epoch of the dataset
    (megadomino.data.cyclic)."""
    data_sharding: bool = True
    """cyclic: each DP rank reads its own bucket of the dataset, permuted (Megatron-LM's
    default); False: one permutation of the whole dataset is dealt out to the ranks. The single
    loader does not read it."""
    prompt_template: str = "{prompt}"
    """Fine-tuning: how a prompt is laid out before its response; must contain '{prompt}'."""


@dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    finetune: bool = False
    """Load weights only: iteration, optimizer and RNG start fresh."""
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    exit_on_missing_checkpoint: bool = False
    async_save: bool = False
    """Write checkpoints from a CPU snapshot in a background thread while training goes on
    (train/checkpoint/async_save.py); the same files, manifest and promotion as a synchronous
    save."""
    hf_checkpoint: str | None = None
    """A Hugging Face Llama directory to start from (megadomino.interop.hf.load_llama)."""
    ckpt_format: str = "torch"
    """'torch': our shards; 'torch_dist': each checkpoint also carries Megatron-LM's torch_dist
    files (megadomino.interop.megatron_dist), so Megatron-LM can load it. --load reads ours and
    both Megatron-LM formats whatever this says (the files name their format)."""


@dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    peak_tflops: float | None = None
    """Per-GPU peak TFLOP/s MFU is measured against; None: the GPU's dense bf16 peak where
    train.metrics.PEAK_BF16_TFLOPS knows it, else no MFU."""
    profile: bool = False
    """Profile iterations [profile_step_start, profile_step_end) (train/profiling.py)."""
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    use_pytorch_profiler: bool = False


@dataclass
class RuntimeConfig:
    """The process: its seed, Python's garbage collector, when to stop, how long to wait."""

    seed: int = 1234
    manual_gc: bool = False
    """Python's garbage collector off, collecting on a schedule (megadomino.train.manual_gc)."""
    manual_gc_interval: int = 0
    """With manual_gc: iterations between collections (0: only at the start)."""
    manual_gc_eval: bool = True
    """With manual_gc: also collect before and after each evaluation."""
    exit_signal_handler: bool = False
    """On SIGTERM: save a checkpoint at the end of the iteration and stop."""
    exit_duration_in_mins: float | None = None
    exit_interval: int | None = None
    distributed_timeout_minutes: float = 10.0
    """How long a collective waits for a rank that stopped answering before the run ends (exit
    1, naming the silent ranks where the rendezvous store can tell); Megatron-LM's default."""


@dataclass
class TrainConfig:
    """Everything about a training run that is neither the architecture nor how it is laid out
    across GPUs."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
