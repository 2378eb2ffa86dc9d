"""Training components: LR schedule, loss scaler, FLOPs formula, mock data, batch arithmetic
(single process), and the data-parallel engine at stage 0 (plain data parallelism): its gradient
buckets and its optimizer (2 gloo ranks, one process group for every case, see dist_utils)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from configs import make_config
from dist_utils import C, DistSuite, assert_close
from megadomino.config import ConfigError, LoggingConfig, ModelConfig, ScheduleConfig
from megadomino.config.validate import batch_plan, train_iterations
from megadomino.data import MockDataset
from megadomino.distributed import ParallelDims
from megadomino.train.lr_schedule import LRSchedule
from megadomino.train.metrics import (
    num_floating_point_operations,
    peak_tflops,
    throughput,
)
from megadomino.train.report import Reporter
from megadomino.zero import ZeroConfig, ZeroPlusPlus
from megadomino.zero.loss_scaler import DynamicLossScaler

# ---- LR schedule -------------------------------------------------------------------------------


def test_lr_warmup_is_linear_from_zero():
    schedule = LRSchedule(1.0, 0.1, warmup_steps=4, decay_steps=10, decay_style="cosine")
    assert [schedule(i) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("style, midpoint", [("linear", 0.55), ("cosine", 0.55),
                                             ("constant", 1.0)])
def test_lr_decay_styles(style, midpoint):
    schedule = LRSchedule(1.0, 0.1, warmup_steps=2, decay_steps=12, decay_style=style)
    assert schedule(7) == pytest.approx(midpoint)  # halfway through the decay
    end = 1.0 if style == "constant" else 0.1
    assert schedule(12) == pytest.approx(end)
    assert schedule(50) == pytest.approx(end)


def test_lr_cosine_shape():
    schedule = LRSchedule(2.0, 0.0, warmup_steps=0, decay_steps=8, decay_style="cosine")
    assert schedule(2) == pytest.approx(1.0 + math.cos(math.pi / 4))


def test_lr_from_config_defaults_and_warmup_fraction():
    config = ScheduleConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_fraction=0.1,
                            lr_warmup_iters=99)
    schedule = LRSchedule.from_config(config, train_iters=50, global_batch_size=4)
    assert (schedule.warmup_steps, schedule.decay_steps) == (20.0, 200)  # samples


@pytest.mark.parametrize("kwargs, flag", [
    (dict(decay_style="wsd"), "--lr-decay-style"),
    (dict(min_lr=2.0), "--min-lr"),
    (dict(warmup_steps=20), "warmup"),
])
def test_lr_schedule_refuses(kwargs, flag):
    args = dict(max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="cosine")
    with pytest.raises(ConfigError, match=flag):
        LRSchedule(**{**args, **kwargs})


# ---- loss scaler -------------------------------------------------------------------------------


def test_loss_scaler_hysteresis_then_backoff_to_min():
    scaler = DynamicLossScaler(16.0, min_scale=2.0, window=100, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 16.0  # the first overflow only uses up hysteresis
    scaler.update(found_inf=False)  # a clean step does not restore hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 8.0
    scaler.update(found_inf=True)
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0
    scaler.update(found_inf=True)
    assert scaler.scale == 2.0  # clamped at min_loss_scale


def test_loss_scaler_growth_after_window_restores_hysteresis():
    scaler = DynamicLossScaler(4.0, min_scale=1.0, window=3, hysteresis=2)
    scaler.update(found_inf=True)
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 4.0
    scaler.update(found_inf=False)
    assert scaler.scale == 8.0
    scaler.update(found_inf=True)
    assert scaler.scale == 8.0  # hysteresis was restored by the growth
    restored = DynamicLossScaler(1.0, 1.0, 3, 2)
    restored.load_state_dict(scaler.state_dict())
    restored.update(found_inf=True)
    assert restored.scale == 4.0


# ---- FLOPs and throughput ----------------------------------------------------------------------


def test_flops_gpt_by_hand():
    config = ModelConfig.preset("gpt-tiny")  # L=2, h=64, 4 heads of 16, ffn 256, s=64
    # per layer and token: QKV 64*192 + core 64*64/2*2 + out 64*64 = 20480; MLP 64*256*2 = 32768
    # per token: 2 * (20480 + 32768) + logits 64*512 = 139264, times 3 (fwd+bwd) * 2 (FMA)
    assert num_floating_point_operations(config, 8, padded_vocab_size=512) == 8 * 64 * 6 * 139264


def test_flops_llama_gqa_swiglu_by_hand():
    config = ModelConfig.preset("llama-tiny")  # L=2, h=64, 4 heads, 2 groups, ffn 176, s=64
    assert (config.num_query_groups, config.ffn_hidden_size, config.kv_channels) == (2, 176, 16)
    # per layer: QKV 64*(64+2*32) + core 64*64 + out 64*64 = 16384; SwiGLU 64*176*3 = 33792
    per_token = 6 * (2 * (16384 + 33792) + 64 * 640)
    assert num_floating_point_operations(config, 3, padded_vocab_size=640) == 3 * 64 * per_token


def test_throughput():
    metrics = throughput(8e12, tokens_per_iteration=4096, seconds_per_iteration=2.0,
                         world_size=4, peak_tflops=10.0)
    assert metrics == pytest.approx({"tflops_per_gpu": 1.0, "mfu": 0.1, "tokens_per_s": 2048.0})
    assert "mfu" not in throughput(8e12, 4096, 2.0, 4, peak_tflops=None)


@pytest.mark.parametrize("device_name, given, peak", [
    ("NVIDIA H100 80GB HBM3", None, 989.0), ("NVIDIA H100 PCIe", None, 756.0),
    ("NVIDIA H200", None, 989.0), ("NVIDIA A100-SXM4-80GB", None, 312.0),
    ("NVIDIA L4", None, None), ("CPU", None, None), ("NVIDIA L4", 121.0, 121.0),
    ("NVIDIA H100 80GB HBM3", 500.0, 500.0)])
def test_peak_is_given_or_the_gpus_own(device_name, given, peak):
    assert peak_tflops(device_name, given) == peak


def _bench_line_pattern() -> re.Pattern:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_pretrain.py"
    spec = importlib.util.spec_from_file_location("bench_pretrain", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LINE


@pytest.mark.parametrize("device, peak, shown", [
    ("cuda", 989.0, ("TFLOP/s/GPU", "MFU")), ("cuda", None, ("TFLOP/s/GPU",)), ("cpu", 989.0, ())])
def test_iteration_line_has_the_figures_that_mean_something(device, peak, shown):
    """TFLOP/s on a GPU only, MFU on a GPU whose peak is known; the CUDA line with both is what
    benchmarks/bench_pretrain.py parses."""
    reporter = Reporter.__new__(Reporter)  # _line reads only these
    reporter.device, reporter.iters, reporter.skipped = torch.device(device), 10, 0
    metrics = throughput(3.956e14, 8192, 0.5, world_size=8, peak_tflops=peak)  # 98.9 TFLOP/s
    metrics.update(loss=2.5, lr=1e-4, grad_norm=1.0, ms_per_iter=500.0, peak_memory_gib=3.0,
                   global_batch=16, data_ms=1.0, forward_ms=2.0, backward_ms=3.0, optimizer_ms=4.0)
    line = reporter._line(5, metrics, None)
    for field in ("TFLOP/s/GPU", "MFU"):
        assert (field in line) == (field in shown), line
    if len(shown) == 2:
        match = _bench_line_pattern().search(line)
        assert match is not None and match.groups()[5:7] == ("98.90", "10.00"), line


# ---- mock data and batch arithmetic ------------------------------------------------------------


def test_mock_data_is_deterministic_progressions():
    data = MockDataset(seq_length=16, vocab_size=50, seed=3)
    sample = data[7]
    assert sample.shape == (17,) and sample.dtype == torch.long
    assert torch.equal(sample, MockDataset(16, 50, seed=3)[7])
    steps = (sample[1:] - sample[:-1]) % 50
    assert steps.unique().numel() == 1 and steps[0].item() in (1, 2, 3)
    assert not torch.equal(sample, MockDataset(16, 50, seed=3, split="valid")[7])
    assert len({tuple(data[i].tolist()) for i in range(20)}) > 15
    assert int(MockDataset(300, 50, seed=0)[1].max()) < 50


def test_batch_plan():
    assert batch_plan(ScheduleConfig(micro_batch_size=2, global_batch_size=12), dp=3) == (12, 2)
    assert batch_plan(ScheduleConfig(micro_batch_size=2), dp=3) == (6, 1)
    with pytest.raises(ConfigError, match="--global-batch-size=10 .*--micro-batch-size"):
        batch_plan(ScheduleConfig(micro_batch_size=2, global_batch_size=10), dp=3)
    assert train_iterations(ScheduleConfig(train_samples=100), global_batch_size=12) == 8
    with pytest.raises(ConfigError, match="--train-iters"):
        train_iterations(ScheduleConfig(), global_batch_size=12)


# ---- distributed cases (2 ranks) ---------------------------------------------------------------


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def _plain(model: nn.Module, dims: ParallelDims, bucket_numel: int = 25_000_000, **kwargs
           ) -> ZeroPlusPlus:
    """The engine at stage 0 with AdamW as the tests' reference runs it."""
    factory = functools.partial(torch.optim.AdamW, lr=0.01, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.1, foreach=True)
    return ZeroPlusPlus(model, dims, factory, ZeroConfig(stage=0, bucket_numel=bucket_numel),
                        **kwargs)


