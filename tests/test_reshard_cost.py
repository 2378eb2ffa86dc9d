"""The backend-aware cost model of cross-mesh resharding (reshard/cost.py, reshard/network.py),
without processes: the formulas on hand-made cases (NCCL's ring broadcast takes about the same
time for 1, 2 or 4 receivers, gloo's binomial tree at least ceil(log2(n + 1)) message times;
NCCL's ring all-gather (n - 1) / n of the data per link), the automatic choice flipping between
backends and message sizes where it should, senders balanced per device with one NIC per GPU,
NCCL's collectives serialized per rank in the plan's order, the printable line, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from megadomino.pipeline.reshard import Layout, Mesh, make_plan
from megadomino.pipeline.reshard.cost import chain_time, phase_time
from megadomino.pipeline.reshard.network import Network

RATE = 1e9  # bytes/s of every NIC
BIG = 16 << 20  # fp32 elements: 64 MiB
ALPHA = 20e-6


def mesh(first: int, hosts: str | tuple[str, ...], shape: tuple[int, ...] = ()) -> Mesh:
    """Ranks first, first+1, ... on the hosts named by the letters (or names) of `hosts`."""
    return Mesh(tuple(range(first, first + len(hosts))), tuple(hosts), shape)


def one_to(hosts: str) -> tuple[Layout, Layout]:
    """One replicated 1-D tensor from rank 0 on host A to a rank on each letter of `hosts`."""
    return Layout.replicated(mesh(0, "A"), 1), Layout.replicated(mesh(1, hosts), 1)


def predicted(layouts, strategy: str, network: Network, numel: int = BIG) -> float:
    rates = dict.fromkeys("ABCDEFGH", RATE)
    return make_plan((numel,), torch.float32, *layouts, strategy, rates=rates,
                     network=network).predicted_time()


def message_time(numel: int = BIG) -> float:
    return numel * 4 / RATE


# ---- formulas ----------------------------------------------------------------------------------

def test_chain_time_is_a_flow_shop_of_equal_chunks():
    # 3 hops of rates 1, 2, 1 bytes/s, 4 chunks of 2 bytes: hop times 0.5+2, 0.5+1, 0.5+2
    assert chain_time(8, [1.0, 2.0, 1.0], 4, 0.5, 0.25) == 3 * 0.25 + 6.5 + 3 * 2.5
    # one chunk is store and forward: every hop in turn
    assert chain_time(8, [1.0, 2.0], 1, 0.0, 0.0) == 8 + 4


@pytest.mark.parametrize("latency", [0.0, ALPHA])
def test_nccl_broadcast_hardly_depends_on_the_receiver_count(latency):
    nccl = Network("nccl", latency=latency)
    times = [predicted(one_to("BCDE"[:n]), "broadcast", nccl) for n in (1, 2, 4)]
    assert max(times) < 1.03 * min(times)
    assert min(times) >= message_time()
    # the pipeline: h hops of latency, 128 chunks of NCCL's 512 KiB, h - 1 of them to fill
    chunk = 512 * 1024 / RATE
    assert times[2] == pytest.approx(4 * latency + (128 + 3) * chunk, rel=1e-12)


def test_gloo_broadcast_grows_with_log2_of_the_group():
    gloo = Network("gloo")
    times = [predicted(one_to("BCDEFGH"[:n]), "broadcast", gloo) / message_time()
             for n in range(1, 8)]
    for n, units in enumerate(times, start=1):
        assert units >= math.ceil(math.log2(n + 1)) - 1e-9  # the root's copies, one link
    assert times[:2] == pytest.approx([1, 2])
    # 1 -> 4: the root's three sends share its uplink (3), then rank 1 forwards to rank 3 (1)
    assert times[3] == pytest.approx(4)
    assert times == sorted(times)


def test_gloo_tree_copies_that_start_together_share_a_host_link():
    """A -> B B C C D D (ranks 0 | 1 2 | 3 4 | 5 6): A sends to 1, 2, 4 (3 copies on A's
    uplink), then ranks 1 and 2, both on B, send to 3, 5 and 6 at once (3 on B's uplink)."""
    gloo = Network("gloo")
    units = predicted(one_to("BBCCDD"), "broadcast", gloo) / message_time()
    assert units == pytest.approx(6)


def test_gloo_tree_adds_a_latency_per_level():
    gloo = Network("gloo", latency=ALPHA)
    small = 16  # elements: latency-bound
    two_levels = predicted(one_to("BCD"), "broadcast", gloo, small)  # 0 -> 1, 2; 1 -> 3
    assert two_levels == pytest.approx(2 * ALPHA + 3 * message_time(small))


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_nccl_exchange_is_a_ring_allgather(replicas):
    """Scatter of B over the replicas (the source uplink carries B), then the ring all-gather:
    every ring edge carries (n - 1) / n of B, each part pipelined along n - 1 hops."""
    layouts = one_to("BCDE"[:replicas])
    plan = make_plan((BIG,), torch.float32, *layouts, "send_recv_allgather",
                     rates=dict.fromkeys("ABCDE", RATE), network=Network("nccl"))
    ring = phase_time(plan, plan.exchanges, True) / message_time()
    assert ring == pytest.approx((replicas - 1) / replicas)
    uplinks = {link: n for link, n in plan.link_bytes().items() if link[0] == "up"}
    assert uplinks[("up", "A")] == BIG * 4
    for (_, host), nbytes in uplinks.items():  # parts of 3 replicas differ by an element
        if host != "A":
            assert nbytes == pytest.approx(BIG * 4 * (replicas - 1) / replicas, abs=8)
    gloo = make_plan((BIG,), torch.float32, *layouts, "send_recv_allgather",
                     rates=dict.fromkeys("ABCDE", RATE))
    assert {edge[0] for step in gloo.exchanges for edge in step.edges} == set(layouts[1].mesh.ranks)


# ---- the automatic choice ------------------------------------------------------------------------

def auto(layouts, network: Network, numel: int = BIG, **kwargs):
    return make_plan((numel,), torch.float32, *layouts, rates=dict.fromkeys("ABCDEFGH", RATE),
                     network=network, **kwargs)


def test_one_to_four_hosts_broadcast_on_nccl_send_recv_on_gloo():
    layouts, pair = one_to("BCDE"), ("send_recv", "broadcast")
    assert auto(layouts, Network("gloo", latency=ALPHA), candidates=pair).strategy == "send_recv"
    assert auto(layouts, Network("nccl", latency=ALPHA), candidates=pair).strategy == "broadcast"
    # with every strategy: NCCL's ring beats the host-forwarded chain, gloo's tree does not
    assert auto(layouts, Network("nccl", latency=ALPHA)).strategy == "broadcast"
    assert auto(layouts, Network("gloo", latency=ALPHA)).strategy == "chained_broadcast"


def test_small_messages_take_send_recv_large_ones_the_ring():
    layouts, nccl = one_to("BCDE"), Network("nccl", latency=ALPHA)
    assert auto(layouts, nccl, numel=64).strategy == "send_recv"  # 4 alphas of hops lose
    assert auto(layouts, nccl, numel=BIG).strategy == "broadcast"


def test_auto_reports_what_it_weighed_and_backward_chooses_again():
    layouts = (Layout.replicated(mesh(0, "A"), 3), Layout.replicated(mesh(1, "BB"), 3))
    nccl, shape, rates = Network("nccl", latency=ALPHA), (64, 8, 1024), {"A": RATE, "B": RATE}
    plan = make_plan(shape, torch.float32, *layouts, rates=rates, network=nccl,
                     candidates=("send_recv", "broadcast"))
    assert plan.strategy == "broadcast"  # TP1 -> TP2: the activation crosses A's uplink once
    assert [name for name, _ in plan.considered] == ["send_recv", "broadcast"]
    for name, seconds in plan.considered:
        alone = make_plan(shape, torch.float32, *layouts, name, rates=rates, network=nccl)
        assert seconds == alone.predicted_time()
    back = plan.backward()
    assert back.strategy == "send_recv" and back.considered  # the gradient: one copy back
    assert make_plan(shape, torch.float32, *layouts, "broadcast").backward().considered == ()


# ---- links: per device, per host, GPU ports -----------------------------------------------------

def dp2tp2_to_dp4(hosts: tuple[str, str]) -> tuple[Layout, Layout]:
    """Megatron's (dp, tp) meshes, TP fastest: the batch (dim 1) split over DP, TP replicas."""
    src = Layout(mesh(0, (hosts[0],) * 4, (2, 2)), ((), (0,), ()))
    dst = Layout(mesh(4, (hosts[1],) * 4, (4, 1)), ((), (0,), ()))
    return src, dst


@pytest.mark.parametrize("nics, senders, busiest_quarters", [
    (1, [0, 0, 2, 2], 4),  # per host: one uplink, the lowest rank of each pair
    (2, [0, 0, 2, 2], 2),  # GPUs 0-1 share NIC 0, 2-3 NIC 1
    (4, [0, 1, 2, 3], 1),  # per device: each NIC sends one quarter
])
def test_senders_balanced_per_device_or_per_host(nics, senders, busiest_quarters):
    layouts = dp2tp2_to_dp4(("n0", "n1"))
    network = Network(gpus_per_host=4, nics_per_host=nics)
    plan = make_plan((8, 8, 4), torch.float32, *layouts, "send_recv", network=network)
    assert [step.sender for step in plan.steps] == senders
    quarter = 8 * 2 * 4 * 4
    assert plan.makespan() == busiest_quarters * quarter


def test_gpu_ports_rate_traffic_inside_a_host():
    layouts = (Layout.replicated(mesh(0, "A"), 1), Layout.replicated(mesh(1, "AAA"), 1))
    unrated = Network("nccl", gpus_per_host=4)
    assert make_plan((64,), torch.float32, *layouts, network=unrated).makespan() == 0
    nvlink = Network("nccl", gpus_per_host=4, local_rate=RATE)
    plan = make_plan((BIG,), torch.float32, *layouts, "send_recv", network=nvlink)
    assert plan.link_bytes()[("out", "A/gpu0")] == 3 * BIG * 4
    assert auto(layouts, nvlink).strategy == "broadcast"


def test_nccl_collectives_run_one_after_another_on_a_rank():
    """On one host (unrated loopback) only latency counts: two broadcasts from one rank take
    twice one on NCCL (one stream), once on gloo (each group its own threads)."""
    layouts = dp2tp2_to_dp4(("n0", "n0"))
    for backend, rounds in (("nccl", 2), ("gloo", 1)):
        network = Network(backend, latency=ALPHA, gpus_per_host=8)
        plan = make_plan((8, 8, 4), torch.float32, *layouts, "broadcast", network=network)
        assert [step.sender for step in plan.steps] == [0, 0, 2, 2]
        assert plan.predicted_time() == pytest.approx(rounds * ALPHA)


# ---- the printable line, bad input --------------------------------------------------------------

def test_describe_names_the_choice_and_its_time():
    layouts = dp2tp2_to_dp4(("n0", "n1"))
    network = Network("nccl", latency=ALPHA, gpus_per_host=4, nics_per_host=4)
    plan = make_plan((1024, 8, 1024), torch.bfloat16, *layouts,
                     rates={"n0": 25e9, "n1": 25e9}, network=network)
    line = plan.describe()
    assert line.startswith(f"ranks 0-3 -> 4-7 (1024, 8, 1024) bfloat16: {plan.strategy} "
                           "(least_bytes; nccl, senders balanced per device) predicted ")
    assert "busiest up n0/nic" in line and "4 MiB" in line
    assert all(name in line for name, _ in plan.considered) and "\n" not in line


@pytest.mark.parametrize("call, match", [
    (lambda: Network("mpi"), "backend"),
    (lambda: Network(nics_per_host=2), "nics_per_host"),
    (lambda: Network(gpus_per_host=0), "gpus_per_host"),
    (lambda: Network(latency=-1.0), "latency"),
    (lambda: Network(local_rate=0.0), "local_rate"),
    (lambda: make_plan((4,), torch.float32, *one_to("B"), candidates=("scatter",)), "candidates"),
    (lambda: make_plan((4,), torch.float32, *one_to("B"), candidates=()), "candidates"),
])
def test_refuses_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
