"""ZeRO stage 1 / 3 and ZeRO++ (qwZ, hpZ, qgZ): configuration and layout (one process), and the
engine on 4 gloo ranks as 2 nodes x 2 (and TP=2 x DP=2), all cases in one process group (see
dist_utils): both stages equal plain data parallelism, qgZ's reduce equals reduce-scatter within
the quantization bound, full ZeRO++ trains like ZeRO-3, an hpZ checkpoint resumes exactly,
inf/NaN steps are refused alike on every rank, and the byte accounting adds up."""

from __future__ import annotations

import contextlib
import gc
import io
import math
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from configs import layer_options
from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_model
from megadomino.config import ConfigError, ModelConfig
from megadomino.data import MockDataset
from megadomino.distributed import ParallelDims
from megadomino.distributed.comm import all_gather_single
from megadomino.distributed.random import model_parallel_seed
from megadomino.zero import CommCounter, ZeroConfig, ZeroPlusPlus, collectives
from megadomino.zero.grads import GradReducer
from megadomino.zero.loss_scaler import DynamicLossScaler, StepResult
from megadomino.zero.params import MemoryMeter
from megadomino.zero.partition import FlatUnit, find_units

SEQ = 16
# eps well above the rounding noise of gradients that are 0 in exact arithmetic (the key bias:
# softmax ignores it), which AdamW with eps 1e-8 would blow up to +-lr updates in either run.
ADAM = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-5)
ZERO_PP = dict(quantized_weights=True, hpz_partition_size=2, quantized_gradients=True)

# ---- one process -------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, flag", [
    (dict(stage=2), "--zero-stage"),
    (dict(stage=1, quantized_weights=True), "--zeropp-quantized-weights"),
    (dict(stage=1, hpz_partition_size=2), "--zeropp-hpz-partition-size"),
    (dict(gradient_bits=2), "--zeropp-gradient-bits"),
    (dict(block_size=7), "--zeropp-block-size"),
    (dict(on_nonfinite="ignore"), "on_nonfinite"),
    (dict(reduce_pipeline_depth=3), "reduce_pipeline_depth=3 is invalid: it must be 1 or 2"),
])
def test_config_refuses(fields, flag):
    with pytest.raises(ConfigError, match=flag):
        ZeroConfig(**fields)


def test_hpz_partition_must_be_the_node():
    dims = type("Dims", (), dict(dp_per_node=4, gpus_per_node=4, tp=1))()
    ZeroConfig(stage=3, hpz_partition_size=4).check_dims(dims)
    with pytest.raises(ConfigError, match="per node \\(4"):
        ZeroConfig(stage=3, hpz_partition_size=2).check_dims(dims)


def test_flat_unit_layout_pads_and_pieces_cover_the_shard():
    params = [nn.Parameter(torch.arange(6.0).view(2, 3)), nn.Parameter(torch.arange(5.0))]
    units = [FlatUnit("u", params, dp=4, dp_rank=r) for r in range(4)]
    assert (units[0].numel, units[0].padded_numel, units[0].shard_numel) == (11, 12, 3)
    flat = units[0].flatten([p.detach() for p in params], torch.float32)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0]
    assert torch.equal(units[0].views(flat)[0], params[0])
    covered = []
    for unit in units:
        for piece in unit.pieces:
            covered += range(piece.start, piece.end)
            assert unit.shard(flat)[piece.shard_start] == flat[piece.start]
    assert covered == list(range(11))  # every element once, padding in no piece
    assert [(p.index, p.start, p.end) for p in units[2].pieces] == [(1, 6, 9)]


def test_flat_unit_views_in_parameter_shapes():
    """views() covers the flat buffer but its padding, in the parameters' shapes, every one a
    view of it (a zero-element parameter's too)."""
    params = [nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(0, 4)),
              nn.Parameter(torch.ones(()))]
    unit = FlatUnit("u", params, dp=4, dp_rank=0)
    flat = torch.arange(float(unit.padded_numel))
    views = unit.views(flat)
    assert [v.shape for v in views] == [p.shape for p in params]
    assert all(v._base is flat for v in views)
    for view in views:
        view.add_(100)
    assert flat.tolist() == [100, 101, 102, 103, 104, 105, 106, 7]


@pytest.mark.parametrize("stage", [1, 3])
def test_grad_reducer_sums_backwards_of_incomplete_units(stage):
    """One process (DP=1, no collective): three backwards, the first two under no_sync(), give
    the shards their exact sum, for a complete unit, one with a parameter that gets no gradient
    and one that gets none (both reduced at finish()). `on_unit_done` comes once per backward
    for the complete unit only; stage 3 drops every buffer after each backward."""
    w1, b1, w2, spare, w3 = (nn.Parameter(torch.zeros(shape))
                             for shape in ((2, 3), (3,), (4,), (5,), (2,)))
    units = [FlatUnit(name, params, dp=1, dp_rank=0)
             for name, params in (("a", [w1, b1]), ("b", [w2, spare]), ("c", [w3]))]
    done, meter = [], MemoryMeter()
    dims = type("Dims", (), dict(dp=1))()
    reducer = GradReducer(units, dims, ZeroConfig(stage=stage), None, meter,  # no comm at DP=1
                          done.append)
    expected = [torch.zeros(u.padded_numel) for u in units]
    for micro in range(3):
        x = torch.arange(6.0).view(2, 3) + micro
        with reducer.no_sync() if micro < 2 else contextlib.nullcontext():
            ((w1 * x).sum() + (b1 * (micro + 1)).sum() + (w2 * x[0, 0]).sum()).backward()
            reducer.finish()
        assert all(p.grad is None for u in units for p in u.params)
        expected[0] += torch.cat([x.reshape(-1), torch.full((3,), micro + 1.0)])
        expected[1][:4] += x[0, 0]
        assert done == [0] * (micro + 1)
        assert meter.current == (0 if stage == 3 else sum(4 * u.padded_numel for u in units))
    for shard, want in zip(reducer.grad_shards, expected):
        assert torch.equal(shard, want)


