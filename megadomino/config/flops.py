"""The architecture's arithmetic: multiply-adds and parameters of one transformer layer, of the
embedding and of the output layer, from a `ModelConfig` alone. The MFU line counts FLOPs with it
(train/metrics.py) and the pipeline placement prices stages with it
(pipeline/placement/cost.py), so that both count the same model.

Multiply-adds per token of one layer's forward, Megatron-LM's dense-transformer count
(`num_floating_point_operations` in megatron/training/training.py):

    attention   h * (q + 2 * kv) + q * h          QKV and output projections (GQA-aware)
              + q * s / 2 * 2                     QK^T and PV under a causal mask (half)
    MLP         h * ffn * (3 if SwiGLU else 2)    SwiGLU stacks three GEMMs, GELU two
    logits      h * V_padded                      once per token, not per layer

with q = kv_channels * heads and kv = kv_channels * query_groups. A multiply-add is 2 FLOPs; a
backward costs twice its forward (the data- and the weight-gradient GEMMs).

Parameters, as megadomino's models hold them (tests/test_placement_cost.py counts a built
model's): a layer has two norms (weight, and a bias with LayerNorm), the QKV, output, fc1 and fc2
weights (fc1 doubled under SwiGLU) and their biases with add_bias_linear; the embedding the word
table (V_padded x h) and, with learned absolute positions, the position table; the output side
the final norm and, untied, its own V_padded x h weight.
"""

from __future__ import annotations

from megadomino.config.model import ModelConfig


def layer_macs(config: ModelConfig) -> float:
    """Multiply-adds of one transformer layer's forward, per token."""
    h, s = config.hidden_size, config.seq_length
    query_size = config.kv_channels * config.num_attention_heads
    kv_size = config.kv_channels * config.num_query_groups
    attention = (h * (query_size + 2 * kv_size)  # QKV projection
                 + query_size * s / 2 * 2  # causal QK^T and PV
                 + query_size * h)  # output projection
    mlp = h * config.ffn_hidden_size * (3 if config.swiglu else 2)
    return float(attention + mlp)


def logits_macs(config: ModelConfig, padded_vocab_size: int) -> float:
    """Multiply-adds of the output layer's forward, per token."""
    return float(config.hidden_size * padded_vocab_size)


def layer_params(config: ModelConfig) -> int:
    """Parameters of one transformer layer."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    query_size = config.kv_channels * config.num_attention_heads
    qkv = query_size + 2 * config.kv_channels * config.num_query_groups
    fc1 = ffn * (2 if config.swiglu else 1)
    weights = h * qkv + query_size * h + h * fc1 + ffn * h
    biases = (qkv + h + fc1 + h) if config.add_bias_linear else 0
    return weights + biases + 2 * _norm_params(config)


def embedding_params(config: ModelConfig, padded_vocab_size: int) -> int:
    """Parameters of the embedding (the first stage's): the word table and learned positions."""
    positions = (config.max_position_embeddings * config.hidden_size
                 if config.position_embedding_type == "learned_absolute" else 0)
    return padded_vocab_size * config.hidden_size + positions


def output_params(config: ModelConfig, padded_vocab_size: int) -> int:
    """Parameters of the output side (the last stage's): the final norm, and the output weight
    when it is not tied to the word embedding (tied, the last stage holds a copy of the word
    table, which `embedding_params` counts once)."""
    untied = (padded_vocab_size * config.hidden_size
              if config.untie_embeddings_and_output_weights else 0)
    return _norm_params(config) + untied


def _norm_params(config: ModelConfig) -> int:
    return config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)
