"""AdamW in one pass per flat master (kernels/adamw_flat.py `adamw_flat`, the CUDA default)
against torch's AdamW over the per-parameter views (fused kernel), on gloo at DP 2: stages 0, 1
and 3 (chunks of the masters), fp32, bf16 and fp16 models (the pass writes the half-precision
weights; fp16 with the loss scaler unscaling first), with
clipping and the decoupled groups' own learning rate; a non-finite step changes nothing; its
state saves in torch's format and resumes exactly, and a state saved by torch's optimizer loads
into it. On CPU the pass runs its torch reference (tests/test_adamw_flat_kernel.py checks the
Triton kernel against it under the interpreter, tests/gpu/test_gpu_adamw_flat.py on CUDA)."""

from __future__ import annotations

import contextlib
import io
from unittest import mock

import test_zero as zt
import torch

from dist_utils import C, DistSuite, assert_close
from megadomino.distributed import ParallelDims
from megadomino.kernels.adamw_flat import adamw_flat
from megadomino.zero import ZeroConfig, ZeroPlusPlus
from megadomino.zero.loss_scaler import DynamicLossScaler
from megadomino.zero.sharded import ShardedOptimizer


@contextlib.contextmanager
def _flat(on: bool):
    with mock.patch.object(ShardedOptimizer, "_flat_by_default", lambda self: on):
        yield


def _engine(dims: ParallelDims, flat: bool, stage: int, dtype: str = "float32",
            loss_scaler=None, decoupled: bool = False) -> ZeroPlusPlus:
    model = zt._build(dims, params_dtype=dtype)
    extra = {"decoupled": tuple(model.embedding_and_output_weights())} if decoupled else {}
    with _flat(flat):
        engine = ZeroPlusPlus(model, dims, zt.FACTORIES["adam-fused"], ZeroConfig(stage=stage),
                              clip_grad=0.05, loss_scaler=loss_scaler, **extra)
    assert engine.optimizer.flat == flat
    return engine


def _run(engine: ZeroPlusPlus, dims: ParallelDims, steps: range, decoupled: bool = False):
    for step in steps:
        if decoupled:
            engine.set_lr(3e-3 / (step + 1), 1e-2)
        tokens, labels = zt._batch(dims, step)
        engine.backward(engine(tokens, labels=labels).float().mean())
        result = engine.step()
        assert not result.skipped
    return engine.full_state_dict()


def _scaler(dtype: str):
    return DynamicLossScaler(1024.0, 1.0, window=10, hysteresis=1) if dtype == "float16" \
        else None


def _case_matches_torch(dims: ParallelDims, stage: int, dtype: str, decoupled: bool) -> None:
    """fp32: 6 steps within 1e-5. bf16 / fp16: one step (the weights may round one ulp apart where
    the two formulas' fp32 results straddle a bf16 boundary, and Adam's normalised update
    turns such differences in later gradients into full-size steps)."""
    steps = range(6) if dtype == "float32" else range(1)
    expected = _run(_engine(dims, False, stage, dtype, _scaler(dtype), decoupled), dims, steps,
                    decoupled)
    actual = _run(_engine(dims, True, stage, dtype, _scaler(dtype), decoupled), dims, steps,
                  decoupled)
    rel = 1e-5 if dtype == "float32" else 1e-2 if dtype == "bfloat16" else 2e-3
    for name, value in expected.items():
        assert_close(actual[name].float(), value.float(), rel, name)


def _case_skip(dims: ParallelDims) -> None:
    """inf on one rank: nothing changes (step count, moments, weights); the next step runs."""
    scaler = DynamicLossScaler(1024.0, 1.0, window=10, hysteresis=1)
    engine = _engine(dims, True, 1, "bfloat16", loss_scaler=scaler)
    tokens, labels = zt._batch(dims, 0)
    before = engine.full_state_dict()
    poison = float("inf") if dims.rank == 1 else 1.0
    engine.backward(engine(tokens, labels=labels).float().mean() * poison)
    assert engine.step().skipped and scaler.scale == 512.0
    for name, value in engine.full_state_dict().items():
        assert torch.equal(value, before[name]), name
    for state in engine.optimizer.optimizer.state.values():
        assert state["step"] == 0 and not state["exp_avg"].any()
    engine.backward(engine(tokens, labels=labels).float().mean())
    assert not engine.step().skipped
    assert all(state["step"] == 1 for state in engine.optimizer.optimizer.state.values())