@pytest.mark.parametrize("stage", [0, 1])
def test_grad_reducer_overwrite_writes_each_backward(stage):
    """One process, `overwrite` (one backward a step): each backward's gradients replace the
    last step's with no zeroing between; a parameter without a gradient this time reads 0, not
    its last gradient; zero_grad() after a step does not touch the buffers; a second backward
    before zero_grad() is refused."""
    w, b, spare = (nn.Parameter(torch.zeros(shape)) for shape in ((2, 3), (3,), (4,)))
    units = [FlatUnit("a", [w, b], dp=1, dp_rank=0), FlatUnit("b", [spare], dp=1, dp_rank=0)]
    dims = type("Dims", (), dict(dp=1))()
    reducer = GradReducer(units, dims, ZeroConfig(stage=stage), None, MemoryMeter(),
                          overwrite=True)
    for step in range(3):
        reducer.zero_grad()
        x = torch.arange(6.0).view(2, 3) + step
        loss = (w * x).sum() + (b * (step + 1)).sum()
        if step != 1:
            loss = loss + (spare * (step + 2)).sum()
        loss.backward()
        reducer.finish()
        shards = reducer.grad_shards if stage == 1 else reducer.buffers
        assert torch.equal(shards[0][:9], torch.cat([x.reshape(-1), torch.full((3,), step + 1.0)]))
        assert torch.equal(shards[1][:4], torch.full((4,), 0.0 if step == 1 else step + 2.0))
    with pytest.raises(RuntimeError, match="a second backward in one step"):
        (w.sum() + b.sum()).backward()


@pytest.mark.usefixtures("single_process_group")
def test_a_skip_decided_on_the_device_is_read_when_asked():
    """Fused AdamW, no loss scaler, on_nonfinite 'skip': step() enqueues the update without
    reading the skip flag (the host does not wait for the step); the StepResult reads it on
    first access. A skipped step's grad norm is NaN and leaves the weights as they were."""
    dims = ParallelDims(tp=1)
    engine = _engine(dims, optimizer="adam-fused", stage=1, one_backward_per_step=True)
    params = [p for p in engine.model.parameters() if p.requires_grad]
    for poison in (1.0, math.inf):
        before = [p.detach().clone() for p in params]
        tokens, labels = _batch(dims, 0)
        engine.backward(engine(tokens, labels=labels).mean() * poison)
        result = engine.step()
        assert not result.settled
        assert result.skipped == (poison != 1.0) and result.settled
        assert math.isnan(result.grad_norm.item()) == result.skipped
        changed = any(not torch.equal(p.detach(), b) for p, b in zip(params, before))
        assert changed != result.skipped


def test_dropped_reducers_free_their_buffers():
    """Gradient hooks hold their reducer weakly (parallel.streams.weak_grad_hook): dropping a
    GradReducer (stage 1, or stage 0's in-place buckets) frees it and its buffers, although the
    parameters, which keep the hooks, live on; the orphaned hooks do nothing."""
    w, v = nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(5))
    dims = type("Dims", (), dict(dp=1, tp=1))()
    reducer = GradReducer([FlatUnit("a", [w], dp=1, dp_rank=0)], dims, ZeroConfig(stage=1), None,
                          MemoryMeter())
    buckets = GradReducer([FlatUnit("b", [v], dp=1, dp_rank=0)], dims, ZeroConfig(stage=0), None,
                          MemoryMeter())
    w.sum().backward()
    (2 * v).sum().backward()
    reducer.finish()
    buckets.finish()
    assert torch.equal(reducer.grad_shards[0], torch.ones(6))
    assert torch.equal(buckets.grad_shards[0], torch.full((5,), 2.0))
    refs = [weakref.ref(x) for x in (reducer, reducer.grad_shards[0], buckets,
                                     buckets.grad_shards[0])]
    del reducer, buckets
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    (w.sum() + v.sum()).backward()
    assert torch.equal(w.grad, torch.ones(3, 2)) and torch.equal(v.grad, torch.ones(5))


