"""DiLoCo (megadomino/zero/diloco.py) in the training loop, on gloo ranks cut into 2 sites.

2 ranks (2 sites of 1): every outer step equals the written-out DiLoCo update and torch's
Nesterov SGD on the averaged pseudo-gradients (torchft's outer step), for pseudo-gradients sent
as fp32, bf16 and int8 (each decoded as the written-out encoding does), and the sites end it
alike; int8 moves less than bf16, bf16 less than fp32; H = 1 with outer lr 1 and momentum 0
repeats plain DP's losses under SGD; a resume in the middle of a round (site 1's own weights and
AdamW state in its file) repeats the uninterrupted run exactly; a site whose outer step differs
stops the run on every rank with the same one line. 4 ranks: the same update with ZeRO stage 1
inside sites of 2 (masters are DP chunks), with 2 pipeline stages (each syncs its own
parameters), and a resume at stage 1. The configuration rules run without processes.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import C, DistSuite
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError
from megadomino.config.validate import validate
from megadomino.distributed import ParallelDims
from megadomino.kernels import dequantize, quantize
from megadomino.train.checkpoint import latest_iteration
from megadomino.train.loop import train
from megadomino.zero.diloco import DiLoCo, ReplicaMismatchError

BASE = ["--model-preset", "gpt-tiny", "--seq-length", "32", "--mock-data", "--global-batch-size",
        "8", "--micro-batch-size", "2", "--lr", "5e-3", "--lr-warmup-iters", "1",
        "--log-interval", "3", "--eval-interval", "3", "--eval-iters", "1"]
SITES = ("--diloco-sites", "2")


def _train(dims: ParallelDims, *flags: str, iters: int = 6) -> dict:
    config, _ = parse_args([*BASE, "--train-iters", str(iters), *flags], "gpt")
    return train(config, dims, "gpt", log=lambda line: None)


@contextlib.contextmanager
def _recorded(records: list, corrupt_site: int | None = None):
    """Every outer step of the run inside, as (before, after, bytes sent): clones of the
    snapshot, momentum and masters around DiLoCo.outer_step. `corrupt_site`: that site's
    snapshot is nudged first, so that its outer step differs."""
    original = DiLoCo.outer_step

    def outer_step(self: DiLoCo) -> None:
        if self.dims.site == corrupt_site:
            self.snapshot[0][0] += 1e-3
        state = lambda: {key: [t.clone() for t in getattr(self, key)]  # noqa: E731
                         for key in ("snapshot", "momentum", "masters")}
        before, sent = state(), dict(self.engine.comm.bytes["pseudo-gradients"])
        original(self)
        after = self.engine.comm.bytes["pseudo-gradients"]
        records.append((before, state(), sum(after[s] - sent.get(s, 0) for s in after)))

    DiLoCo.outer_step = outer_step
    try:
        yield
    finally:
        DiLoCo.outer_step = original


def _decoded(delta: torch.Tensor, dtype: str) -> torch.Tensor:
    """What a site's pseudo-gradient becomes on the wire, written out."""
    if dtype == "bf16":
        return delta.to(torch.bfloat16).float()
    if dtype == "int8":
        q, scales = quantize(delta, 8, 2048)
        return dequantize(q, scales, delta.numel(), 8, 2048)
    return delta


def _check_outer_steps(records: list, dims: ParallelDims, lr: float, mu: float,
                       dtype: str) -> None:
    """Each recorded outer step is DiLoCo's update on the sites' gathered pseudo-gradients:
    torch's SGD(nesterov) exactly, the written-out formula to fp32 rounding; every site ends
    with the masters the new global parameters."""
    for before, after, _ in records:
        for unit, (snapshot, momentum, master) in enumerate(
                zip(before["snapshot"], before["momentum"], before["masters"])):
            sites = [torch.empty_like(master) for _ in range(dims.sites)]
            dist.all_gather(sites, master, group=dims.cross_site_group)
            total = torch.zeros_like(master)
            for site_master in sites:
                total = total + _decoded(snapshot - site_master, dtype)
            delta = total * 0.5
            buffer = mu * momentum + delta
            written = snapshot - lr * (delta + mu * buffer)
            theta = snapshot.clone().requires_grad_(False)
            theta.grad = delta.clone()
            # single-tensor: its ops are the outer step's, so on a GPU too the bits match
            sgd = torch.optim.SGD([theta], lr=lr, momentum=mu, nesterov=mu > 0, foreach=False)
            if mu > 0 and momentum.any():
                sgd.state[theta]["momentum_buffer"] = momentum.clone()
            sgd.step()
            assert torch.equal(after["snapshot"][unit], theta), unit
            torch.testing.assert_close(after["snapshot"][unit], written, rtol=1e-6, atol=1e-7)
            if mu > 0:
                assert torch.equal(after["momentum"][unit], sgd.state[theta]["momentum_buffer"])
            assert torch.equal(after["masters"][unit], after["snapshot"][unit])
            ends = [torch.empty_like(master) for _ in range(dims.sites)]
            dist.all_gather(ends, after["masters"][unit], group=dims.cross_site_group)
            assert all(torch.equal(end, ends[0]) for end in ends), unit


