"""GPTModel: embedding, transformer block, output layer and vocab-parallel loss.

The model follows its ModelConfig (Megatron's GPTModel is likewise generic); the GPT-3 presets
give pre-LayerNorm, GELU(tanh), learned absolute positions, biases and a tied output layer.
LlamaModel (llama.py) is the same model with the Llama-2 architecture required.

Call: `model(tokens, labels=None, loss_mask=None, position_ids=None)` with tokens `[b, s]`:
- without labels: logits `[b, s, vocab_size]`, gathered over TP, padding columns dropped;
- with labels: per-token loss `[b, s]` in fp32 (times loss_mask if given), computed
  vocab-parallel without gathering the logits; it is the cross-entropy of the logits returned
  without labels (padding columns take no part), the same at every TP degree.

The vocabulary is padded to a multiple of make_vocab_size_divisible_by x TP rows; the padding
rows of the embedding / output weight start at zero and get no gradient (token ids are below
vocab_size: the data checks it), so they stay zero and `full_state_dict()` drops nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megadomino.config import FP8Recipe, ModelConfig, ParallelConfig
from megadomino.config.validate import validate_layers
from megadomino.distributed import comm, mappings
from megadomino.distributed import random as tp_random
from megadomino.models.blocks import DTYPES, rotary_tables
from megadomino.models.transformer import TransformerBlock
from megadomino.tp.cross_entropy import vocab_parallel_cross_entropy
from megadomino.tp.layers import (
    VocabParallelEmbedding,
    column_parallel_matmul,
    init_sharded_,
    shard_rows,
    unshard_rows,
)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GPTModel(nn.Module):
    """`layer_range`, `pre_process` and `post_process` (Megatron's names) build a part of the
    model, as a pipeline stage holds one: layers [start, end) only, the embedding only with
    `pre_process`, the final norm and output layer only with `post_process` (which keeps the
    word embedding too when the output layer is tied to it). The whole model is the part that
    holds everything (a one-stage plan's stage: megadomino.build). A part's `forward` skips what
    it does not hold: without `pre_process` it takes the previous stage's activation
    (`decoder_input`) instead of embedding the tokens, and without `post_process` it returns its
    layers' output. Every part draws the whole model's initial values in the same order and
    keeps its own, so the parts of a model start from the whole model's weights for the same
    seed; `checkpoint_parameters()` names its parameters as the whole model does."""

    def __init__(self, config: ModelConfig, dims, device=None, *,
                 parallel: ParallelConfig | None = None, fp8: FP8Recipe | None = None,
                 layer_range: tuple[int, int] | None = None, pre_process: bool = True,
                 post_process: bool = True):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        parallel = parallel or ParallelConfig()
        validate_layers(config, parallel, dims.tp, fp8)
        device = torch.device(device) if device is not None else default_device()
        dtype = DTYPES[config.params_dtype]
        self.config, self.dims, self.parallel = config, dims, parallel
        self.sequence_parallel = parallel.sequence_parallel and dims.tp > 1
        self.padded_vocab_size = config.padded_vocab_size(dims.tp)
        std = config.init_method_std
        self.word_embeddings = VocabParallelEmbedding(
            self.padded_vocab_size, config.vocab_size, config.hidden_size, dims,
            reduce_scatter=self.sequence_parallel, init_std=std, device=device, dtype=dtype)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, config.hidden_size, device=device, dtype=dtype)
            init_sharded_(self.position_embeddings.weight,
                          tuple(self.position_embeddings.weight.shape), std, _Replicated())
            self.position_embeddings.weight.sequence_parallel = self.sequence_parallel
        self.decoder = TransformerBlock(config, dims, parallel, fp8, device,
                                        layer_range=layer_range, final_norm=post_process)
        self.output_weight = None
        if config.untie_embeddings_and_output_weights:
            self.output_weight = nn.Parameter(
                torch.empty_like(self.word_embeddings.weight))
            for attr in ("tensor_model_parallel", "tp_partition_dim", "tp_stripes", "vocab_size"):
                setattr(self.output_weight, attr, getattr(self.word_embeddings.weight, attr))
            init_sharded_(self.output_weight, (config.vocab_size, config.hidden_size), std, dims)
        self.vocab_start = self.word_embeddings.vocab_start
        tied = self.output_weight is None
        if not post_process:
            self.output_weight = None
        if not pre_process:
            self.position_embeddings = None
            if not (post_process and tied):
                self.word_embeddings = None

    def embedding_and_output_weights(self) -> list[nn.Parameter]:
        """The word embedding and, when untied, the output weight: Megatron's
        embedding-or-output parameters, which --decoupled-lr gives their own learning rate."""
        return [self.word_embeddings.weight] + ([self.output_weight]
                                                if self.output_weight is not None else [])

    # ---- forward -------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """tokens (b, s) -> hidden (s, b, h), or (s/tp, b, h) under sequence parallelism."""
        hidden = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            if position_ids is None:
                positions = self.position_embeddings.weight[: tokens.shape[1]].unsqueeze(1)
            else:
                positions = self.position_embeddings(position_ids).transpose(0, 1)
            if self.sequence_parallel:
                positions = mappings.split_dim0(positions.expand(-1, hidden.shape[1], -1)
                                                if position_ids is None else positions,
                                                self.dims.tp_group)
            hidden = hidden + positions
        p = self.config.hidden_dropout
        if self.training and p > 0.0:
            if self.sequence_parallel:
                with tp_random.tracker_of(self.dims).fork():
                    hidden = F.dropout(hidden, p, training=True)
            else:
                hidden = F.dropout(hidden, p, training=True)
        return hidden

    def rotary(self, seq_len: int, position_ids: torch.Tensor | None, device):
        if self.config.position_embedding_type != "rope":
            return None
        length = self.config.max_position_embeddings if position_ids is not None else seq_len
        cos, sin = rotary_tables(max(length, seq_len), self.config.kv_channels,
                                 self.config.rotary_base, device)
        if position_ids is None:
            # (s, d) -> (s, 1, 1, d)
            return cos[:seq_len, None, None, :], sin[:seq_len, None, None, :]
        # (b, s) -> (s, b, 1, d)
        return cos[position_ids].transpose(0, 1)[:, :, None], \
            sin[position_ids].transpose(0, 1)[:, :, None]

    def logits_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (s or s/tp, b, h) -> this rank's vocabulary shard of the logits (s, b, V/tp)."""
        weight = self.output_weight if self.output_weight is not None \
            else self.word_embeddings.weight
        return column_parallel_matmul(hidden, weight, None, self.dims.tp_group,
                                      self.sequence_parallel, self.parallel.tp_comm_overlap)

    def loss_parallel(self, logits: torch.Tensor, labels: torch.Tensor,
                      loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's logits shard (s, b, V/tp) and labels (b, s) -> per-token loss (b, s), fp32
        (times loss_mask if given)."""
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.dims.tp_group,
                                            self.vocab_start, self.config.vocab_size,
                                            self.parallel.compile_layer_pieces).t()
        return loss if loss_mask is None else loss * loss_mask

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                decoder_input: torch.Tensor | None = None) -> torch.Tensor:
        """The module docstring's call. Without `pre_process`, `decoder_input` (s, b, h) (or
        (s/tp, b, h) under sequence parallelism: the previous stage's output) takes the
        embedding's place, `tokens` giving the sequence length and device only; without
        `post_process` the result is the last layer's output in that shape."""
        hidden = self.embed(tokens, position_ids) if self.pre_process else decoder_input
        hidden = self.decoder(hidden, self.rotary(tokens.shape[1], position_ids, tokens.device))
        if not self.post_process:
            return hidden
        logits = self.logits_parallel(hidden)
        if labels is None:
            # (s, b, V/tp) -> (b, s, vocab_size)
            full = mappings.gather_from_tensor_parallel_region(logits, self.dims.tp_group)
            return full[..., : self.config.vocab_size].transpose(0, 1)
        return self.loss_parallel(logits, labels, loss_mask)

    # ---- full (unsharded) state ------------------------------------------------------------
    def checkpoint_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) as checkpoints key them: the whole model's names (Megatron's), a
        part's layers by their global index `decoder.layers.{layer_offset + i}`, so a stage's
        shard loads at another pipeline degree. The whole model's are `named_parameters()`."""
        offset = self.decoder.layer_offset
        if offset == 0:
            return list(self.named_parameters())
        return [(_global_name(name, offset), param) for name, param in self.named_parameters()]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded, unpadded state dict on CPU, identical on every rank and at every TP.
        Collective over the TP group: every TP rank must call it."""
        return {name: gather_full(param.detach(), param, self.dims).cpu()
                for name, param in self.named_parameters()}

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded gradients (as full_state_dict); parameters without a gradient are left out.
        Gradients of `sequence_parallel` parameters must already be summed over TP."""
        return {name: gather_full(param.grad, param, self.dims).cpu()
                for name, param in self.named_parameters() if param.grad is not None}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (from full_state_dict at any TP, or a converter)."""
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, param in params.items():
            full = state[name]
            expected = full_shape(param, self.dims)
            if tuple(full.shape) != expected:
                raise ValueError(f"{name}: shape {tuple(full.shape)} but the model expects "
                                 f"{expected}")
            param.copy_(shard_full(full.to(param.device, torch.float32), param, self.dims))


def _global_name(name: str, offset: int) -> str:
    """A part's parameter name under the whole model's (`decoder.layers.{offset + index}`)."""
    if not name.startswith("decoder.layers."):
        return name
    index, rest = name[len("decoder.layers."):].split(".", 1)
    return f"decoder.layers.{int(index) + offset}.{rest}"


class _Replicated:
    """Dims stand-in for init of a parameter every TP rank holds whole."""

    tp, tp_rank = 1, 0


def full_shape(param: torch.Tensor, dims) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.tp_partition_dim] *= dims.tp
        if getattr(param, "vocab_size", None) is not None:
            shape[0] = param.vocab_size
    return tuple(shape)


def shard_full(full: torch.Tensor, param: torch.Tensor, dims) -> torch.Tensor:
    """This rank's shard of an unsharded, unpadded tensor for `param`."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    vocab = getattr(param, "vocab_size", None)
    if vocab is not None:
        full = F.pad(full, (0, 0, 0, param.shape[0] * dims.tp - vocab))
    return shard_rows(full, param.tp_partition_dim, param.tp_stripes, dims.tp, dims.tp_rank)


def gather_full(local: torch.Tensor, param: torch.Tensor, dims) -> torch.Tensor:
    """The unsharded, unpadded tensor from every TP rank's `local` (collective over TP)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local.clone()
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(dims.tp)]
    if dims.tp > 1:
        comm.all_gather(shards, local, group=dims.tp_group)
    else:
        shards = [local]
    full = unshard_rows(shards, param.tp_partition_dim, param.tp_stripes)
    vocab = getattr(param, "vocab_size", None)
    return full[:vocab] if vocab is not None else full
