"""megatron-core's own GPTModel built on one of our ModelConfigs, on the CPU, for the Megatron
checkpoint tests and the fixture script: its TransformerConfig is the one
benchmarks/peers.py builds for our layer's math (tests/test_peers.py), plus the embedding,
output layer and vocabulary padding of a whole model.

Core attention is benchmarks/peers.py's torch SDPA stand-in for megatron-core's, as in the
peers tier: megatron-core's own forks the CUDA RNG tracker for its dropout and builds its causal
mask on "cuda". megatron-core 0.16.1 on a CPU-only torch also reaches for CUDA in three places,
patched while it runs: the RoPE table and dist_checkpointing's finalize ask
torch.cuda.current_device(), and the async writer calls torch.cuda.synchronize().
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.nn.functional as F

from megadomino.config import ModelConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from peers import _sdpa_core_attention  # noqa: E402


@contextlib.contextmanager
def cpu_only() -> Iterator[None]:
    with mock.patch("torch.cuda.current_device", return_value="cpu"), \
            mock.patch("torch.cuda.synchronize"):
        yield


def init_megatron(tp: int) -> None:
    """megatron-core's parallel state at tensor-parallel `tp` over the default process group
    (data-parallel over the rest)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)


def build_megatron_gpt(config: ModelConfig, tp: int, seed: int = 11) -> torch.nn.Module:
    """megatron-core's GPTModel (local spec, fp32, CPU) of `config` at tensor-parallel `tp`,
    its weights drawn from `seed` (the same on every rank: megatron-core's CPU init draws the
    full tensor and keeps its shard), its logits gathered over TP."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_megatron(tp)
    llama = config.swiglu
    transformer = TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size, kv_channels=config.kv_channels,
        add_bias_linear=config.add_bias_linear, gated_linear_unit=llama,
        activation_func=F.silu if llama else (lambda x: F.gelu(x, approximate="tanh")),
        normalization=config.normalization, layernorm_epsilon=config.norm_epsilon,
        init_method_std=config.init_method_std, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, tensor_model_parallel_size=tp, sequence_parallel=False,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention()
    torch.manual_seed(seed)
    with cpu_only():
        model = GPTModel(
            transformer, spec,
            vocab_size=config.padded_vocab_size(tp),
            max_sequence_length=config.max_position_embeddings,
            position_embedding_type=config.position_embedding_type,
            rotary_base=int(config.rotary_base), parallel_output=False,
            share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights)
    return model.eval()


def megatron_logits(model: torch.nn.Module, tokens: torch.Tensor,
                    vocab_size: int) -> torch.Tensor:
    """tokens (b, s) -> logits (b, s, vocab_size): the padding columns dropped."""
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad(), cpu_only():
        logits = model(tokens, positions, None)
    return logits[..., :vocab_size]


def save_megatron_dist(model: torch.nn.Module, directory: str) -> None:
    """megatron-core's own torch_dist save of the model's sharded state dict (collective)."""
    from megatron.core import dist_checkpointing

    with cpu_only():
        dist_checkpointing.save(model.sharded_state_dict(), directory)


def load_megatron_dist(model: torch.nn.Module, directory: str) -> dict:
    """megatron-core's own torch_dist load into `model` (collective), as Megatron-LM's
    load_checkpoint asks for it (the model's tensors under "model"), strict on the model's
    tensors (extra states aside); the rest of what it read (common.pt's entries)."""
    from megatron.core import dist_checkpointing

    with cpu_only():
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    result = model.load_state_dict(state.pop("model"), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
    return state


def run_fixture_ranks(main: Callable[[int, int], None], world: int, port: int) -> None:
    """A fixture generator's `main(rank, port)` in `world` spawned processes (one thread each),
    each bounded to 10 minutes; SystemExit naming the exit codes when a rank failed."""
    import multiprocessing

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=main, args=(rank, port)) for rank in range(world)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=600)  # bounded: a hung rank fails the script
        if rank.is_alive():
            rank.terminate()
    if any(rank.exitcode != 0 for rank in ranks):
        raise SystemExit(f"a rank failed: exit codes {[rank.exitcode for rank in ranks]}")
