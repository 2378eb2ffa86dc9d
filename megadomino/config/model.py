"""The model architecture under Megatron-LM's field names, one definition per family, and the
named presets.

`ModelConfig` says what the network is, never how it runs: parallel degrees, sequence
parallelism, the tensor-parallel overlap, CUDA graphs and recompute are `ParallelConfig`'s
(config/parallel.py), FP8 is the precision section's (config/train.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megadomino.config.check import ConfigError, check


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
    apply_layernorm_1p: bool = False
    """Zero-centred norm weights (Megatron's --apply-layernorm-1p): the stored weight is gamma - 1,
    initialised to 0, and the norm scales by weight + 1 (LayerNorm and RMSNorm alike)."""
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

    def padded_vocab_size(self, tp: int) -> int:
        """Megatron's padding: a multiple of make_vocab_size_divisible_by * tp."""
        multiple = self.make_vocab_size_divisible_by * tp
        return ((self.vocab_size + multiple - 1) // multiple) * multiple

    def validate(self, tp: int = 1) -> None:
        """Raise ConfigError naming the flag if this shape cannot run at tensor-parallel size tp."""
        check(self.num_layers >= 1, "--num-layers", self.num_layers, "a positive integer")
        check(self.hidden_size >= 1, "--hidden-size", self.hidden_size, "a positive integer")
        heads = self.num_attention_heads
        check(heads >= 1, "--num-attention-heads", heads, "a positive integer")
        check(
            self.hidden_size % heads == 0,
            "--hidden-size",
            self.hidden_size,
            f"a multiple of --num-attention-heads ({heads})",
        )
        check(
            heads % tp == 0,
            "--num-attention-heads",
            heads,
            f"a multiple of --tensor-model-parallel-size ({tp})",
        )
        groups = self.num_query_groups
        check(
            groups >= 1 and heads % groups == 0,
            "--num-query-groups",
            groups,
            f"a divisor of --num-attention-heads ({heads})",
        )
        check(
            groups % tp == 0,
            "--num-query-groups",
            groups,
            f"a multiple of --tensor-model-parallel-size ({tp})",
        )
        check(
            self.ffn_hidden_size % tp == 0,
            "--ffn-hidden-size",
            self.ffn_hidden_size,
            f"a multiple of --tensor-model-parallel-size ({tp})",
        )
        check(
            self.normalization in ("LayerNorm", "RMSNorm"),
            "--normalization",
            self.normalization,
            "'LayerNorm' or 'RMSNorm'",
        )
        check(
            self.position_embedding_type in ("learned_absolute", "rope"),
            "--position-embedding-type",
            self.position_embedding_type,
            "'learned_absolute' or 'rope'",
        )
        check(
            self.seq_length <= self.max_position_embeddings
            or self.position_embedding_type == "rope",
            "--seq-length",
            self.seq_length,
            f"at most --max-position-embeddings ({self.max_position_embeddings})",
        )
        check(
            self.params_dtype in ("float32", "bfloat16", "float16"),
            "params_dtype",
            self.params_dtype,
            "'float32', 'bfloat16' or 'float16'",
        )
        check(self.vocab_size >= 1, "--vocab-size", self.vocab_size, "a positive integer")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, "--" + name.replace("_", "-"), value, "in [0, 1)")

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
