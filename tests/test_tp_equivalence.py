"""Tensor-parallel layers and whole models at TP=2 and TP=4 against the same model at TP=1
loaded with the same full weights: outputs, per-token loss and every full gradient, fp32,
dropout 0, relative error < 1e-5, with and without sequence parallelism.

One gloo process group per world size runs every case (see dist_utils)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from configs import parallel_config
from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_model
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims, mappings
from megadomino.distributed.random import model_parallel_seed
from megadomino.tp.cross_entropy import vocab_parallel_cross_entropy
from megadomino.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

REL = 1e-5
FAMILIES = ("gpt", "llama")


def tiny_config(family: str, **changes) -> ModelConfig:
    """Odd sizes on purpose: vocab 509 (padded), batch 3, sequence 12, GQA with 2 heads/group."""
    common = dict(num_layers=2, seq_length=12, max_position_embeddings=16, vocab_size=509,
                  make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                  init_method_std=0.05)
    if family == "gpt":
        config = ModelConfig.preset("gpt-tiny", hidden_size=48, num_attention_heads=4, **common)
    else:
        config = ModelConfig.preset("llama-tiny", hidden_size=64, num_attention_heads=8,
                                    num_query_groups=4, ffn_hidden_size=88, **common)
    return config.replace(**changes)


def batch(config: ModelConfig, seed: int, b: int = 3):
    gen = torch.Generator().manual_seed(seed)
    s = config.seq_length
    tokens = torch.randint(0, config.vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, config.vocab_size, (b, s), generator=gen)
    loss_mask = (torch.rand(b, s, generator=gen) > 0.2).float()
    position_ids = torch.randint(0, config.max_position_embeddings, (b, s), generator=gen)
    return tokens, labels, loss_mask, position_ids


def loss_and_grads(model, dims, tokens, labels, loss_mask, position_ids=None):
    model.zero_grad(set_to_none=True)
    per_token = model(tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)
    (per_token.sum() / loss_mask.sum()).backward()
    mappings.allreduce_sequence_parallel_grads(model, dims.tp_group)
    return per_token.detach(), model.full_grad_dict()


def check_model(family: str, sequence_parallel: bool, dims_ref, dims_tp, explicit_positions,
                device: str = "cpu", params_dtype: str = "float32",
                rel: tuple[float, float] = (REL, REL), **changes):
    """The model at dims_tp (params_dtype) against the fp32 model at TP=1, same full weights.
    rel = (tolerance for logits and loss, tolerance for gradients)."""
    comm_overlap = changes.pop("tp_comm_overlap", False)
    compile_pieces = changes.pop("compile_layer_pieces", False)
    config = tiny_config(family, **changes)
    torch.manual_seed(7)
    reference = build_model(config, dims_ref, family, device=device)
    full = reference.full_state_dict()
    parallel = parallel_config(sequence_parallel=sequence_parallel, tp_comm_overlap=comm_overlap,
                               compile_layer_pieces=compile_pieces)
    model = build_model(config.replace(params_dtype=params_dtype), dims_tp, family,
                        device=device, parallel=parallel)
    model.load_full_state_dict(full)
    tokens, labels, loss_mask, position_ids = (t.to(device) for t in batch(config, seed=11))
    if not explicit_positions:
        position_ids = None
    assert_close(model(tokens, position_ids=position_ids).float(),
                 reference(tokens, position_ids=position_ids), rel[0], "logits")
    loss, grads = loss_and_grads(model, dims_tp, tokens, labels, loss_mask, position_ids)
    ref_loss, ref_grads = loss_and_grads(reference, dims_ref, tokens, labels, loss_mask,
                                         position_ids)
    assert_close(loss, ref_loss, rel[0], "per-token loss")
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    for name, grad in grads.items():
        assert_close(grad.float(), ref_grads[name], rel[1], f"grad {name}")


def check_init_is_tp_independent(family: str, dims_ref, dims_tp):
    config = tiny_config(family)
    model_parallel_seed(5, dims_ref)
    reference = build_model(config, dims_ref, family, device="cpu").full_state_dict()
    model_parallel_seed(5, dims_tp)
    sharded = build_model(config, dims_tp, family, device="cpu").full_state_dict()
    for name, tensor in reference.items():
        assert torch.equal(sharded[name], tensor), name


def check_recompute_with_dropout(family: str, granularity: str, method: str, dims_tp):
    """Recompute must replay the exact dropout masks (both RNG streams), so grads are equal."""
    config = tiny_config(family, hidden_dropout=0.2, attention_dropout=0.2, num_layers=3)
    tokens, labels, loss_mask, _ = batch(config, seed=3)
    results = []
    for recompute in (None, granularity):
        changes = dict(sequence_parallel=True, recompute_granularity=recompute)
        if recompute == "full":
            changes.update(recompute_method=method, recompute_num_layers=2)
        model_parallel_seed(9, dims_tp)
        model = build_model(config, dims_tp, family, device="cpu",
                            parallel=parallel_config(**changes))
        results.append(loss_and_grads(model, dims_tp, tokens, labels, loss_mask))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert_close(grads_b[name], grads_a[name], 1e-6, f"grad {name}")


def check_column(dims_ref, dims_tp, gather_output: bool, sequence_parallel: bool):
    torch.manual_seed(1)
    x = torch.randn(8, 3, 10)  # (s, b, in), s divisible by 4 for sequence parallelism
    dense = ColumnParallelLinear(10, 12, dims_ref, gather_output=True, init_std=0.3)
    dense.bias.data.normal_()
    layer = ColumnParallelLinear(10, 12, dims_tp, gather_output=gather_output,
                                 sequence_parallel=sequence_parallel)
    layer.weight.data.copy_(dense.weight.data.chunk(dims_tp.tp)[dims_tp.tp_rank])
    layer.bias.data.copy_(dense.bias.data.chunk(dims_tp.tp)[dims_tp.tp_rank])
    x_ref, x_tp = x.clone().requires_grad_(), x.clone()
    if sequence_parallel:
        x_tp = mappings.split_dim0(x_tp, dims_tp.tp_group)
    x_tp.requires_grad_()
    grad_out = torch.randn(8, 3, 12)
    out_ref = dense(x_ref)
    out_ref.backward(grad_out)
    out = layer(x_tp)
    if not gather_output:
        out = mappings.all_gather_last_dim(out.detach(), dims_tp.tp_group).requires_grad_()
        layer(x_tp).backward(mappings.split_last_dim(grad_out, dims_tp.tp_group))
    else:
        out.backward(grad_out)
    assert_close(out, out_ref, REL, "output")
    expected_grad = x_ref.grad
    if sequence_parallel:
        expected_grad = mappings.split_dim0(expected_grad, dims_tp.tp_group)
    assert_close(x_tp.grad, expected_grad, REL, "input grad")
    assert_close(layer.weight.grad, dense.weight.grad.chunk(dims_tp.tp)[dims_tp.tp_rank], REL,
                 "weight grad")
    assert_close(layer.bias.grad, dense.bias.grad.chunk(dims_tp.tp)[dims_tp.tp_rank], REL,
                 "bias grad")


def check_bias_modes(dims_ref, dims_tp, sequence_parallel: bool):
    """The linears' bias modes, which let a layer piece own the bias: a column linear's "skip"
    leaves the bias out of its output and gradient; "detached" adds it with no gradient (the
    consumer returns it); a row linear's add_bias=False leaves it out. Everything else is the
    dense layer's; an unknown mode is refused by name."""
    torch.manual_seed(4)
    x = torch.randn(8, 3, 10)
    dense = ColumnParallelLinear(10, 12, dims_ref, init_std=0.3)
    dense.bias.data.normal_()
    column = ColumnParallelLinear(10, 12, dims_tp, sequence_parallel=sequence_parallel)
    column.weight.data.copy_(dense.weight.data.chunk(dims_tp.tp)[dims_tp.tp_rank])
    column.bias.data.copy_(dense.bias.data.chunk(dims_tp.tp)[dims_tp.tp_rank])
    x_tp = mappings.split_dim0(x, dims_tp.tp_group) if sequence_parallel else x
    grad_out = torch.randn(8, 3, 12)
    x_ref = x.clone().requires_grad_()
    dense(x_ref).backward(grad_out)
    local_bias = column.bias.detach()
    for mode, shift in (("skip", -local_bias), ("detached", torch.zeros_like(local_bias))):
        column.zero_grad(set_to_none=True)
        x_in = x_tp.clone().requires_grad_()
        out = column(x_in, bias=mode)
        expected = mappings.split_last_dim(dense(x).detach(), dims_tp.tp_group) + shift
        assert_close(out, expected, REL, f"{mode} output")
        out.backward(mappings.split_last_dim(grad_out, dims_tp.tp_group))
        assert column.bias.grad is None, mode
        assert_close(column.weight.grad, dense.weight.grad.chunk(dims_tp.tp)[dims_tp.tp_rank],
                     REL, f"{mode} weight grad")
        expected_grad = x_ref.grad
        if sequence_parallel:
            expected_grad = mappings.split_dim0(expected_grad, dims_tp.tp_group)
        assert_close(x_in.grad, expected_grad, REL, f"{mode} input grad")
    try:
        column(x_tp, bias="fused")
    except ValueError as error:
        assert "'fused'" in str(error) and "detached" in str(error), error
    else:
        raise AssertionError("an unknown bias mode was accepted")
    row = RowParallelLinear(12, 10, dims_tp, sequence_parallel=sequence_parallel)
    row.bias.data.normal_()
    h = torch.randn(8, 3, 12)
    h_tp = mappings.split_last_dim(h, dims_tp.tp_group)
    with_bias, without = row(h_tp), row(h_tp, add_bias=False)
    assert_close(with_bias - without, row.bias.detach().expand_as(without), REL, "row bias")