def _main_grads(engine: ZeroPlusPlus) -> dict[int, torch.Tensor]:
    """Stage 0: each parameter's fp32 gradient (by id), its view of its bucket."""
    return {id(param): view for unit, buffer in zip(engine.units, engine.grads.grad_shards)
            for param, view in zip(unit.params, unit.views(buffer))}


def _holder(**params: nn.Parameter) -> nn.Module:
    module = nn.Module()
    for name, param in params.items():
        module.register_parameter(name, param)
    return module


def _case_dp_mean(dims: ParallelDims, dtype: torch.dtype) -> None:
    """The fp32 gradients after two micro-batches (the first under no_sync) == mean over DP
    ranks of the fp32-accumulated grads; every bucket is launched by the backward hooks, before
    finish()."""
    model = _mlp(dtype)
    reference = copy.deepcopy(model)
    engine = _plain(model, dims, bucket_numel=20)
    assert len(engine.units) == 2
    gen = torch.Generator().manual_seed(100 + dims.dp_rank)
    inputs = [torch.randn(4, 5, generator=gen).to(dtype) for _ in range(2)]
    expected = [torch.zeros(p.shape) for p in reference.parameters()]
    for x in inputs:
        reference.zero_grad()
        reference(x).square().sum().backward()
        for total, p in zip(expected, reference.parameters()):
            total += p.grad.float()
    for total in expected:
        dist.all_reduce(total, group=dims.dp_group)
        total /= dims.dp

    engine.zero_grad()
    with engine.no_sync():
        engine.backward(model(inputs[0]).square().sum())
    assert engine.grads._next == 0
    model(inputs[1]).square().sum().backward()
    assert engine.grads._next == len(engine.units)  # launched from the hooks
    engine.grads.finish()
    grads = _main_grads(engine)
    for want, p in zip(expected, model.parameters()):
        assert p.grad is None and grads[id(p)].dtype == torch.float32
        assert_close(grads[id(p)], want, 1e-6, f"main_grad {tuple(p.shape)} {dtype}")