def test_find_units_layers_and_shared_params_to_root():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 3)
            self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
            self.layers[1].shared = self.embed.weight  # used in a layer and outside it
            self.frozen = nn.Parameter(torch.ones(1), requires_grad=False)

    toy = Toy()
    units = {name: params for name, _, params in find_units(toy)}
    assert list(units) == ["<root>", "layers.0", "layers.1"]
    assert [p is toy.embed.weight for p in units["<root>"]] == [True, False]
    assert len(units["layers.1"]) == 2 and all(p is not toy.embed.weight
                                               for p in units["layers.1"])


def test_find_units_groups_consecutive_layers_of_one_list():
    toy = nn.Module()
    toy.embed = nn.Linear(3, 3)
    toy.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(5))
    toy.heads = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))
    found = find_units(toy, layers_per_unit=2)
    assert [name for name, _, _ in found] == ["<root>", "layers.0-1", "layers.2-3", "layers.4",
                                              "heads.0-1"]
    assert found[0][1] == (toy,)
    assert found[2][1] == (toy.layers[2], toy.layers[3])  # run order: first and last hooked
    assert found[2][2] == [*toy.layers[2].parameters(), *toy.layers[3].parameters()]
    assert [name for name, _, _ in find_units(toy, 9)] == ["<root>", "layers.0-4", "heads.0-1"]
    assert [len(params) for _, _, params in find_units(toy, 1)] == [2] * 8
    bare = nn.Module()  # no parameter outside the layers: no root unit
    bare.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    assert [name for name, _, _ in find_units(bare, 2)] == ["layers.0-1", "layers.2"]


def test_find_units_by_parameter_count():
    """layers_per_unit None (ZeroConfig's default): a unit takes layers of one list until it
    holds unit_params parameters or 1 / min_units of the list's layers; odd layer sizes, the
    last run of a list may hold fewer."""
    toy = nn.Module()
    toy.embed = nn.Linear(3, 3)
    toy.layers = nn.ModuleList(nn.Linear(3, width) for width in (5, 1, 2, 7, 3))  # 20 4 8 28 12
    toy.heads = nn.ModuleList(nn.Linear(3, 3) for _ in range(2))  # 12 each

    def names(unit_params):
        return [name for name, _, _ in find_units(toy, None, unit_params)]
    assert names(1) == names(4) == [name for name, _, _ in find_units(toy, 1)]
    assert names(16) == ["<root>", "layers.0", "layers.1-3", "layers.4", "heads.0-1"]
    assert names(30) == ["<root>", "layers.0-2", "layers.3-4", "heads.0-1"]
    assert names(10**9) == ["<root>", "layers.0-4", "heads.0-1"]
    # at most 1 / min_units of a list's layers a unit
    assert [name for name, _, _ in find_units(toy, None, 10**9, 2)] == [
        "<root>", "layers.0-1", "layers.2-3", "layers.4", "heads.0", "heads.1"]
    assert [name for name, _, _ in find_units(toy, None, 16, 3)] == [
        "<root>", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "heads.0", "heads.1"]
    found = find_units(toy, None, 30)
    assert found[1][1] == tuple(toy.layers[:3])
    assert found[1][2] == [p for layer in toy.layers[:3] for p in layer.parameters()]


# ---- helpers for the distributed cases ----------------------------------------------------------

DATA = MockDataset(SEQ, 512, seed=7)


def _build(dims: ParallelDims, **overrides) -> nn.Module:
    fields, parallel, _ = layer_options(overrides)
    config = ModelConfig.preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0,
                                seq_length=SEQ, **fields)
    model_parallel_seed(1234, dims)
    return build_model(config, dims, "gpt", device="cpu", parallel=parallel)


def _batch(dims: ParallelDims, step: int, micro: int = 0, num_micro: int = 1, mbs: int = 2):
    """(tokens, labels) of this DP rank's micro-batch, Megatron's sampler order."""
    start = (step * num_micro * dims.dp + micro * dims.dp + dims.dp_rank) * mbs
    samples = torch.stack([DATA[i] for i in range(start, start + mbs)])
    return samples[:, :-1], samples[:, 1:]


def _factory(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, foreach=True, **ADAM)


def _sgd(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=3e-2, momentum=0.9, weight_decay=0.1, foreach=True)


def _fused_adam(groups: list[dict]) -> torch.optim.Optimizer:
    """The kernel the command line uses: it takes the skip decision on the device."""
    return torch.optim.AdamW(groups, fused=True, **ADAM)


FACTORIES = {"adam": _factory, "sgd": _sgd, "adam-fused": _fused_adam}


def _engine(dims: ParallelDims, clip: float = 1.0, model_overrides: dict | None = None,
            loss_scaler=None, optimizer: str = "adam", one_backward_per_step: bool = False,
            **zero) -> ZeroPlusPlus:
    # One layer a unit unless a case says otherwise: the tiny models would otherwise be one unit
    # (ZeroConfig.unit_params), and the cases exercise the pipeline across units.
    zero.setdefault("stage", 3)
    if zero["stage"] == 0:  # stage 0 has buckets, not units
        zero.pop("layers_per_unit", None)
    else:
        zero.setdefault("layers_per_unit", 1)
    return ZeroPlusPlus(_build(dims, **(model_overrides or {})), dims, FACTORIES[optimizer],
                        ZeroConfig(**zero), clip_grad=clip, loss_scaler=loss_scaler,
                        one_backward_per_step=one_backward_per_step)