def _case_outer_step_is_diloco(dims: ParallelDims, *flags: str) -> None:
    """H = 2 over 6 iterations: three outer steps, each DiLoCo's update, in fp32, bf16 and
    int8, which send fewer bytes in that order; the loss falls."""
    sent = {}
    for dtype in ("fp32", "bf16", "int8"):
        records: list = []
        with _recorded(records):
            run = _train(dims, *SITES, "--diloco-inner-steps", "2", "--diloco-pseudo-grad-dtype",
                         dtype, *flags)
        assert len(records) == 3 and run["optimizer"].outer.outer_steps == 3
        assert any(not torch.equal(m, s) for m, s in zip(records[0][0]["masters"],
                                                          records[0][0]["snapshot"]))
        _check_outer_steps(records, dims, 0.7, 0.9, dtype)
        assert run["losses"][-1] < run["losses"][0], run["losses"]
        sent[dtype] = records[0][2]
    assert sent["int8"] < 0.3 * sent["fp32"] and 0.45 * sent["fp32"] < sent["bf16"] \
        < 0.55 * sent["fp32"], sent


def _case_h1_is_plain_dp(plain: ParallelDims, sites: ParallelDims) -> None:
    """H = 1, outer lr 1, momentum 0, SGD without momentum inside, no clipping: each outer step
    averages the sites' SGD steps, which is plain DP's step on the averaged gradient."""
    sgd = ("--optimizer", "sgd", "--sgd-momentum", "0", "--clip-grad", "0")
    want = _train(plain, *sgd)
    records: list = []
    with _recorded(records):
        got = _train(sites, *sgd, *SITES, "--diloco-inner-steps", "1", "--diloco-outer-lr", "1",
                     "--diloco-outer-momentum", "0", "--diloco-pseudo-grad-dtype", "fp32")
    assert len(records) == 6
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
    assert worst < 1e-5, (got["losses"], want["losses"])
    assert want["losses"][-1] < want["losses"][0]


def _case_resume_mid_round(dims: ParallelDims, root: str, name: str, *flags: str) -> None:
    """H = 4 over 8 iterations == 3 (saved mid-round: the sites' weights differ) + resume + 5,
    exactly; every rank wrote its DiLoCo file."""
    directory = f"{root}/{name}"
    diloco = (*SITES, "--diloco-inner-steps", "4", *flags)
    straight = _train(dims, *diloco, iters=8)
    first = _train(dims, *diloco, "--save", directory, "--exit-interval", "3", iters=8)
    assert latest_iteration(directory) == 3
    shard = "mp_rank_00" if dims.pp == 1 else f"mp_rank_00_{dims.pp_rank:03d}"
    path = f"{directory}/iter_0000003/{shard}/diloco_dp_rank_{dims.dp_rank:03d}.pt"
    assert os.path.exists(path), path
    resumed = _train(dims, *diloco, "--load", directory, iters=8)
    assert first["losses"] + resumed["losses"] == straight["losses"]
    assert first["eval"] + resumed["eval"] == straight["eval"]
    assert resumed["optimizer"].outer.outer_steps == straight["optimizer"].outer.outer_steps == 2
    for a, b in zip(resumed["optimizer"].outer.snapshot, straight["optimizer"].outer.snapshot):
        assert torch.equal(a, b)


def _case_mismatch_stops(dims: ParallelDims) -> None:
    """Site 1's outer step starts from another snapshot: every rank stops with one line."""
    try:
        with _recorded([], corrupt_site=1):
            _train(dims, *SITES, "--diloco-inner-steps", "2")
    except ReplicaMismatchError as err:
        line = str(err)
        assert "\n" not in line and line.startswith(
            "DiLoCo's replicas differ after outer step 1: site 1's parameters are not site "
            "0's (pipeline stage 0, tensor-parallel rank 0, unit "), line
        lines = [None] * dims.world_size
        dist.all_gather_object(lines, line)
        assert len(set(lines)) == 1, lines
    else:
        raise AssertionError("no ReplicaMismatchError")