def _case_unused_param(dims: ParallelDims) -> None:
    model = _mlp(torch.float32)
    model.unused = nn.Parameter(torch.ones(3))
    engine = _plain(model, dims, bucket_numel=1)
    engine.zero_grad()
    model(torch.ones(2, 5)).sum().backward()
    # A module's own parameters come first in parameters(), so its bucket is reduced last: the
    # hooks launch the other four, in order, and it waits for finish().
    assert [unit.params[0] is model.unused for unit in engine.units] == [True] + [False] * 4
    assert engine.grads._next == 4
    engine.grads.finish()
    grads = _main_grads(engine)
    assert torch.equal(grads[id(model.unused)], torch.zeros(3))
    assert grads[id(model[0].weight)].abs().sum() > 0


def _case_sequence_parallel_sum(dims: ParallelDims) -> None:
    """At TP=2 a sequence_parallel parameter's grad is summed over TP, others left alone."""
    sp, plain = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    sp.sequence_parallel = True
    engine = _plain(_holder(sp=sp, plain=plain), dims)
    engine.zero_grad()
    x = torch.tensor([1.0, 2.0, 3.0]) * (dims.tp_rank + 1)
    engine.backward((sp * x).sum() + (plain * x).sum())
    engine.optimizer._sum_sequence_parallel()  # the step's first action
    grads = _main_grads(engine)
    assert torch.equal(grads[id(sp)], torch.tensor([3.0, 6.0, 9.0]))
    assert torch.equal(grads[id(plain)], x)