def check_row(dims_ref, dims_tp, input_is_parallel: bool, sequence_parallel: bool):
    torch.manual_seed(2)
    x = torch.randn(8, 3, 12)
    dense = RowParallelLinear(12, 10, dims_ref, init_std=0.3)
    dense.bias.data.normal_()
    layer = RowParallelLinear(12, 10, dims_tp, input_is_parallel=input_is_parallel,
                              sequence_parallel=sequence_parallel)
    layer.weight.data.copy_(dense.weight.data.chunk(dims_tp.tp, dim=1)[dims_tp.tp_rank])
    layer.bias.data.copy_(dense.bias.data)
    x_ref = x.clone().requires_grad_()
    x_tp = mappings.split_last_dim(x, dims_tp.tp_group) if input_is_parallel else x.clone()
    x_tp.requires_grad_()
    grad_out = torch.randn(8, 3, 10)
    dense(x_ref).backward(grad_out)
    out = layer(x_tp)
    expected_out = dense(x_ref).detach()
    if sequence_parallel:
        expected_out = mappings.split_dim0(expected_out, dims_tp.tp_group)
        out.backward(mappings.split_dim0(grad_out, dims_tp.tp_group))
        mappings.allreduce_sequence_parallel_grads(layer, dims_tp.tp_group)
    else:
        out.backward(grad_out)
    assert_close(out, expected_out, REL, "output")
    expected_grad = x_ref.grad
    if input_is_parallel:
        expected_grad = mappings.split_last_dim(expected_grad, dims_tp.tp_group)
    assert_close(x_tp.grad, expected_grad, REL, "input grad")
    assert_close(layer.weight.grad,
                 dense.weight.grad.chunk(dims_tp.tp, dim=1)[dims_tp.tp_rank], REL, "weight grad")
    assert_close(layer.bias.grad, dense.bias.grad, REL, "bias grad")