def _saved(engine: ZeroPlusPlus) -> dict:
    buffer = io.BytesIO()
    torch.save(engine.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _case_resumes(dims: ParallelDims, stage: int) -> None:
    """Saved after 3 steps and loaded into a fresh engine, 3 more steps equal the uninterrupted
    run bit for bit; that state also resumes under torch's AdamW (to rounding, one step count
    per parameter), and a state saved by torch's optimizer (flat off) resumes under the flat
    pass as torch's own run continues (to rounding)."""
    whole = _engine(dims, True, stage)
    straight = _run(whole, dims, range(6))
    first = _engine(dims, True, stage)
    _run(first, dims, range(3))
    second = _engine(dims, True, stage)
    second.load_state_dict(_saved(first))
    for name, value in _run(second, dims, range(3, 6)).items():
        assert torch.equal(value, straight[name]), name
    # and back: the flat pass's state loads into torch's AdamW, whose step counts stay apart
    back = _engine(dims, False, stage)
    back.load_state_dict(_saved(first))
    steps = [state["step"] for state in back.optimizer.optimizer.state.values()]
    assert len({id(step) for step in steps}) == len(steps)
    for name, value in _run(back, dims, range(3, 6)).items():
        assert_close(value, straight[name], 1e-5, name)
    assert all(step == 6 for step in steps)
    torch_run = _engine(dims, False, stage)
    _run(torch_run, dims, range(3))
    resumed = _engine(dims, True, stage)
    resumed.load_state_dict(_saved(torch_run))
    expected = _run(torch_run, dims, range(3, 6))
    for name, value in _run(resumed, dims, range(3, 6)).items():
        assert_close(value, expected[name], 1e-5, name)


def test_adamw_flat_is_torchs_formula():
    """One flat buffer, two groups: adamw_flat equals torch's AdamW step by step, clipping and
    a skipped step included."""
    torch.manual_seed(0)
    n = 1000
    master = torch.randn(n)
    pieces = [master[:600], master[600:]]
    reference = [p.clone() for p in pieces]
    optimizer = torch.optim.AdamW([{"params": reference[:1]},
                                   {"params": reference[1:], "weight_decay": 0.0}],
                                  lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6)
    group = torch.zeros(n, dtype=torch.uint8)
    group[600:] = 1
    exp_avg, exp_avg_sq, step = torch.zeros(n), torch.zeros(n), torch.zeros(())
    weights = torch.empty(n, dtype=torch.bfloat16)
    for i in range(5):
        grad = torch.randn(n)
        skip = torch.tensor(1.0 if i == 2 else 0.0)
        coef = torch.tensor(0.5)
        step += 1 - skip
        adamw_flat(master, grad, exp_avg, exp_avg_sq, group, torch.tensor([1e-2, 1e-2]),
                   torch.tensor([0.1, 0.0]), 0.9, 0.95, 1e-6, step, coef, skip, weights)
        if i != 2:
            for p, g in zip(reference, (grad[:600], grad[600:])):
                p.grad = g * 0.5
            optimizer.step()
        assert_close(master, torch.cat(reference), 1e-6, f"step {i}")
        assert torch.equal(weights, master.to(torch.bfloat16))


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"dp": ParallelDims(tp=1)}


for _stage in (0, 1):
    SUITE.case(f"stage{_stage}_fp32", _case_matches_torch, C.dp, _stage, "float32", False)
SUITE.case("stage1_fp32_decoupled", _case_matches_torch, C.dp, 1, "float32", True)
SUITE.case("stage1_bf16_decoupled", _case_matches_torch, C.dp, 1, "bfloat16", True)
SUITE.case("stage0_bf16", _case_matches_torch, C.dp, 0, "bfloat16", False)
SUITE.case("stage3_fp32", _case_matches_torch, C.dp, 3, "float32", False)
SUITE.case("stage1_fp16_loss_scaler", _case_matches_torch, C.dp, 1, "float16", False)
SUITE.case("skip", _case_skip, C.dp)
SUITE.case("resume_stage1", _case_resumes, C.dp, 1)
SUITE.case("resume_stage0", _case_resumes, C.dp, 0)

test_adamw_flat = SUITE.test()
