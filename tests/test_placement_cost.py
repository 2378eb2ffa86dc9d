"""The placement cost model (megadomino/pipeline/placement/cost.py): the parameters it counts are
a built model's (GPT tied, GPT untied, Llama with GQA and SwiGLU), its FLOPs are the MFU line's,
a boundary's and a DP reduce's seconds are the hand-computed ones, a plan's predicted step is
the simulator's ideal pipeline on free links, a measurement survives its JSON, the OP-Fence
stage terms are the per-stage times; and the emulated link delay delays every receive's wait."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megadomino.config import Config, ModelConfig, ParallelConfig
from megadomino.config.flops import layer_params
from megadomino.config.tree import build
from megadomino.distributed import ParallelDims
from megadomino.models import FAMILIES
from megadomino.pipeline.placement.cost import (
    Machine,
    Workload,
    predict,
    reduce_time,
    stage_costs,
    transfer_time,
)
from megadomino.pipeline.placement.planners import to_plan
from megadomino.pipeline.transport_delay import DelayedTransport
from megadomino.train.metrics import num_floating_point_operations

pytestmark = pytest.mark.usefixtures("single_process_group")

MODELS = {
    "gpt tied": ("gpt", ModelConfig.preset("gpt-tiny", num_layers=3)),
    "gpt untied": ("gpt", ModelConfig.preset("gpt-tiny", num_layers=3,
                                             untie_embeddings_and_output_weights=True)),
    "llama": ("llama", ModelConfig.preset("llama-tiny", num_layers=3)),
}


def _config(model: ModelConfig, micro: int = 4, batch: int = 16) -> Config:
    return Config(model=model, train=build(Config, {"train": {"schedule": {
        "micro_batch_size": micro, "global_batch_size": batch}}}).train)


def _count(part) -> int:
    return sum(p.numel() for p in part.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_parameters_are_a_built_models(name):
    family, model = MODELS[name]
    work, dims, layers = Workload.from_config(_config(model)), ParallelDims(tp=1), model.num_layers
    first = FAMILIES[family](model, dims, "cpu", layer_range=(0, 1), pre_process=True,
                             post_process=False)
    middle = FAMILIES[family](model, dims, "cpu", layer_range=(1, 2), pre_process=False,
                              post_process=False)
    last = FAMILIES[family](model, dims, "cpu", layer_range=(2, layers), pre_process=False,
                            post_process=True)
    assert _count(middle) == layer_params(model) == work.layer_params
    assert _count(first) == work.stage_params(0, 1)
    assert _count(last) == work.stage_params(2, layers)
    whole = FAMILIES[family](model, dims, "cpu")
    assert _count(whole) == work.stage_params(0, layers) - work.tied_params


@pytest.mark.parametrize("name", MODELS)
def test_flops_are_the_mfu_lines(name):
    _, model = MODELS[name]
    work = Workload.from_config(_config(model))
    step = 3 * work.stage_flops(0, model.num_layers)  # forward + 2 x forward, one sequence
    assert step == num_floating_point_operations(model, 1, model.padded_vocab_size(1))


def _work(**changes) -> Workload:
    base = Workload(num_layers=4, layer_flops=100.0, head_flops=50.0, activation_bytes=10.0,
                    layer_params=7, first_params=3, last_params=5, tied_params=0, grad_bytes=4,
                    micro_batch=3, micro_batches=6)
    return dataclasses.replace(base, **changes)


def _machine() -> Machine:
    bandwidth = [[0, 10, 20, 40], [10, 0, 5, 40], [20, 5, 0, 40], [40, 40, 40, 0]]
    return Machine.uniform([1.0, 2.0, 4.0, 1.0], bandwidth, latency=0.5)


def test_a_boundary_is_its_busiest_ranks_messages():
    work, machine = _work(), _machine()
    # (0, 1) split 3 rows as [2, 1]; rank 2 receives both: 0.5 + 20/20 and 0.5 + 10/5
    assert transfer_time(work, machine, (0, 1), (2,)) == pytest.approx(1.5 + 2.5)
    # [2, 1] -> [2, 1]: position to position, 0 -> 2 (20 bytes), 1 -> 3 (10 bytes)
    assert transfer_time(work, machine, (0, 1), (2, 3)) == pytest.approx(0.5 + 20 / 20)
    # one rank to two: rank 0 sends 20 bytes to 1 and 10 to 2
    assert transfer_time(work, machine, (0,), (1, 2)) == pytest.approx(2.5 + 1.0)


def test_a_dp_reduce_is_a_ring_over_its_slowest_edge():
    machine = _machine()
    assert reduce_time(machine, (3,), 100.0) == 0.0
    # ring 0 -> 1 -> 2 -> 0 of 90 bytes: a step moves 30; slowest edge 1 -> 2 at 5
    assert reduce_time(machine, (0, 1, 2), 90.0) == pytest.approx(2 * 2 * (0.5 + 30 / 5))


def test_stage_terms_are_compute_plus_the_reduce_per_micro_batch():
    work, machine = _work(), _machine()
    table = stage_costs(work, machine, (1, 2))
    per_flop = max(2 / 2.0, 1 / 4.0)  # rows [2, 1] on speeds 2 and 4
    for start, end in ((0, 1), (1, 3), (2, 4), (0, 4)):
        compute = 3 * work.stage_flops(start, end) * per_flop
        nbytes = work.stage_params(start, end) * work.grad_bytes
        assert table[start, end] == pytest.approx(
            compute + reduce_time(machine, (1, 2), nbytes) / work.micro_batches)
    assert math.isinf(table[2, 2]) and math.isinf(table[3, 1])


def test_free_links_predict_the_ideal_pipeline():
    work = _work(head_flops=0.0, first_params=0, last_params=0, micro_batch=1)
    machine = Machine.uniform([1.0] * 4, [[math.inf] * 4 for _ in range(4)])
    estimate = predict(to_plan(((0,), (1,), (2,), (3,)), [(s, s + 1) for s in range(4)], 4),
                       work, machine)
    assert estimate.step == pytest.approx((6 + 4 - 1) * 300.0)  # (m + p - 1)(F + B)
    assert estimate.bottleneck == pytest.approx(300.0)


def test_a_measurement_survives_its_json():
    machine = _machine()
    assert Machine.from_json(machine.to_json()) == machine
    assert math.isinf(Machine.from_json(machine.to_json()).bandwidth[2][2])


class _Handle:
    def __init__(self, log: list):
        self.log = log

    def wait(self):
        self.log.append("wait")


class _Transport:
    def __init__(self, log: list):
        self.log = log

    def send_activation(self, tensor, micro, chunk):
        return _Handle(self.log)

    def recv_activation(self, micro, chunk):
        return _Handle(self.log), torch.zeros(1)

    send_grad, recv_grad = send_activation, recv_activation

    def flush(self):
        self.log.append("flush")


def test_the_link_delay_follows_every_received_wait(monkeypatch):
    log: list = []
    monkeypatch.setattr("megadomino.pipeline.transport_delay.time.sleep",
                        lambda seconds: log.append(("sleep", seconds)))
    transport = DelayedTransport(_Transport(log), 0.25)
    transport.send_activation(torch.zeros(1), 0, 0).wait()
    transport.recv_activation(0, 0)[0].wait()
    transport.send_grad(torch.zeros(1), 0, 0).wait()
    transport.recv_grad(0, 0)[0].wait()
    transport.flush()
    assert log == ["wait", "wait", ("sleep", 0.25), "wait", "wait", ("sleep", 0.25), "flush"]


def test_an_emulated_slow_rank_stretches_only_its_computes(monkeypatch):
    from torch import nn

    from megadomino.pipeline import executor as module
    from megadomino.pipeline.schedules import Action

    clock, slept, done = iter([10.0, 10.5, 20.0, 20.25]), [], []
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(module.time, "sleep", slept.append)
    runner = module.Executor(nn.ModuleList(), None, 0, 1, slowdown=3.0)
    monkeypatch.setattr(runner, "_do", lambda action, batches, state: done.append(action.op))
    for action in (Action("F", "forward", 0), Action("F", "send", 0), Action("B", "wait", 0,
                                                                              waits="recv"),
                   Action("B", "backward", 0)):
        runner._do_slowed(action, [], None)
    assert done == ["forward", "send", "wait", "backward"]
    assert slept == [pytest.approx(1.0), pytest.approx(0.5)]  # (3 - 1) x 0.5 s and x 0.25 s


def test_the_slow_rank_flag_names_one_rank():
    from megadomino.config.parallel import ParallelConfig

    parallel = ParallelConfig(emulate_slow_rank="2:1.5")
    assert [parallel.slowdown(rank) for rank in range(4)] == [1.0, 1.0, 1.5, 1.0]
    assert ParallelConfig().slowdown(0) == 1.0


@pytest.mark.parametrize("flag, gloo, nccl", [(None, True, False), (True, True, True),
                                              (False, False, False)])
def test_receives_prefetched_by_backend_unless_the_flag_says(flag, gloo, nccl):
    """Unset, pipeline receives are prefetched on gloo only (an NCCL receive holds SMs through
    the compute it overlaps); --overlap-p2p-communication / --no-... decide on both. The
    placement's workload prices what the runtime will run."""
    parallel = ParallelConfig(overlap_p2p_communication=flag)
    assert (parallel.prefetches_receives(nccl=False), parallel.prefetches_receives(nccl=True)) \
        == (gloo, nccl)
    config = dataclasses.replace(_config(MODELS["gpt tied"][1]), parallel=parallel)
    assert Workload.from_config(config, nccl=True).prefetch is nccl
    assert Workload.from_config(config).prefetch is gloo