def _reference_adamw(weight: torch.Tensor, bias: torch.Tensor, grads, lr: float):
    """torch AdamW in fp32 with the optimizer's groups (decay on 2-D only)."""
    weight, bias = weight.float().clone(), bias.float().clone()
    opt = torch.optim.AdamW([{"params": [weight], "weight_decay": 0.1},
                             {"params": [bias], "weight_decay": 0.0}], lr=lr, foreach=False)
    weight.grad, bias.grad = grads
    opt.step()
    return weight, bias


def _case_tp_grad_norm_and_clip(dims: ParallelDims) -> None:
    """Global norm counts a TP shard on every rank and a replicated param once; clipping scales
    every gradient by clip / norm before AdamW."""
    torch.manual_seed(1)
    weight = nn.Parameter(torch.randn(2, 3))
    weight.tensor_model_parallel = True
    bias = nn.Parameter(torch.randn(3))
    start = (weight.detach().clone(), bias.detach().clone())
    opt = _plain(_holder(weight=weight, bias=bias), dims, clip_grad=0.5)
    grad_w = torch.full((2, 3), 1.0 + dims.tp_rank)  # shards differ
    grad_b = torch.full((3,), 2.0)  # replicated
    opt.zero_grad()
    grads = _main_grads(opt)
    grads[id(weight)].copy_(grad_w)
    grads[id(bias)].copy_(grad_b)
    result = opt.step()
    norm = math.sqrt(6 * 1.0 + 6 * 4.0 + 3 * 4.0)
    assert result.grad_norm.item() == pytest.approx(norm, rel=1e-6)
    coef = 0.5 / (norm + 1e-6)
    want_w, want_b = _reference_adamw(*start, (grad_w * coef, grad_b * coef), lr=0.01)
    assert_close(weight.detach(), want_w, 1e-6, "clipped AdamW weight")
    assert_close(bias.detach(), want_b, 1e-6, "clipped AdamW bias")


def _case_fp16_skip_and_master(dims: ParallelDims) -> None:
    """fp16: an inf in one rank's backward skips the step on every rank (the all-reduce carries
    it to all; hysteresis, then backoff); a clean step unscales and updates the fp32 master, and
    the fp16 params are copies of the masters."""
    torch.manual_seed(2)
    weight = nn.Parameter(torch.randn(4, 3).half())
    bias = nn.Parameter(torch.randn(3).half())
    start = (weight.detach().clone(), bias.detach().clone())
    scaler = DynamicLossScaler(1024.0, min_scale=1.0, window=1000, hysteresis=2)
    opt = _plain(_holder(weight=weight, bias=bias), dims, clip_grad=0.0, loss_scaler=scaler)
    grads = _main_grads(opt)
    poison = torch.ones(4, 3, dtype=torch.half)
    if dims.rank == 1:
        poison[0, 0] = math.inf
    for expected_scale in (1024.0, 512.0):
        opt.zero_grad()
        opt.backward((weight * poison).sum() + bias.sum())
        result = opt.step()
        assert result.skipped and result.grad_norm is None
        assert scaler.scale == expected_scale
        assert torch.equal(weight.detach(), start[0]) and torch.equal(bias.detach(), start[1])
    wanted = (torch.full((4, 3), 0.25), torch.full((3,), -0.5))
    opt.zero_grad()
    grads[id(weight)].copy_(wanted[0] * scaler.scale)
    grads[id(bias)].copy_(wanted[1] * scaler.scale)
    assert not opt.step().skipped
    want_w, want_b = _reference_adamw(*start, wanted, lr=0.01)
    masters = opt.state_by_parameter()
    assert_close(masters[id(weight)]["master"], want_w, 1e-6, "fp32 master weight")
    assert_close(masters[id(bias)]["master"], want_b, 1e-6, "fp32 master bias")
    assert torch.equal(weight.detach(), want_w.half())

    copies = _holder(weight=nn.Parameter(start[0].clone()), bias=nn.Parameter(start[1].clone()))
    fresh = _plain(copies, dims, clip_grad=0.0, loss_scaler=DynamicLossScaler(1.0, 1.0, 1000, 2))
    fresh.load_state_dict(opt.state_dict())
    assert fresh.loss_scaler.scale == 512.0
    assert torch.equal(fresh.state_by_parameter()[id(copies.weight)]["master"],
                       masters[id(weight)]["master"])
    assert torch.equal(copies.weight.detach(), weight.detach())
    assert fresh.optimizer.optimizer.state_dict()["state"][0]["step"] == 1