def _train(engine: ZeroPlusPlus, dims: ParallelDims, steps: range, num_micro: int = 1,
           sync_every_micro: bool = False):
    """Per step: (DP-mean loss, StepResult); no_sync() for all but the last micro-batch unless
    `sync_every_micro`."""
    history = []
    for step in steps:
        total = 0.0
        for micro in range(num_micro):
            tokens, labels = _batch(dims, step, micro, num_micro)
            deferred = micro < num_micro - 1 and not sync_every_micro
            with engine.no_sync() if deferred else contextlib.nullcontext():
                loss = engine(tokens, labels=labels).mean()
                engine.backward(loss / num_micro)
            total += loss.item() / num_micro
        history.append((_dp_mean(total, dims), engine.step()))
    return history


def _dp_mean(value: float, dims: ParallelDims) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=dims.dp_group)
    return tensor.item() / dims.dp


def _plain_dp(dims: ParallelDims, steps: int, num_micro: int, clip: float,
              optimizer: str = "adam", **overrides):
    """Reference, written out apart from the engine (fp32 models): autograd's gradients summed
    over the micro-batches, averaged over DP (one all-reduce per parameter), sequence-parallel
    ones summed over TP, Megatron's global norm (TP shards counted on every TP rank, the rest
    once; in float64), clipping, and torch's AdamW with weight decay on 2-D parameters only."""
    model = _build(dims, **overrides)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = FACTORIES[optimizer]([{"params": [p for p in params if p.ndim >= 2]},
                          {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}])
    history = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=False)
        total = 0.0
        for micro in range(num_micro):
            tokens, labels = _batch(dims, step, micro, num_micro)
            loss = model(tokens, labels=labels).mean()
            (loss / num_micro).backward()
            total += loss.item() / num_micro
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=dims.dp_group)
            param.grad /= dims.dp
            if dims.tp > 1 and getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=dims.tp_group)
        square = sum(p.grad.double().square().sum() for p in params
                     if getattr(p, "tensor_model_parallel", False) or dims.tp_rank == 0)
        dist.all_reduce(square, group=dims.tp_group)
        norm = square.sqrt().float()
        for param in params:
            param.grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))
        optimizer.step()
        history.append((_dp_mean(total, dims), StepResult(False, norm, None)))
    return model, history


# ---- distributed cases --------------------------------------------------------------------------


