"""Translate between a Hugging Face Llama `config.json` and our ModelConfig (Megatron's names).

Both key generations are read: `rope_theta` at the top level (transformers 4.x), under
`rope_parameters` (5.x) or inside a `rope_scaling` dict; a missing `num_key_value_heads` means
multi-head attention. What our LlamaModel cannot run (tied embeddings, biases, scaled RoPE, another
activation) is refused with the key and the value, never silently changed.
"""

from __future__ import annotations

from typing import Any

from megadomino.config import ARCHITECTURES, ConfigError, ModelConfig

DEFAULT_ROPE_THETA = 10000.0
"""transformers' default when a config names no rope_theta."""


def rope_theta_from_hf(hf_config: dict[str, Any]) -> float:
    """The RoPE base from whichever key holds it; a scaled RoPE variant is refused."""
    theta = hf_config.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = hf_config.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ConfigError(f"config.json: {key}={params!r} is not a dict")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config.json: {key} has rope_type {rope_type!r}; only the default "
                              "(unscaled) RoPE of Llama-2 is supported")
        theta = params.get("rope_theta", theta)
    return float(theta) if theta is not None else DEFAULT_ROPE_THETA


def model_config_from_hf(hf_config: dict[str, Any], **overrides: Any) -> ModelConfig:
    """A Llama ModelConfig from a parsed HF config.json; keyword `overrides` replace fields
    (e.g. seq_length, params_dtype). seq_length defaults to
    max_position_embeddings."""
    _refuse_unsupported(hf_config)
    heads = hf_config["num_attention_heads"]
    hidden = hf_config["hidden_size"]
    fields: dict[str, Any] = dict(
        ARCHITECTURES["llama"],
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf_config.get("num_key_value_heads") or heads,
        kv_channels=hf_config.get("head_dim") or hidden // heads,
        seq_length=hf_config["max_position_embeddings"],
        max_position_embeddings=hf_config["max_position_embeddings"],
        vocab_size=hf_config["vocab_size"],
        norm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
        rotary_base=rope_theta_from_hf(hf_config),
        hidden_dropout=0.0,
        attention_dropout=float(hf_config.get("attention_dropout", 0.0)),
        init_method_std=hf_config.get("initializer_range", 0.02),
    )
    unknown = sorted(set(overrides) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"unknown ModelConfig field(s) {unknown} in the overrides")
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config_from(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The HF LlamaForCausalLM config.json dict for `config` (weights stored in `dtype`).

    The RoPE base is written both at the top level and under `rope_parameters`, so that
    transformers 4.x and 5.x read the same value."""
    for field, value in ARCHITECTURES["llama"].items():
        if getattr(config, field) != value:
            raise ConfigError(f"not a Llama config: {field}={getattr(config, field)!r}, HF Llama "
                              f"needs {value!r}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_epsilon,
        "rope_theta": config.rotary_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base},
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "torch_dtype": dtype,
    }


def _refuse_unsupported(hf_config: dict[str, Any]) -> None:
    model_type = hf_config.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError(f"config.json: model_type={model_type!r}; only 'llama' is supported")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "vocab_size")
    missing = [key for key in required if key not in hf_config]
    if missing:
        raise ConfigError(f"config.json lacks {missing}")
    refused = {
        "tie_word_embeddings": (False, "LlamaModel has an untied output layer, as Llama-2 does"),
        "attention_bias": (False, "LlamaModel's linears have no bias"),
        "mlp_bias": (False, "LlamaModel's linears have no bias"),
        "hidden_act": ("silu", "LlamaModel's MLP is SwiGLU (silu)"),
    }
    for key, (supported, why) in refused.items():
        value = hf_config.get(key, supported)
        if value != supported:
            raise ConfigError(f"config.json: {key}={value!r} is not supported ({why}); "
                              f"it must be {supported!r}")