def _case_library_runs_the_validator(dims: ParallelDims) -> None:
    """train() refuses what the command line refuses, with the same line
    (megadomino.config.validate), before it builds anything: here, configs the flags would not
    give."""
    from megadomino.config.validate import validate
    from megadomino.train.loop import train

    model = ModelConfig.preset("gpt-tiny")
    bad = [make_config(model, train_iters=2, mock_data=True, bf16=True, fp16=True),
           make_config(model, train_iters=2, mock_data=True, global_batch_size=3),
           make_config(model, train_iters=2, mock_data=True, min_lr=1.0, lr=0.1),
           make_config(model, train_iters=2, mock_data=True, stage=3, batch_slices=2),
           make_config(model, train_iters=2)]
    for config in bad:
        with pytest.raises(ConfigError) as cli:
            validate(config, dims.world_size, dims.gpus_per_node)
        with pytest.raises(ConfigError) as library:
            train(config, dims, "gpt", log=lambda line: None)
        assert str(library.value) == str(cli.value)


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"data_parallel": ParallelDims(tp=1, dp=2), "tensor_parallel": ParallelDims(tp=2, dp=1)}


for dtype in (torch.float32, torch.bfloat16):
    SUITE.case(f"dp_mean_{dtype}", _case_dp_mean, C.data_parallel, dtype)
SUITE.case("unused_param", _case_unused_param, C.data_parallel)
SUITE.case("sequence_parallel_sum", _case_sequence_parallel_sum, C.tensor_parallel)
SUITE.case("tp_grad_norm_and_clip", _case_tp_grad_norm_and_clip, C.tensor_parallel)
SUITE.case("fp16_skip_and_master", _case_fp16_skip_and_master, C.data_parallel)
SUITE.case("library_runs_the_validator", _case_library_runs_the_validator, C.data_parallel)

test_distributed_case = SUITE.test()


def test_hook_streams_ignore_cpu_tensors():
    """distributed.streams.HookStreams: CPU tensors record no stream, so join() is a no-op there
    (its CUDA behaviour: tests/gpu/test_gpu_streams.py)."""
    from megadomino.distributed.streams import HookStreams
    streams = HookStreams()
    streams.note("bucket", torch.zeros(3))
    assert streams._seen == {}
    streams.join("bucket")
    streams.join("never noted")


# ---- profiling window ----------------------------------------------------------------------------


def test_profile_window_writes_one_trace_for_its_iterations(tmp_path):
    """--profile --use-pytorch-profiler: iterations [start, end) on the listed ranks, one Chrome
    trace named in the log; other ranks and runs without --profile write nothing."""
    import json

    from megadomino.train.profiling import ProfileWindow

    config = LoggingConfig(profile=True, use_pytorch_profiler=True, profile_step_start=2,
                           profile_step_end=4, profile_ranks=[0, 3],
                           tensorboard_dir=str(tmp_path / "tb"))
    for rank, expect in ((0, True), (1, False)):
        lines: list[str] = []
        window = ProfileWindow(config, rank, lines.append)
        for iteration in range(1, 6):
            window.before(iteration)
            torch.ones(64, 64).matmul(torch.ones(64, 64))
            window.after(iteration)
        window.close()
        path = tmp_path / "tb" / f"profile_rank{rank}_iters2-4.json"
        assert path.exists() == expect, lines
        if expect:
            assert lines == [f" profile of iterations [2, 4) on rank 0: {path}"]
            assert json.loads(path.read_text())["traceEvents"]
    off = ProfileWindow(LoggingConfig(), 0, print)
    off.before(10)
    assert off.active is None


@pytest.mark.parametrize("fields, named", [
    (dict(profile=True, profile_step_start=5, profile_step_end=5), "--profile-step-end=5"),
    (dict(profile=True, profile_ranks=[4]), "--profile-ranks 4 is invalid: ranks are 0 to 1"),
])
def test_profile_window_is_checked(fields, named):
    from megadomino.config.validate import validate

    with pytest.raises(ConfigError, match=re.escape(named)):
        validate(make_config(ModelConfig.preset("gpt-tiny"), train_iters=20, mock_data=True,
                             **fields), 2)
