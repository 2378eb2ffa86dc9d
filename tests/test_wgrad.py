"""The split backward (tp/wgrad.py): B (input gradients, the weight gradients of everything but
the linears' GEMMs) and W (the linears' deferred weight gradients) against one unsplit backward of
the same model, fp32 on CPU, dropout 0.

- Bit-identical: every input and parameter gradient of one micro-batch; over three micro-batches
  whose W's run in their B's order, every accumulated gradient but the tied word embedding's
  (it gets a B part and a W part, added in another association: 1e-6 relative); FP8 (delayed
  and tensorwise) alike, with the same amax histories.
- W's in another order than B's: the deferred parameters' sums are reassociated (1e-6
  relative), the others stay bit-identical.
- The data-parallel engine (ZeRO stage 0 and 1, gradient-accumulation fusion on and off): the
  accumulated fp32 buffers and the reduced shards, under the same rules.
- torch.distributed.pipelining's own split (`stage_backward_input` / `stage_backward_weight`) on
  the same TP=1 stage gives the same input and parameter gradients as ours.
- Full activation recompute (B recomputes the forward) and SHUFFLED W's: the same rules.
- The hooks of the deferred parameters fire in W, in the unsplit backward's order; a W never run
  leaves their gradients (and fused buffers) untouched; W twice, B over a pending W, a deferred
  gradient bound for a non-leaf, and the ways of running the layers that a split cannot defer
  are refused.
- TP=2 (gloo), with and without sequence parallelism, without an engine and with the fused one.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_tp_equivalence import batch, tiny_config
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from configs import make_config, parallel_config
from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_model
from megadomino.config import ConfigError, FP8Recipe
from megadomino.distributed import ParallelDims
from megadomino.models.gpt import GPTModel
from megadomino.tp.layers import _LinearWithAsyncGradReduce
from megadomino.tp.wgrad import (
    WeightGradStore,
    backward_input,
    backward_weight,
    check_split_backward,
)
from megadomino.zero.optimizer import build_engine

IN_ORDER = ("F0", "F1", "B0", "W0", "F2", "B1", "B2", "W1", "W2")
"""W's in their B's order, some after a later forward or B (as ZB-H1 runs them)."""
SHUFFLED = ("F0", "F1", "B0", "F2", "B1", "W1", "B2", "W2", "W0")
"""W's in another order than their B's."""
MICRO_BATCHES = 3
REL = 1e-6
ZB = "--pipeline-schedule zb-h1"


def deferred(name: str) -> bool:
    """Whether W gives `name` its gradient: the linears' weights and the bias summed in a GEMM's
    backward (fc1's); not the QKV bias (the split's backward sums it), nor the row-parallel
    biases (added outside the GEMM)."""
    return (name.endswith("linear_fc1.bias") or name == "output_weight"
            or ".linear_" in name and name.endswith(".weight"))


def in_both(name: str, model) -> bool:
    """The tied word embedding: a B part (the embedding) and a W part (the output layer)."""
    return name == "word_embeddings.weight" and model.output_weight is None


def _model(family: str, dims, parallel=None, fp8=None, **changes):
    torch.manual_seed(7)
    return build_model(tiny_config(family, **changes), dims, family, device="cpu",
                       parallel=parallel, fp8=fp8)


def _micro_batches(config, b: int = 3) -> list[tuple[torch.Tensor, ...]]:
    return [batch(config, seed=20 + i, b=b)[:3] for i in range(MICRO_BATCHES)]


def _loss(model, micro) -> torch.Tensor:
    tokens, labels, loss_mask = micro
    return model(tokens, labels=labels, loss_mask=loss_mask).sum() / loss_mask.sum()


def run(model, micros, actions, split: bool) -> None:
    """The actions ("F<m>", "B<m>", "W<m>") on `model`: split, with one store, or unsplit (B a
    whole backward, W nothing), so that both run the forwards and backwards in one order (FP8's
    delayed scaling closes a step at each forward, with the amaxes the backwards before it
    recorded)."""
    store, losses = WeightGradStore(model), {}
    for action in actions:
        op, micro = action[0], int(action[1:])
        if op == "F":
            losses[micro] = _loss(model, micros[micro])
        elif op == "B" and split:
            backward_input(losses.pop(micro), None, store, micro)
        elif op == "B":
            losses.pop(micro).backward()
        elif split:
            backward_weight(store, micro)
    assert store.pending() == []


def compare(split: dict, unsplit: dict, model, actions) -> None:
    """Bit-identical where the additions are the same, else within REL (module docstring)."""
    assert split.keys() == unsplit.keys()
    for name, grad in unsplit.items():
        if in_both(name, model) or (actions is SHUFFLED and deferred(name)):
            assert_close(split[name], grad, REL, name)
        else:
            assert torch.equal(split[name], grad), name


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in model.named_parameters()}


def check_split_equals_unsplit(dims, family: str, actions, fp8: FP8Recipe | None = None,
                               b: int = 3, **parallel_leaves) -> None:
    """Without an engine: the parameters' `.grad` after the actions against unsplit backwards;
    `parallel_leaves`: how the layers run (ParallelConfig's fields by name)."""
    parallel = parallel_config(**parallel_leaves)
    models = [_model(family, dims, parallel, fp8) for _ in range(2)]
    micros = _micro_batches(models[0].config, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FP8's fallback GEMM for shapes off the 16-grid
        run(models[0], micros, actions, split=False)
        run(models[1], micros, actions, split=True)
    compare(_grads(models[1]), _grads(models[0]), models[0], actions)
    if fp8 is not None:  # B casts the output gradients: the same amaxes recorded
        for ours, theirs in zip(models[1].buffers(), models[0].buffers()):
            assert torch.equal(ours, theirs)


def check_split_with_engine(dims, family: str, actions, stage: int, fused: bool,
                            sequence_parallel: bool = False) -> None:
    """Under the engine's no_sync, then its reduction: the accumulated fp32 buffers and the
    reduced shards against unsplit backwards."""
    config = make_config(tiny_config(family), stage=stage, gradient_accumulation_fusion=fused,
                         sequence_parallel=sequence_parallel, micro_batch_size=3,
                         global_batch_size=3 * MICRO_BATCHES)
    results = []
    for split in (False, True):
        model = _model(family, dims, config.parallel)
        assert any(getattr(p, "fused_wgrad", False) for p in model.parameters()) == fused
        engine = build_engine(model, dims, config)
        engine.zero_grad()
        with engine.no_sync():
            run(model, _micro_batches(model.config), actions, split)
        assert all(p.grad is None for p in model.parameters())
        accumulated = {name: engine.accumulated_grad(p).clone()
                       for name, p in model.named_parameters()}
        engine.reduce_gradients()
        results.append((accumulated, [shard.clone() for shard in engine.grads.grad_shards]))
    (unsplit, unsplit_shards), (split, split_shards) = results
    compare(split, unsplit, model, actions)
    exact = actions is IN_ORDER and model.output_weight is not None
    for ours, theirs in zip(split_shards, unsplit_shards):
        if exact:
            assert torch.equal(ours, theirs)
        else:
            assert_close(ours, theirs, REL, "shard")


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("actions", [IN_ORDER, SHUFFLED], ids=["in-order", "shuffled"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_split_equals_unsplit(family: str, actions) -> None:
    check_split_equals_unsplit(ParallelDims(tp=1), family, actions)


@pytest.mark.usefixtures("single_process_group")
def test_split_under_full_recompute() -> None:
    """B recomputes the layers' forward (its saved tensors); W keeps what the closures took."""
    check_split_equals_unsplit(ParallelDims(tp=1), "gpt", SHUFFLED, recompute_granularity="full",
                               recompute_method="uniform", recompute_num_layers=1)


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_split_equals_unsplit(recipe: str) -> None:
    # b=4: 48 tokens a micro-batch, so every FP8 GEMM's dims are multiples of 16 (_scaled_mm)
    check_split_equals_unsplit(ParallelDims(tp=1), "gpt", IN_ORDER,
                               fp8=FP8Recipe(recipe=recipe), b=4)


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("actions", [IN_ORDER, SHUFFLED], ids=["in-order", "shuffled"])
@pytest.mark.parametrize("stage, fused", [(0, True), (0, False), (1, True)])
def test_split_with_engine(stage: int, fused: bool, actions) -> None:
    check_split_with_engine(ParallelDims(tp=1), "gpt", actions, stage, fused)


def _stage_grads(split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A middle stage (two layers, no embedding or output layer) at TP=1: its input's and
    parameters' gradients through `split`: "none", "ours" or "torch" (pipelining's own)."""
    config = tiny_config("llama")
    torch.manual_seed(7)
    chunk = GPTModel(config, ParallelDims(tp=1), "cpu", layer_range=(0, 2), pre_process=False,
                     post_process=False)
    generator = torch.Generator().manual_seed(3)
    shape = (config.seq_length, 3, config.hidden_size)  # (s, b, h)
    x = torch.randn(shape, generator=generator).requires_grad_()
    grad = torch.randn(shape, generator=generator)
    out = chunk.decoder(x, chunk.rotary(config.seq_length, None, x.device))
    if split == "torch":
        _, groups = stage_backward_input([out], [grad], [x], iter(chunk.parameters()))
        stage_backward_weight(iter(chunk.parameters()), groups)
    elif split == "ours":
        store = WeightGradStore(chunk)
        backward_input(out, grad, store, 0)
        backward_weight(store, 0)
    else:
        out.backward(grad)
    return x.grad, _grads(chunk)


@pytest.mark.usefixtures("single_process_group")
def test_same_as_torch_pipelining_split() -> None:
    (unsplit_x, unsplit), (torch_x, torch_split), (ours_x, ours) = (
        _stage_grads(split) for split in ("none", "torch", "ours"))
    assert torch.equal(ours_x, unsplit_x) and torch.equal(torch_x, unsplit_x)
    for name, grad in unsplit.items():
        assert torch.equal(ours[name], torch_split[name]), name
        assert torch.equal(ours[name], grad), name


@pytest.mark.usefixtures("single_process_group")
def test_hooks_fire_in_the_unsplit_order() -> None:
    """B fires the hooks of the parameters it gives gradients to, W those it deferred, each in
    the order of an unsplit backward (llama: untied, no biases, so no parameter is in both)."""
    orders = []
    for split in (False, True):
        model, fired = _model("llama", ParallelDims(tp=1)), []
        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(
                lambda p, n=name, out=fired: out.append(n) if p.grad is not None else None)
        loss = _loss(model, _micro_batches(model.config)[0])
        if not split:
            loss.backward()
        else:
            store = WeightGradStore(model)
            backward_input(loss, None, store, 0)
            in_b = len(fired)
            backward_weight(store, 0)
            assert all(not deferred(n) for n in fired[:in_b])
            assert all(deferred(n) for n in fired[in_b:])
        orders.append(fired)
    unsplit, split = orders
    assert split == ([n for n in unsplit if not deferred(n)] + [n for n in unsplit if deferred(n)])


@pytest.mark.usefixtures("single_process_group")
def test_unrun_w_leaves_gradients_and_w_runs_once() -> None:
    config = make_config(tiny_config("gpt"), stage=0, micro_batch_size=3,
                         global_batch_size=3 * MICRO_BATCHES)
    model = _model("gpt", ParallelDims(tp=1), config.parallel)
    engine = build_engine(model, ParallelDims(tp=1), config)
    engine.zero_grad()
    store, micros = WeightGradStore(model), _micro_batches(model.config)
    with engine.no_sync():
        for micro in (0, 1):
            backward_input(_loss(model, micros[micro]), None, store, micro)
        assert store.pending() == [0, 1]
        for name, param in model.named_parameters():
            written = engine.accumulated_grad(param).count_nonzero() > 0
            assert written == (not deferred(name)), name
        with pytest.raises(RuntimeError, match="still pending"):
            backward_input(_loss(model, micros[0]), None, store, 0)
        backward_weight(store, 1)
        with pytest.raises(RuntimeError, match="ran already"):
            backward_weight(store, 1)
        assert store.pending() == [0]
        assert all(engine.accumulated_grad(p).count_nonzero() > 0 for p in model.parameters())


@pytest.mark.usefixtures("single_process_group")
def test_unrun_w_leaves_grad_unset_and_one_store_a_parameter() -> None:
    model = _model("llama", ParallelDims(tp=1))
    store = WeightGradStore(model)
    backward_input(_loss(model, _micro_batches(model.config)[0]), None, store, "m0")
    for name, param in model.named_parameters():
        assert (param.grad is None) == deferred(name), name
    with pytest.raises(ValueError, match="another live WeightGradStore"):
        WeightGradStore(model.decoder)
    with pytest.raises(RuntimeError, match="one backward at a time"), store.defer("a"), \
            store.defer("b"):
        pass


@pytest.mark.usefixtures("single_process_group")
def test_a_deferred_gradient_must_go_to_a_leaf() -> None:
    """B's autograd run frees every node but the leaves' AccumulateGrad before W."""
    weight, bias = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))
    store = WeightGradStore(nn.ParameterList([weight, bias]))
    x = torch.randn(2, 4, requires_grad=True)
    out = _LinearWithAsyncGradReduce.apply(x, weight, bias * 2, None, False)
    with pytest.raises(RuntimeError, match="onto a leaf parameter; input 2"):
        backward_input(out.sum(), None, store, 0)


@pytest.mark.parametrize("leaves, flag", [
    (dict(batch_slices=2), "--domino-batch-slices"),
    (dict(domino_auto=True), "--domino-batch-slices"),
    (dict(hidden_slices=2), "--domino-hidden-slices"),
    (dict(explicit_backward=True), "--domino-explicit-backward"),
    (dict(sequence_parallel=True, tp_comm_overlap=True), "--tp-comm-overlap"),
    (dict(enable_cuda_graph=True), "--enable-cuda-graph"),
])
def test_paths_a_split_cannot_defer_are_refused(leaves: dict, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag} is off with {ZB}"):
        check_split_backward(parallel_config(**leaves), 2, ZB)


def test_plain_tp_and_sequence_parallelism_are_accepted() -> None:
    check_split_backward(parallel_config(sequence_parallel=True), 2, ZB)
    check_split_backward(parallel_config(), 1, ZB)


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"dims": ParallelDims(tp=world)}


for _sp in (False, True):
    SUITE.case(f"tp-sp{int(_sp)}", check_split_equals_unsplit, C.dims, "gpt", IN_ORDER,
               sequence_parallel=_sp)
    SUITE.case(f"tp-sp{int(_sp)}-fused-engine", check_split_with_engine, C.dims, "llama",
               IN_ORDER, 1, True, _sp)

test_tp2 = SUITE.test()