def check_embedding_and_cross_entropy(dims_ref, dims_tp, sequence_parallel: bool):
    torch.manual_seed(3)
    vocab, padded = 37, 40
    dense = VocabParallelEmbedding(padded, vocab, 6, dims_ref, init_std=1.0)
    layer = VocabParallelEmbedding(padded, vocab, 6, dims_tp, reduce_scatter=sequence_parallel)
    layer.weight.data.copy_(dense.weight.data.chunk(dims_tp.tp)[dims_tp.tp_rank])
    tokens = torch.randint(0, vocab, (3, 8))
    grad_out = torch.randn(8, 3, 6)
    dense(tokens).backward(grad_out)
    out = layer(tokens)
    expected = dense(tokens).detach()
    if sequence_parallel:
        expected = mappings.split_dim0(expected, dims_tp.tp_group)
        grad_out = mappings.split_dim0(grad_out, dims_tp.tp_group)
    out.backward(grad_out)
    assert_close(out, expected, REL, "embedding output")
    assert_close(layer.weight.grad, dense.weight.grad.chunk(dims_tp.tp)[dims_tp.tp_rank], REL,
                 "embedding grad")

    logits = (torch.randn(8, 3, padded) * 4).requires_grad_()
    labels = torch.randint(0, vocab, (8, 3))
    expected_loss = F.cross_entropy(logits.view(-1, padded), labels.view(-1), reduction="none")
    grad_loss = torch.rand(8, 3)
    expected_loss.backward(grad_loss.view(-1))
    shard = mappings.split_last_dim(logits.detach(), dims_tp.tp_group).requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, dims_tp.tp_group,
                                        dims_tp.tp_rank * (padded // dims_tp.tp))
    loss.backward(grad_loss)
    assert_close(loss, expected_loss.view(8, 3).detach(), REL, "cross-entropy")
    assert_close(shard.grad, mappings.split_last_dim(logits.grad, dims_tp.tp_group), REL,
                 "cross-entropy grad")


SUITE = DistSuite(worlds=(2, 4))


def check_no_communication(tp: ParallelDims) -> None:
    """The benchmarks' no-communication limit: inside no_tp_communication(dims) the collectives
    keep their shapes and skip their traffic (a gather repeats the local rows, a reduce-scatter
    keeps the first chunk, an all-reduce leaves the tensor); afterwards the group is back."""
    group = tp.tp_group
    x = torch.full((2, 3), float(tp.tp_rank + 1))
    with mappings.no_tp_communication(tp):
        assert isinstance(tp.tp_group, mappings.NoCommunication)
        gathered, _ = mappings.all_gather_dim0(x, tp.tp_group)
        assert torch.equal(gathered, x.repeat(tp.tp, 1))
        wide = torch.arange(2.0 * tp.tp).view(2 * tp.tp, 1)
        scattered, _ = mappings.reduce_scatter_dim0(wide, tp.tp_group)
        assert torch.equal(scattered, wide[:2])
        y = x.clone()
        assert mappings.all_reduce(y, tp.tp_group) is None and torch.equal(y, x)
        assert mappings.split_last_dim(torch.ones(1, 2 * tp.tp), tp.tp_group).shape == (1, 2)
    assert tp.tp_group is group
    summed = x.clone()
    mappings.all_reduce(summed, tp.tp_group)
    assert torch.equal(summed, torch.full((2, 3), float(sum(range(1, tp.tp + 1)))))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"ref": ParallelDims(tp=1), "tp": ParallelDims(tp=world)}