def _case_grid_without_sites(plain: ParallelDims) -> None:
    """A library caller whose grid has no sites hears so before anything is built."""
    try:  # not pytest.raises: its failure is no Exception, and would end the rank
        _train(plain, *SITES, "--diloco-inner-steps", "2")
    except ConfigError as err:
        assert str(err) == ("--diloco-inner-steps / --diloco-sites make 2 DiLoCo site(s), the "
                            "process grid has 1: build it with ParallelDims(sites=2)"), str(err)
    else:
        raise AssertionError("no ConfigError")


def _case_site_groups(dims: ParallelDims) -> None:
    """4 ranks, 2 sites of 2: the site view's DP group is the site's, the cross-site group the
    ranks at the same position."""
    view = dims.site_view()
    assert (dims.dp, view.dp, dims.site, view.dp_rank) == (4, 2, dims.rank // 2, dims.rank % 2)
    assert dist.get_process_group_ranks(view.dp_group) == [2 * dims.site, 2 * dims.site + 1]
    assert dist.get_process_group_ranks(dims.cross_site_group) == [dims.rank % 2,
                                                                  dims.rank % 2 + 2]
    assert dist.get_process_group_ranks(view.replica_group) == [2 * dims.site,
                                                                2 * dims.site + 1]
    assert view.tp_group is dims.tp_group and view.site_view() is view


SUITE = DistSuite(worlds=(2, 4))


@pytest.fixture(scope="module")
def diloco_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("diloco")),)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    if world == 2:
        return {"plain": ParallelDims(tp=1), "sites": ParallelDims(tp=1, sites=2), "root": root}
    return {"dp4": ParallelDims(tp=1, sites=2), "pp2": ParallelDims(tp=1, pp=2, sites=2),
            "root": root}


SUITE.case("outer_step_is_diloco", _case_outer_step_is_diloco, C.sites, worlds=(2,))
SUITE.case("h1_is_plain_dp", _case_h1_is_plain_dp, C.plain, C.sites, worlds=(2,))
SUITE.case("resume_mid_round", _case_resume_mid_round, C.sites, C.root, "dp2", worlds=(2,))
SUITE.case("mismatch_stops", _case_mismatch_stops, C.sites, worlds=(2,))
SUITE.case("grid_without_sites", _case_grid_without_sites, C.plain, worlds=(2,))
SUITE.case("site_groups", _case_site_groups, C.dp4, worlds=(4,))
SUITE.case("zero1_outer_step", _case_outer_step_is_diloco, C.dp4, "--zero-stage", "1",
           worlds=(4,))
SUITE.case("pp2_outer_step", _case_outer_step_is_diloco, C.pp2, "--pipeline-model-parallel-size",
           "2", worlds=(4,))
SUITE.case("zero1_resume_mid_round", _case_resume_mid_round, C.dp4, C.root, "zero1",
           "--zero-stage", "1", worlds=(4,))

test_diloco = SUITE.test(args_fixture="diloco_root")


# ---- the configuration rules, before any process group ----------------------------------------


def _parse(*flags: str):
    return parse_args([*BASE, "--train-iters", "4", *flags], "gpt")[0]


@pytest.mark.parametrize("flags, world, message", [
    (("--diloco-sites", "2"), None, "--diloco-sites sets DiLoCo's outer step: add "
     "--diloco-inner-steps"),
    (("--diloco-inner-steps", "0"), None, "--diloco-inner-steps=0 is invalid"),
    (("--diloco-inner-steps", "4", "--diloco-outer-momentum", "1"), None,
     "--diloco-outer-momentum=1.0 is invalid"),
    (("--diloco-inner-steps", "4", "--calculate-per-token-loss"), None,
     "--calculate-per-token-loss counts the tokens of every data-parallel rank"),
    (("--diloco-inner-steps", "4"), 4, "--diloco-inner-steps averages across sites, one a "
     "node, and the 4 data-parallel ranks sit on one node: give --diloco-sites"),
    (("--diloco-inner-steps", "4", "--diloco-sites", "3"), 4,
     "--diloco-sites=3 is invalid: it must be a divisor of the data-parallel size"),
])
def test_refused(flags, world, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        validate(_parse(*flags), world)


def test_one_site_a_node_by_default():
    validate(_parse("--diloco-inner-steps", "4", "--gpus-per-node", "2"), 4)


def test_refused_with_a_pipeline_plan():
    with pytest.raises(ConfigError, match="^--diloco-inner-steps cuts the data-parallel ranks "
                                          "of Megatron's grid into sites; --pipeline-plan"):
        _parse("--diloco-inner-steps", "4", "--pipeline-plan", "auto")
