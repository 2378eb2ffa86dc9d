"""Typed configuration: the model architecture under Megatron-LM's field names, and training.

`ModelConfig.validate(tp=...)` runs before any process group is touched, so that every rank refuses
a bad shape with the same message instead of hanging in a collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag, the value and what works."""


@dataclass
class ModelConfig:
    """Transformer architecture, under Megatron-LM's field names."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None
    """Defaults to 4 * hidden_size (GELU) or Megatron's SwiGLU sizing."""
    num_query_groups: int | None = None
    """Grouped-query attention: number of key/value heads. None means multi-head (= heads)."""
    kv_channels: int | None = None
    """Per-head dim. Defaults to hidden_size // num_attention_heads."""
    seq_length: int = 128
    max_position_embeddings: int | None = None
    vocab_size: int = 512
    make_vocab_size_divisible_by: int = 128
    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm'."""
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' or 'rope'."""
    rotary_base: float = 10000.0
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    params_dtype: str = "float32"
    """'float32', 'bfloat16' or 'float16': the dtype the model's parameters are created in."""
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    """With sequence parallelism: fuse the all-gather / reduce-scatter into the GEMMs
    (symmetric-memory kernels over NVLink copy engines; parallel/async_tp.py)."""
    enable_cuda_graph: bool = False
    """Capture the layers' forward + backward in CUDA graphs (megadomino/models/cuda_graph.py)."""
    recompute_granularity: str | None = None
    """None, 'full' (whole layers) or 'selective' (the attention core)."""
    recompute_method: str | None = None
    """With 'full': 'uniform' or 'block' (Megatron semantics)."""
    recompute_num_layers: int | None = None
    domino_batch_slices: int = 1
    """Domino: micro-slices of each layer's batch (1 = off)."""
    domino_hidden_slices: int = 1
    """Domino: chunks of the MLP's hidden dim (1 = off)."""
    domino_explicit_backward: bool = False
    """Run the layers through Domino's explicit schedule (each linear's weight-gradient GEMM
    queued behind its input-gradient collective) even with one batch and one hidden slice:
    Domino without slicing, the plan that measured fastest of Domino's (BENCHMARKS.md)."""
    fp8: str | None = None
    """FP8 GEMMs in the transformer layers' linears: None (off), 'hybrid' (e4m3 forward, e5m2
    gradients) or 'e4m3' (megadomino/parallel/fp8.py)."""
    fp8_recipe: str = "delayed"
    """'delayed' (scales from an amax history) or 'tensorwise' (from each tensor's amax)."""
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    """'max' (of the history) or 'most_recent'."""
    fp8_margin: int = 0
    """Scales are divided by 2^margin."""
    fp8_interval: int = 1
    """Steps between delayed scale updates."""

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.num_attention_heads > 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            if self.swiglu:
                # Megatron-LM's sizing for SwiGLU: 2/3 of 4h, rounded down to a multiple of 64.
                self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size

    @property
    def domino_enabled(self) -> bool:
        return (self.domino_explicit_backward or self.domino_batch_slices > 1
                or self.domino_hidden_slices > 1)

    @property
    def overlap(self) -> str:
        """The one tensor-parallel overlap in effect: 'none', 'fused-sp' (--sequence-parallel
        --tp-comm-overlap: communication fused into the GEMMs) or 'domino NxK' (batch x hidden
        slices under Domino's schedule; '1x1' is its unsliced explicit backward)."""
        if self.domino_enabled:
            return f"domino {self.domino_batch_slices}x{self.domino_hidden_slices}"
        return "fused-sp" if self.tp_comm_overlap else "none"

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's padding: a multiple of make_vocab_size_divisible_by * tp."""
        multiple = self.make_vocab_size_divisible_by * tp
        return ((self.vocab_size + multiple - 1) // multiple) * multiple

    def validate(self, tp: int = 1) -> None:
        """Raise ConfigError naming the flag if this shape cannot run at tensor-parallel size tp."""
        _check(self.num_layers >= 1, "--num-layers", self.num_layers, "a positive integer")
        _check(self.hidden_size >= 1, "--hidden-size", self.hidden_size, "a positive integer")
        heads = self.num_attention_heads
        _check(heads >= 1, "--num-attention-heads", heads, "a positive integer")
        _check(
            self.hidden_size % heads == 0,
            "--hidden-size",
            self.hidden_size,
            f"a multiple of --num-attention-heads ({heads})",
        )
        _check(
            heads % tp == 0,
            "--num-attention-heads",
            heads,
            f"a multiple of --tensor-model-parallel-size ({tp})",
        )
        groups = self.num_query_groups
        _check(
            groups >= 1 and heads % groups == 0,
            "--num-query-groups",
            groups,
            f"a divisor of --num-attention-heads ({heads})",
        )
        _check(
            groups % tp == 0,
            "--num-query-groups",
            groups,
            f"a multiple of --tensor-model-parallel-size ({tp})",
        )
        _check(
            self.ffn_hidden_size % tp == 0,
            "--ffn-hidden-size",
            self.ffn_hidden_size,
            f"a multiple of --tensor-model-parallel-size ({tp})",
        )
        _check(
            self.normalization in ("LayerNorm", "RMSNorm"),
            "--normalization",
            self.normalization,
            "'LayerNorm' or 'RMSNorm'",
        )
        _check(
            self.position_embedding_type in ("learned_absolute", "rope"),
            "--position-embedding-type",
            self.position_embedding_type,
            "'learned_absolute' or 'rope'",
        )
        _check(
            self.seq_length <= self.max_position_embeddings
            or self.position_embedding_type == "rope",
            "--seq-length",
            self.seq_length,
            f"at most --max-position-embeddings ({self.max_position_embeddings})",
        )
        _check(
            self.params_dtype in ("float32", "bfloat16", "float16"),
            "params_dtype",
            self.params_dtype,
            "'float32', 'bfloat16' or 'float16'",
        )
        _check(self.vocab_size >= 1, "--vocab-size", self.vocab_size, "a positive integer")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            _check(0.0 <= value < 1.0, "--" + name.replace("_", "-"), value, "in [0, 1)")
        _check(
            self.recompute_granularity in (None, "full", "selective"),
            "--recompute-granularity",
            self.recompute_granularity,
            "'full' or 'selective'",
        )
        if self.recompute_granularity == "full":
            _check(
                self.recompute_method in ("uniform", "block"),
                "--recompute-method",
                self.recompute_method,
                "'uniform' or 'block' (required with --recompute-granularity full)",
            )
            n = self.recompute_num_layers
            _check(
                n is not None and 1 <= n <= self.num_layers,
                "--recompute-num-layers",
                n,
                f"an integer in [1, --num-layers ({self.num_layers})]",
            )
        _check(
            self.domino_batch_slices >= 1,
            "--domino-batch-slices",
            self.domino_batch_slices,
            "a positive integer",
        )
        ffn_local = self.ffn_hidden_size // tp
        _check(
            self.domino_hidden_slices >= 1 and ffn_local % self.domino_hidden_slices == 0,
            "--domino-hidden-slices",
            self.domino_hidden_slices,
            f"a divisor of the per-rank ffn size ({self.ffn_hidden_size} / tp {tp} = {ffn_local})",
        )
        _check(
            not self.tp_comm_overlap or self.sequence_parallel,
            "--tp-comm-overlap",
            self.tp_comm_overlap,
            "used with --sequence-parallel (it fuses sequence-parallel collectives)",
        )
        _check(
            not (self.tp_comm_overlap and self.domino_enabled),
            "--tp-comm-overlap",
            self.tp_comm_overlap,
            "off with Domino (--domino-*): they are two ways to overlap the same collectives",
        )
        if self.enable_cuda_graph:
            dropout = {"--hidden-dropout": self.hidden_dropout,
                       "--attention-dropout": self.attention_dropout}
            for flag, value in dropout.items():
                _check(value == 0.0, flag, value, "0 with --enable-cuda-graph (the model-parallel "
                       "RNG tracker swaps generator states, which a CUDA graph cannot capture)")
            _check(self.recompute_granularity is None, "--recompute-granularity",
                   self.recompute_granularity, "unset with --enable-cuda-graph (recompute saves "
                   "and restores RNG states, which a CUDA graph cannot capture)")
            _check(not self.domino_enabled, "--enable-cuda-graph", True,
                   "off with Domino slicing (--domino-*): its schedule hands parameter gradients "
                   "to autograd inside its backward; use --sequence-parallel --tp-comm-overlap "
                   "--enable-cuda-graph for overlapped communication under graphs")
        self._validate_fp8()
        if self.sequence_parallel:
            _check(
                self.seq_length % tp == 0,
                "--seq-length",
                self.seq_length,
                f"a multiple of --tensor-model-parallel-size ({tp}) with --sequence-parallel",
            )

    def _validate_fp8(self) -> None:
        _check(self.fp8 in (None, "hybrid", "e4m3"), "--fp8-format", self.fp8,
               "'hybrid' or 'e4m3'")
        _check(self.fp8_recipe in ("delayed", "tensorwise"), "--fp8-recipe", self.fp8_recipe,
               "'delayed' or 'tensorwise'")
        _check(self.fp8_amax_history_len >= 1, "--fp8-amax-history-len",
               self.fp8_amax_history_len, "a positive integer")
        _check(self.fp8_amax_compute_algo in ("max", "most_recent"), "--fp8-amax-compute-algo",
               self.fp8_amax_compute_algo, "'max' or 'most_recent'")
        _check(self.fp8_margin >= 0, "--fp8-margin", self.fp8_margin, "a non-negative integer")
        _check(self.fp8_interval >= 1, "--fp8-interval", self.fp8_interval, "a positive integer")
        if self.fp8 is None:
            return
        why = {"--domino-batch-slices": (self.domino_batch_slices > 1, "Domino's schedule runs "
                                         "its own high-precision GEMMs on the layers' weights"),
               "--domino-hidden-slices": (self.domino_hidden_slices > 1, "Domino's schedule runs "
                                          "its own high-precision GEMMs on the layers' weights"),
               "--domino-explicit-backward": (self.domino_explicit_backward, "Domino's schedule "
                                              "runs its own high-precision GEMMs on the layers' "
                                              "weights"),
               "--tp-comm-overlap": (self.tp_comm_overlap, "its fused all-gather / "
                                     "reduce-scatter GEMMs are high-precision"),
               "--enable-cuda-graph": (self.enable_cuda_graph, "the FP8 path is not yet "
                                       "verified under CUDA graph capture")}
        for flag, (on, reason) in why.items():
            _check(not on, flag, getattr(self, flag[2:].replace("-", "_")),
                   f"off with --fp8-format: {reason}")
        _check(not (self.fp8_recipe == "delayed" and self.recompute_granularity == "full"),
               "--recompute-granularity", self.recompute_granularity,
               "not 'full' with --fp8-recipe delayed: the recomputed forward would advance the "
               "delayed-scaling state a second time (use selective, or --fp8-recipe tensorwise)")

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named architecture (see PRESETS), with fields overridden by keyword."""
        if name not in PRESETS:
            raise ConfigError(
                f"--model-preset {name!r} is unknown; choose one of: {', '.join(sorted(PRESETS))}"
            )
        fields = dict(PRESETS[name])
        fields.update(overrides)
        if "num_attention_heads" in overrides and "num_query_groups" not in overrides:
            fields.pop("num_query_groups", None)
        if "ffn_hidden_size" not in overrides and (
            "hidden_size" in overrides or "swiglu" in overrides
        ):
            fields.pop("ffn_hidden_size", None)
        return cls(**fields)


def _check(ok: bool, flag: str, value, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{flag}={value} is invalid: it must be {expected}")


ARCHITECTURES: dict[str, dict] = {
    "gpt": dict(normalization="LayerNorm", swiglu=False,
                position_embedding_type="learned_absolute", add_bias_linear=True,
                untie_embeddings_and_output_weights=False),
    "llama": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                  add_bias_linear=False, untie_embeddings_and_output_weights=True),
}
"""What makes a model GPT-3 or Llama-2: the one definition of each family, which the presets,
the entry scripts' defaults (FAMILY_DEFAULTS), LlamaModel's check and the Hugging Face mapping
use."""

FAMILY_DEFAULTS: dict[str, dict] = {
    "gpt": dict(ARCHITECTURES["gpt"], hidden_dropout=0.1, attention_dropout=0.1,
                vocab_size=50257),
    "llama": dict(ARCHITECTURES["llama"], hidden_dropout=0.0, attention_dropout=0.0,
                  vocab_size=32000),
}
"""A family's defaults beyond its architecture: what pretrain_gpt.py / pretrain_llama.py build
when no --model-preset says otherwise."""

_GPT = dict(
    FAMILY_DEFAULTS["gpt"],
    init_method_std=0.02,
    seq_length=2048,
    max_position_embeddings=2048,
    make_vocab_size_divisible_by=128,
    norm_epsilon=1e-5,
)

_LLAMA = dict(
    FAMILY_DEFAULTS["llama"],
    rotary_base=10000.0,
    init_method_std=0.02,
    seq_length=4096,
    max_position_embeddings=4096,
    make_vocab_size_divisible_by=128,
    norm_epsilon=1e-5,
)


def _gpt(layers: int, hidden: int, heads: int, std: float = 0.02) -> dict:
    return dict(_GPT, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                init_method_std=std)


def _llama(layers: int, hidden: int, heads: int, ffn: int, groups: int) -> dict:
    return dict(_LLAMA, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                ffn_hidden_size=ffn, num_query_groups=groups)


# GPT-3 sizes as Megatron-LM's examples and the GPT-3 paper give them (hidden divisible by heads).
PRESETS: dict[str, dict] = {
    "gpt3-125m": _gpt(12, 768, 12, 0.023),
    "gpt3-350m": _gpt(24, 1024, 16, 0.02),
    "gpt3-760m": _gpt(24, 1536, 16, 0.015),
    "gpt3-1.3b": _gpt(24, 2048, 16, 0.013),
    "gpt3-2.7b": _gpt(32, 2560, 32, 0.011),
    "gpt3-6.7b": _gpt(32, 4096, 32, 0.009),
    "gpt3-13b": _gpt(40, 5120, 40, 0.008),
    "gpt3-175b": _gpt(96, 12288, 96, 0.006),
    "llama2-7b": _llama(32, 4096, 32, 11008, 32),
    "llama2-13b": _llama(40, 5120, 40, 13824, 40),
    "llama2-70b": _llama(80, 8192, 64, 28672, 8),
    # Tiny shapes for CPU runs and tests.
    "gpt-tiny": dict(_gpt(2, 64, 4), seq_length=64, max_position_embeddings=64, vocab_size=512,
                     make_vocab_size_divisible_by=8),
    "llama-tiny": dict(_llama(2, 64, 4, 176, 2), seq_length=64, max_position_embeddings=64,
                       vocab_size=512, make_vocab_size_divisible_by=8),
}


@dataclass
class TrainConfig:
    """Everything about a training run that is not the architecture (Megatron flag names)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    """Defaults to micro_batch_size * data-parallel size (no accumulation)."""
    train_iters: int | None = None
    train_samples: int | None = None
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    """'constant', 'linear' (Megatron-LM's default, from Python and the CLI alike) or
    'cosine'."""
    lr_decay_iters: int | None = None
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    optimizer: str = "adam"
    """'adam' (torch's AdamW) or 'sgd' (torch's SGD with `sgd_momentum`)."""
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    mock_data: bool = False
    data_path: list[str] = field(default_factory=list)
    peak_tflops: float | None = None
    """Per-GPU peak TFLOP/s MFU is measured against; None: the GPU's dense bf16 peak where
    training.metrics.PEAK_BF16_TFLOPS knows it, else no MFU."""
    gpus_per_node: int | None = None
    ddp_bucket_size: int = 25_000_000
    """Elements per data-parallel all-reduce bucket (--ddp-bucket-size)."""
    # Data (megadomino.training.data).
    split: str = "969, 30, 1"
    """Train/valid/test weights of --data-path's documents (Megatron-LM's default)."""
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    eod_mask_loss: bool = False
    """Leave end-of-document tokens out of the loss."""
    data_cache_path: str | None = None
    # Checkpoints (megadomino.training.checkpoint).
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
    # Stopping.
    manual_gc: bool = False
    """Python's garbage collector off, collecting on a schedule (megadomino.training.manual_gc)."""
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
    # Logging.
    tensorboard_dir: str | None = None
    profile: bool = False
    """--profile: profile iterations [profile_step_start, profile_step_end) (training/profiling)."""
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    use_pytorch_profiler: bool = False
    # Domino.
    domino_auto: bool = False
    """--domino-batch-slices auto: pick the Domino plan by timing at start-up."""
    # Fine-tuning (finetune_llama.py).
    hf_checkpoint: str | None = None
    """A Hugging Face Llama directory to start from (megadomino.interop.hf.load_llama)."""
    prompt_template: str = "{prompt}"
    """How a prompt is laid out before its response; must contain '{prompt}'."""
    # ZeRO (megadomino.zero; arguments.zero_config turns these into a ZeroConfig).
    zero_stage: int = 0
    """The data-parallel engine's ZeRO stage: 0 plain data parallelism, 1
    (--use-distributed-optimizer) or 3."""
    zeropp_quantized_weights: bool = False
    zeropp_hpz_partition_size: int | None = None
    """None: ZeroConfig's default (1, hpZ off)."""
    zeropp_quantized_gradients: bool = False
    zeropp_gradient_bits: int | None = None
    """None: ZeroConfig's default (4)."""
    zeropp_block_size: int | None = None
    """None: ZeroConfig's default (2048)."""
    zeropp_quantize_full_range: bool = False
    zero_layers_per_unit: int | None = None
    """None: ZeroConfig's default (as many layers a unit as hold zero_unit_params)."""
    zero_unit_params: int | None = None
    """None: ZeroConfig's default (2e8 parameters)."""