for gather in (False, True):
    SUITE.case(f"column-gather{gather}", check_column, C.ref, C.tp, gather, False)
SUITE.case("column-sp", check_column, C.ref, C.tp, False, True)
for parallel_input in (False, True):
    SUITE.case(f"row-parallel_input{parallel_input}", check_row, C.ref, C.tp, parallel_input,
               False)
SUITE.case("row-sp", check_row, C.ref, C.tp, True, True)
for sp in (False, True):
    SUITE.case(f"bias-modes-sp{sp}", check_bias_modes, C.ref, C.tp, sp)
for sp in (False, True):
    SUITE.case(f"embedding-ce-sp{sp}", check_embedding_and_cross_entropy, C.ref, C.tp, sp)
for family in FAMILIES:
    for sp in (False, True):
        SUITE.case(f"{family}-sp{sp}", check_model, family, sp, C.ref, C.tp, False)
    SUITE.case(f"{family}-positions", check_model, family, True, C.ref, C.tp, True)
    SUITE.case(f"{family}-comm-overlap", check_model, family, True, C.ref, C.tp, False,
               tp_comm_overlap=True)
    # compiled pieces own the biases (fc1's in the activation, the projections' in the
    # residual add, QKV's gradient in the split's backward): against the eager dense model
    SUITE.case(f"{family}-compiled-pieces", check_model, family, True, C.ref, C.tp, False,
               worlds=(2,), slow_worlds=(4,), compile_layer_pieces=True)
    SUITE.case(f"{family}-init", check_init_is_tp_independent, family, C.ref, C.tp)
    SUITE.case(f"{family}-recompute-selective", check_recompute_with_dropout, family,
               "selective", None, C.tp)
    for method in ("uniform", "block"):
        SUITE.case(f"{family}-recompute-full-{method}", check_recompute_with_dropout, family,
                   "full", method, C.tp)

SUITE.case("no-communication-stand-in", check_no_communication, C.tp)

test_tensor_parallel_matches_dense = SUITE.test()