def _case_matches_plain_dp(dims: ParallelDims, stage: int, depth: int = 2,
                           layers_per_unit: int | None = 1, unit_layers: int | None = None,
                           units: int | None = None, bucket_numel: int | None = None,
                           optimizer: str = "adam", **overrides) -> None:
    """Losses, grad norms (clipping active) and final weights equal plain DP to 1e-5 (fp32),
    with two micro-batches per step; at stage 3 the engine never holds all layers at once.
    `depth`: the gradient reductions' pipeline depth (ZeroConfig.reduce_pipeline_depth);
    `layers_per_unit`: ZeroConfig's; `unit_layers`: with layers_per_unit None, unit_params is
    that many layers' parameters (`units`: how many units that makes, root included);
    `bucket_numel`: stage 0's buckets; `optimizer`: 'adam' or 'sgd' (momentum)."""
    steps, num_micro = 3, 2
    reference, expected = _plain_dp(dims, steps, num_micro, clip=0.5, optimizer=optimizer,
                                    **overrides)
    layer = reference.decoder.layers[0]
    sizing = {} if unit_layers is None else {
        "unit_params": unit_layers * sum(p.numel() for p in layer.parameters()), "min_units": 1}
    if bucket_numel is not None:
        sizing["bucket_numel"] = bucket_numel
    engine = _engine(dims, clip=0.5, stage=stage, model_overrides=overrides,
                     reduce_pipeline_depth=depth, layers_per_unit=layers_per_unit,
                     optimizer=optimizer, **sizing)
    layers = overrides.get("num_layers", 2)
    assert len(engine.units) == (units or 1 + -(-layers // layers_per_unit))
    got = _train(engine, dims, range(steps), num_micro)
    for (loss, result), (want_loss, want) in zip(got, expected):
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
        assert_close(result.grad_norm, want.grad_norm, 1e-5, "grad norm")
        assert want.grad_norm > 0.5  # the clip was active
    if stage in (0, 1):  # reducing every micro-batch (no no_sync) accumulates the same grads
        eager = _train(_engine(dims, clip=0.5, stage=stage, model_overrides=overrides,
                               optimizer=optimizer), dims,
                       range(steps), num_micro, sync_every_micro=True)
        for (loss, result), (want_loss, want) in zip(eager, expected):
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
            assert_close(result.grad_norm, want.grad_norm, 1e-5, "grad norm, no no_sync")
    full, want_full = engine.full_state_dict(), reference.full_state_dict()
    assert full.keys() == want_full.keys()
    for name, value in want_full.items():
        assert_close(full[name], value, 1e-5, name)
    if stage == 3:
        assert any(u.numel % dims.dp for u in engine.units) == ("hidden_size" in overrides)
        unit_bytes = [4 * u.padded_numel for u in engine.units]  # root first, then layers
        largest = sorted(unit_bytes[1:])[-2:]
        # parameters and gradient buffers of the root and at most two units at a time
        assert engine.memory_stats()["transient_peak"] <= 2 * (unit_bytes[0] + sum(largest))
        assert engine.memory_stats()["params"] * dims.dp == sum(unit_bytes)


def _case_one_backward_matches_dp(dims: ParallelDims, stage: int, **overrides) -> None:
    """one_backward_per_step: each backward writes its gradients over the last step's (hooks
    copy, the fused weight-gradient GEMMs write; nothing zeroes the buffers), and trains as plain
    DP with one micro-batch a step: losses, grad norms and final weights to 1e-5. A second
    backward in one step is refused before its reduction, on every rank alike."""
    steps = 3
    reference, expected = _plain_dp(dims, steps, 1, clip=0.5, **overrides)
    engine = _engine(dims, clip=0.5, stage=stage, model_overrides=overrides,
                     one_backward_per_step=True)
    assert engine.grads.overwrite
    got = _train(engine, dims, range(steps), 1)
    for (loss, result), (want_loss, want) in zip(got, expected):
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
        assert_close(result.grad_norm, want.grad_norm, 1e-5, "grad norm")
    full, want_full = engine.full_state_dict(), reference.full_state_dict()
    for name, value in want_full.items():
        assert_close(full[name], value, 1e-5, name)
    tokens, labels = _batch(dims, steps)
    engine.backward(engine(tokens, labels=labels).mean())
    with pytest.raises(RuntimeError, match="a second backward in one step"):
        engine.backward(engine(tokens, labels=labels).mean())


def _case_qgz_matches_reduce_scatter(bits: int, full_range: bool = False) -> None:
    """qgZ's result is reduce-scatter's average within the quantization bound, on 2 x 2, 1 x 4
    and 4 x 1 nodes, for a chunk that is not a whole number of blocks. full_range (DeepSpeed's
    levels): a clipped block maximum errs by a whole step, so twice the bound."""
    qmax, block, chunk = 2 ** (bits - 1) - 1, 64, 301
    for gpus_per_node in (2, 4, 1):
        dims = ParallelDims(tp=1, gpus_per_node=gpus_per_node)
        gen = torch.Generator().manual_seed(dims.rank)
        common = torch.randn(dims.dp * chunk, generator=torch.Generator().manual_seed(99))
        flat = common + 0.5 * torch.randn(dims.dp * chunk, generator=gen)
        everyone = torch.empty(dims.dp * flat.numel())
        all_gather_single(everyone, flat, group=dims.dp_group)
        everyone = everyone.view(dims.dp, -1)
        expected = collectives.reduce_scatter(CommCounter(2), flat / dims.dp, dims.dp_group,
                                              torch.float32).wait()
        found = torch.zeros((), dtype=torch.bool)
        comm = CommCounter(gpus_per_node)
        got = collectives.reduce_scatter_quantized(comm, flat, dims, bits, block, found,
                                                   full_range).wait()
        # Each input's block error <= absmax / (2 qmax); the node sums' requantization adds
        # <= (their absmax, itself <= (1 + 1 / (2 qmax)) x the inputs') / (2 qmax); all / dp.
        mine = everyone[:, dims.dp_rank * chunk:(dims.dp_rank + 1) * chunk]
        padded = torch.nn.functional.pad(mine, (0, -chunk % block)).view(dims.dp, -1, block)
        bound = padded.abs().amax(dim=2).sum(dim=0) / qmax / dims.dp * (1 + 1 / (4 * qmax))
        bound = bound.repeat_interleave(block)[:chunk] * 1.001 * (2 if full_range else 1) + 1e-6
        error = (got - expected).abs()
        assert not found and got.shape == (chunk,)
        assert bool((error <= bound).all()), f"P={gpus_per_node}: {(error / bound).max():.3f}"
        assert error.max() > 0.02 * bound.max(), "not quantized?"
        if gpus_per_node == 2:
            assert set(comm.bytes["gradients"]) == {"intra", "inter"}


def _case_qwz_gather_within_bound() -> None:
    dims = ParallelDims(tp=1, gpus_per_node=2)
    shard = torch.randn(1001, generator=torch.Generator().manual_seed(dims.rank))
    for dtype in (torch.float32, torch.bfloat16):
        exact = collectives.all_gather(CommCounter(2), shard.to(dtype), dims.dp_group,
                                       "w").wait()
        got = collectives.all_gather_quantized(CommCounter(2), shard.to(dtype), dims.dp_group,
                                               8, 128, "w").wait()
        assert got.dtype == dtype
        blocks = torch.nn.functional.pad(exact.float().view(dims.dp, -1), (0, 23))
        scale = blocks.view(dims.dp, -1, 128).abs().amax(2) / 127
        bound = scale.repeat_interleave(128, dim=1)[:, :1001].reshape(-1) * 0.51
        if dtype == torch.bfloat16:
            bound = bound + exact.float().abs() / 128  # bf16's own rounding
        assert bool(((got.float() - exact.float()).abs() <= bound).all())


def _case_zeropp_trains_like_zero3(dims: ParallelDims) -> None:
    """100 steps: full ZeRO++ (qwZ int8, hpZ, qgZ int4) ends within 3% of ZeRO-3's loss (the
    mean of the last 5 steps). The gap is int4's, a steady 1-2% at every late step, and depends
    on the random draws: 1.3% with the CPU's, 2.0% with a GPU's.

    Blocks of 256: 4 rows of this 64-wide model, still coarser than the default 2048 is for a
    4096-wide one (half a row). At 2048 (32 rows here) int4 rounds most of a block's gradients to
    zero and this model ends ~5% behind after 100 steps (int8: 0.2%)."""
    steps = range(100)
    zero3 = [loss for loss, _ in _train(_engine(dims, stage=3), dims, steps)]
    zeropp = [loss for loss, _ in _train(_engine(dims, stage=3, block_size=256, **ZERO_PP),
                                         dims, steps)]
    first, end3, endpp = zero3[0], sum(zero3[-5:]) / 5, sum(zeropp[-5:]) / 5
    assert end3 < 0.5 * first, f"ZeRO-3 did not learn: {first:.3f} -> {end3:.3f}"
    assert abs(endpp - end3) <= 0.03 * end3, f"ZeRO++ {endpp:.4f} vs ZeRO-3 {end3:.4f}"


def _case_zeropp_grouped(dims: ParallelDims) -> None:
    """Full ZeRO++ with 2 layers a unit (5 layers: units of 2, 2, 1) over 6 steps stays within 3%
    of ZeRO-3's losses, as with 1 layer a unit (CPU: within 1%; 1.8% seen on the GPU, whose
    random draws differ), and a step issues fewer collectives than with 1 layer a unit."""
    steps, model = range(6), {"num_layers": 5}
    zero3 = [loss for loss, _ in _train(_engine(dims, stage=3, model_overrides=model), dims,
                                        steps)]
    calls = {}
    for per_unit in (1, 2):
        engine = _engine(dims, stage=3, block_size=256, model_overrides=model,
                         layers_per_unit=per_unit, **ZERO_PP)
        losses = [loss for loss, _ in _train(engine, dims, steps)]
        for got, want in zip(losses, zero3):
            assert abs(got - want) <= 0.03 * want, (per_unit, got, want)
        calls[per_unit] = sum(engine.comm.calls.values())
    assert [u.name for u in engine.units][1:] == ["decoder.layers.0-1", "decoder.layers.2-3",
                                                  "decoder.layers.4"]
    assert calls[2] < 0.7 * calls[1], calls


def _case_zeropp_full_range(dims: ParallelDims) -> None:
    """Full ZeRO++ quantizing with DeepSpeed's levels (quantize_full_range) trains like ZeRO-3
    (within 3% over 6 steps), moves the same bytes as the default scheme and does quantize
    otherwise (its losses differ from the default scheme's)."""
    steps = range(6)
    zero3 = [loss for loss, _ in _train(_engine(dims, stage=3), dims, steps)]
    sent, history = {}, {}
    for full_range in (False, True):
        engine = _engine(dims, stage=3, block_size=256, quantize_full_range=full_range,
                         **ZERO_PP)
        history[full_range] = [loss for loss, _ in _train(engine, dims, steps)]
        for got, want in zip(history[full_range], zero3):
            assert abs(got - want) <= 0.03 * want, (full_range, got, want)
        sent[full_range] = dict(engine.comm.bytes)
    assert sent[True] == sent[False]
    assert history[True] != history[False]


def _case_stage1_qgz(dims: ParallelDims) -> None:
    """Stage 1 with qgZ (int8) tracks stage 1 within 1% over 6 steps of 2 micro-batches, on a
    model whose layers do not divide by DP (padded flat buffers)."""
    odd = dict(hidden_size=62, num_attention_heads=2)
    plain = [loss for loss, _ in _train(_engine(dims, stage=1, model_overrides=odd), dims,
                                        range(6), num_micro=2)]
    quantized = [loss for loss, _ in _train(
        _engine(dims, stage=1, quantized_gradients=True, gradient_bits=8, model_overrides=odd),
        dims, range(6), num_micro=2)]
    assert plain[-1] < 0.95 * plain[0] and quantized != plain
    for got, want in zip(quantized, plain):
        assert abs(got - want) <= 0.01 * want, (quantized, plain)


def _serialize(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _case_hpz_checkpoint_resumes(dims: ParallelDims) -> None:
    """Save at step 3 and load into an engine whose hpZ copies hold later weights: the load drops
    them, and steps 3-5 repeat the uninterrupted run's losses."""
    uninterrupted = [loss for loss, _ in _train(_engine(dims, **ZERO_PP), dims, range(6))]
    engine = _engine(dims, **ZERO_PP)
    _train(engine, dims, range(3))
    saved = _serialize(engine.state_dict())
    _train(engine, dims, range(3, 5))
    with torch.no_grad():
        engine(*_batch(dims, 9)[:1])  # leaves valid hpZ copies of the step-5 weights
    assert all(s is not None for s in engine.params.secondary)
    engine.load_state_dict(saved)
    assert all(s is None for s in engine.params.secondary)
    resumed = [loss for loss, _ in _train(engine, dims, range(3, 6))]
    for got, want in zip(resumed, uninterrupted[3:]):
        assert abs(got - want) <= 1e-6 * want, (resumed, uninterrupted[3:])
    # another unit layout is refused by name, before any collective
    with pytest.raises(ValueError, match="--zero-layers-per-unit"):
        _engine(dims, layers_per_unit=2, **ZERO_PP).load_state_dict(saved)


def _case_qwz_quantizes_once_per_step(dims: ParallelDims) -> None:
    """qwZ without hpZ: a unit's shard is quantized at its first gather of a step only; the
    backward's and the second micro-batch's gathers send the cached payload, counted in the
    memory meter until the step drops it. Losses and grad norms equal qwZ + hpZ's exactly (the
    same once-quantized weights in every gather)."""
    calls = []
    quantize_shard = collectives.quantize_shard

    def counting(shard, bits, block_size, full_range=False):
        calls.append(shard.numel())
        return quantize_shard(shard, bits, block_size, full_range)

    collectives.quantize_shard = counting
    try:
        engine = _engine(dims, quantized_weights=True, block_size=256)
        history = []
        for step in range(2):
            calls.clear()
            total = 0.0
            for micro in range(2):
                tokens, labels = _batch(dims, step, micro, num_micro=2)
                with engine.no_sync() if micro == 0 else contextlib.nullcontext():
                    loss = engine(tokens, labels=labels).mean()
                    engine.backward(loss / 2)
                total += loss.item() / 2
            assert calls == [shard.numel() for shard in engine.params.shards]
            cached = list(engine.params.quantized)
            assert all(payload is not None for payload in cached)
            held = engine.meter.current
            history.append((_dp_mean(total, dims), engine.step()))
            assert all(payload is None for payload in engine.params.quantized)
            assert held - engine.meter.current == sum(p.numel() for p in cached)
        assert engine.comm.calls["weights backward"] > 0
    finally:
        collectives.quantize_shard = quantize_shard
    hpz = _train(_engine(dims, quantized_weights=True, hpz_partition_size=2, block_size=256),
                 dims, range(2), num_micro=2)
    for (loss, result), (want_loss, want) in zip(history, hpz):
        assert loss == want_loss and result.grad_norm == want.grad_norm, (history, hpz)


def _case_nonfinite(dims: ParallelDims) -> None:
    """inf on one rank only: every rank skips (weights and optimizer state unchanged; an
    fp16-style loss scaler backs off), or every rank raises with on_nonfinite='error'; on the
    plain and the qgZ path, deciding on the host (foreach AdamW) or on the device (fused)."""
    tokens, labels = _batch(dims, 0)
    poison = float("inf") if dims.rank == 1 else 1.0
    for zero, optimizer in ((dict(stage=3, quantized_gradients=True), "adam"),
                            (dict(stage=1), "adam"), (dict(stage=1), "adam-fused"),
                            (dict(stage=0), "adam-fused")):
        scaler = DynamicLossScaler(1024.0, 1.0, window=10, hysteresis=1)
        engine = _engine(dims, loss_scaler=scaler, optimizer=optimizer, **zero)
        assert engine.optimizer._skips_on_device == (optimizer == "adam-fused")
        before = engine.full_state_dict()
        engine.backward(engine(tokens, labels=labels).mean() * poison)
        result = engine.step()
        assert result.skipped and scaler.scale == 512.0
        for name, value in engine.full_state_dict().items():
            assert torch.equal(value, before[name]), name
        for state in engine.optimizer.optimizer.state.values():  # fused: made, not stepped
            assert state["step"] == 0 and not state["exp_avg"].any(), state
        engine.backward(engine(tokens, labels=labels).mean())
        assert not engine.step().skipped
        strict = _engine(dims, on_nonfinite="error", optimizer=optimizer, **zero)
        strict.backward(strict(tokens, labels=labels).mean() * poison)
        with pytest.raises(FloatingPointError):
            strict.step()


def _case_bf16_zeropp(dims: ParallelDims) -> None:
    """bf16 parameters (read natively by qwZ), fp32 masters; ZeRO++'s inter-node bytes per step
    are <= 0.26 x ZeRO-3's (int8 weights, int4 gradients)."""
    inter = {}
    for name, zero in (("zero3", dict(reduce_dtype="bfloat16")), ("zeropp", ZERO_PP)):
        engine = _engine(dims, model_overrides=dict(params_dtype="bfloat16"), stage=3, **zero)
        _train(engine, dims, range(1))
        engine.comm.reset()
        ((loss, result),) = _train(engine, dims, range(1, 2))
        assert math.isfinite(loss) and not result.skipped
        inter[name] = engine.comm.totals()["inter"]
        assert all(s.dtype == torch.bfloat16 for s in engine.params.shards)
        assert all(m.dtype == torch.float32 for m in engine.optimizer.masters)
    assert inter["zeropp"] <= 0.26 * inter["zero3"], inter


def _case_counter() -> None:
    dims = ParallelDims(tp=1, gpus_per_node=2)
    comm = CommCounter(2)
    comm.all_gather(torch.empty(4 * 25), torch.ones(25), dims.dp_group, "a")
    comm.reduce_scatter(torch.empty(25), torch.ones(100), dims.dp_group, "b")
    comm.all_to_all(torch.empty(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8),
                    dims.intra_node_group, "c")
    comm.all_to_all(torch.empty(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8),
                    dims.inter_node_group, "c")
    assert comm.bytes == {"a": {"intra": 100, "inter": 200}, "b": {"intra": 100, "inter": 200},
                          "c": {"intra": 8, "inter": 8}}
    assert comm.totals() == {"intra": 208, "inter": 408}


SUITE = DistSuite(worlds=(4,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"nodes": ParallelDims(tp=1, gpus_per_node=2),
            "tp_dp": ParallelDims(tp=2, gpus_per_node=4)}


SUITE.case("counter", _case_counter)
# stage 0's buckets of 30000 elements: a few per layer, cut inside layers
SUITE.case("stage0_matches_dp", _case_matches_plain_dp, C.nodes, 0, num_layers=3,
           bucket_numel=30_000, units=5)
SUITE.case("stage0_tp2_sp_matches_dp", _case_matches_plain_dp, C.tp_dp, 0,
           sequence_parallel=True, units=1)
SUITE.case("stage1_matches_dp", _case_matches_plain_dp, C.nodes, 1, num_layers=4)
SUITE.case("stage0_one_backward_matches_dp", _case_one_backward_matches_dp, C.nodes, 0,
           num_layers=3)
SUITE.case("stage1_one_backward_tp2_sp_matches_dp", _case_one_backward_matches_dp, C.tp_dp, 1,
           sequence_parallel=True)
for stage in (0, 1, 3):  # --optimizer sgd: torch's SGD with momentum on the same masters
    SUITE.case(f"stage{stage}_sgd_matches_dp", _case_matches_plain_dp, C.nodes, stage,
               optimizer="sgd", units=1 if stage == 0 else None)
# hidden 62: a layer's 46934 elements do not divide by DP=4 (its flat buffer is padded)
SUITE.case("stage3_matches_dp", _case_matches_plain_dp, C.nodes, 3, num_layers=4,
           hidden_size=62, num_attention_heads=2)
SUITE.case("stage3_depth1_matches_dp", _case_matches_plain_dp, C.nodes, 3, depth=1,
           num_layers=3)
SUITE.case("stage3_tp2_sp_matches_dp", _case_matches_plain_dp, C.tp_dp, 3,
           sequence_parallel=True)
SUITE.case("stage3_recompute_matches_dp", _case_matches_plain_dp, C.nodes, 3, num_layers=3,
           recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
# 2 layers a unit with recompute checkpointing 3 layers at a time: the checkpoints cut units
SUITE.case("stage3_grouped_recompute_matches_dp", _case_matches_plain_dp, C.nodes, 3,
           layers_per_unit=2, num_layers=5, recompute_granularity="full",
           recompute_method="uniform", recompute_num_layers=3)
SUITE.case("stage1_grouped_matches_dp", _case_matches_plain_dp, C.nodes, 1, layers_per_unit=3,
           num_layers=4)
# units by parameter count (the default sizing): 2 + 2 + 1 layers of 5
SUITE.case("stage3_unit_params_matches_dp", _case_matches_plain_dp, C.nodes, 3,
           layers_per_unit=None, unit_layers=2, units=4, num_layers=5)
SUITE.case("zeropp_grouped", _case_zeropp_grouped, C.nodes)
SUITE.case("qgz_int4", _case_qgz_matches_reduce_scatter, 4)
SUITE.case("qgz_int8", _case_qgz_matches_reduce_scatter, 8)
SUITE.case("qgz_int4_full_range", _case_qgz_matches_reduce_scatter, 4, True)
SUITE.case("zeropp_full_range", _case_zeropp_full_range, C.nodes)
SUITE.case("qwz_gather", _case_qwz_gather_within_bound)
SUITE.case("stage1_qgz", _case_stage1_qgz, C.nodes)
SUITE.case("qwz_cache", _case_qwz_quantizes_once_per_step, C.nodes)
SUITE.case("nonfinite", _case_nonfinite, C.nodes)
SUITE.case("bf16_bytes", _case_bf16_zeropp, C.nodes)
SUITE.case("hpz_checkpoint", _case_hpz_checkpoint_resumes, C.nodes)
SUITE.case("zeropp_100_steps", _case_zeropp_trains_like_zero3, C.nodes)
# the same engine under TP x DP: its code paths are the other cases' at world 4
SUITE.case("zeropp_100_steps_tp2", _case_zeropp_trains_like_zero3, C.tp_dp, worlds=(),
           slow_worlds=(4,))

test_zero = SUITE.test()


def test_the_engine_imports_nothing_of_the_training_package():
    """The data-parallel engine sits below the training loop: no module of megadomino/zero
    imports megadomino.train or megadomino.cli (the loop, its reports and checkpoints drive the
    engine)."""
    import ast
    from pathlib import Path

    root = Path(__file__).parent.parent / "megadomino" / "zero"
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} {name}" for name in names
                      if name.split(".")[:2] in (["megadomino", "train"], ["megadomino", "cli"])]
    assert not found, found
