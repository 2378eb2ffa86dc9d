"""On the GPU machine: pipeline parallelism with NCCL against the same single-process
references as its CPU twins, fp32 with TF32 off at 1e-4 relative, plus one bf16 run-and-track
case per area (each step's loss within 2% of the same run in fp32, 10 steps). The gpu tier:
`python -m pytest tests --tier gpu -q`; a world needs as many GPUs.

World 2: PP2 under 1F1B, the interleaved schedule, ZB-H1, eager-zb, ZBV (also with 3
micro-batches) and auto against the model without PP (mean loss and every full gradient,
tests/test_pipeline_equivalence.py); sent outputs freed (1F1B, ZB-H1) bit for bit the stage keeping
them, holding less; auto through the loop bit for bit its choice's run
(tests/test_pipeline_schedule_auto.py, deterministic kernels); the training loop at PP2 against DP2
(losses, grad norms, validation loss:
tests/test_pipeline_training.py); --rampup-batch-size and --decoupled-lr against the run
without PP (tests/test_pipeline_features.py); bf16 at PP2.
World 3: heterogeneous plans (tests/test_pipeline_hetero.py): a TP boundary (TP2 -> TP1, with
and without sequence parallelism) and a batch-split boundary (DP2 -> DP1) against the model
without PP; the loop through TP2 -> TP1 against DP3; bf16 through TP2 -> TP1; the plan's
checkpoints (tests/test_pipeline_hetero_checkpoint.py): exact resume, saved at the plan and
resumed at PP3 (another TP and PP), and back.
--pipeline-reshard broadcast and scatter-gather (NCCL broadcasts and all-gathers on each
boundary's groups), worlds 3 and 4: TP2 -> TP1, TP1 -> TP2, DP2 -> DP1, TP1 -> TP2 -> TP1 and
DP2 -> TP2, each strategy once on each plan, the schedules and families in turn, against the
model without PP; the loop through TP1 -> TP2 (broadcast) and TP2 -> TP1 (scatter-gather).
World 4: PP2 x TP2 (sequence parallel, eager-1F1B, auto; Domino's schedule; recompute), PP2 x DP2
(interleaved, ZBV) and PP4 (1F1B uneven, interleaved, ZB-H1, eager-zb, ZBV, ZBV with 3
micro-batches) against the model without PP; auto resolving one schedule on every rank of PP2 x DP2
and PP4; ZB-H1 at PP4 with its sent outputs freed; the loop at PP2 x DP2 with ZeRO stage 1, PP2 x
TP2 against TP2 x DP2, Domino in the stages; the per-token loss and --overlap-param-gather at PP2 x
DP2, --decoupled-lr at PP4; plans of 4 ranks: TP1 -> TP2 -> TP1 sharing GPT's tied embedding, TP2 ->
DP2 and DP1 -> DP3 (batch splits 2 + 1 and 2 + 2 + 1; plans added here).

The twins' cases run unchanged; the setup swaps the twins' CPU-bound helpers in each rank
(tests/gpu/gpu_twins.py says how): equivalence and hetero build their models and stages on an
explicit "cpu" (built on the rank's device instead), draw micro-batches from a CPU generator
(drawn so, then moved: the CPU run's values) and sum the reference loss into a CPU
`torch.zeros(())` (the reference runs with the rank's device as default device); their 1e-5
bounds (`REL`) become 1e-4. The training-loop cases need nothing: the loop builds on the current
CUDA device and moves its host-side batches there itself. The cases that assert bit-identical
runs (a resume, overlapped against plain parameter gathers) run under deterministic kernels.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import test_pipeline_equivalence as equivalence
import test_pipeline_features as features
import test_pipeline_hetero as hetero
import test_pipeline_hetero_checkpoint as hetero_checkpoint
import test_pipeline_schedule_auto as schedule_auto
import test_pipeline_training as training
import torch
from gpu_twins import (
    FP32_REL,
    adopt,
    assert_bf16_tracks,
    built_on,
    deterministic,
    drawn_then_moved,
    patch,
    rank_device,
    under_default_device,
)
from test_tp_equivalence import batch, tiny_config

from configs import make_config
from dist_utils import C, DistSuite
from megadomino.build import build_model, build_stage
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train

TRACK_STEPS = 10
PASS, LOOP = 90.0, 120.0  # budgets (s): one forward-backward; runs of the training loop

# Batch-split boundaries within 4 ranks (the twin's are on 5): (stages: ranks, tp, layers),
# layers in all, as test_pipeline_hetero.PLANS writes them.
PLANS = {
    "tp2_dp2": ([((0, 1), 2, (0, 3)), ((2, 3), 1, (3, 5))], 5),
    "dp1_dp3": ([((0,), 1, (0, 2)), ((1, 2, 3), 1, (2, 5))], 5),
}


def _twins_on(device: torch.device) -> None:
    """The twins' CPU-bound helpers replaced in this rank (see the module docstring), and
    PLANS added to the hetero twin's (its cases look plans up by name)."""
    reference = under_default_device(equivalence.reference_loss_and_grads, device)
    for twin in (equivalence, hetero):
        patch(twin, build_stage=built_on(build_stage, device),
              batch=drawn_then_moved(batch, device), reference_loss_and_grads=reference,
              REL=FP32_REL)
    patch(equivalence, build_model=built_on(build_model, device))
    patch(schedule_auto, build_stage=built_on(build_stage, device))
    patch(features, REL=FP32_REL)
    patch(hetero_checkpoint, REL=FP32_REL)
    hetero.PLANS.update(PLANS)


def _plan_dims(world: int) -> dict:
    """ParallelDims of every hetero plan of `world` ranks, by plan name."""
    return {name: ParallelDims(plan=hetero.file_plan(stages, layers))
            for name, (stages, layers) in hetero.PLANS.items()
            if sum(len(ranks) for ranks, _, _ in stages) == world}


SUITE = DistSuite(worlds=(2, 3, 4), backend="nccl", timeout=120.0)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    """The names the adopted cases use, as their twins' setups define them (one ParallelDims
    where two twins name the same layout)."""
    _twins_on(rank_device())
    ref = ParallelDims(tp=1)  # DP over the world: the single-process reference's dims
    if world == 2:
        return {"ref": ref, "dp2": ref, "dp": ref, "pp2": ParallelDims(pp=2)}
    if world == 3:
        plans = _plan_dims(3)
        return {"ref": ref, "dp3": ref, "pp3": ParallelDims(pp=3), "plan": plans["tp2_tp1"],
                "root": root, **plans}
    pp2dp2 = ParallelDims(pp=2)
    return {"ref": ref, "dp4": ref, "dp": ref, "pp2": pp2dp2, "pp2dp2": pp2dp2,
            "pp2tp2": ParallelDims(tp=2, pp=2), "tp2dp2": ParallelDims(tp=2),
            "pp4": ParallelDims(pp=4), **_plan_dims(4)}


def _pipeline_run(family: str, dims: ParallelDims, layers: int, **changes) -> dict:
    """test_pipeline_training.run's model, data and AdamW, for TRACK_STEPS steps."""
    config = make_config(
        tiny_config(family, num_layers=layers, vocab_size=331),
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        micro_batch_size=training.MBS, global_batch_size=training.GLOBAL,
        train_iters=TRACK_STEPS, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2, clip_grad=0.5,
        log_interval=TRACK_STEPS, eval_iters=0, mock_data=True, **changes)
    return train(config, dims, family, log=lambda line: None)


def track_bf16_pipeline(family: str, dims: ParallelDims, schedule: str, layers: int,
                        first: int) -> None:
    """The pipelined run in bf16 tracks the same pipelined run in fp32."""
    fp32, bf16 = (_pipeline_run(family, dims, layers, pipeline_schedule=schedule,
                                decoder_first_pipeline_num_layers=first, **precision)
                  for precision in ({}, {"bf16": True}))
    assert_bf16_tracks(bf16, fp32, f"{family} PP{dims.pp} {schedule}")


def track_bf16_hetero(family: str, dims: ParallelDims, plan_name: str, schedule: str) -> None:
    """Through the training loop with the plan (test_pipeline_hetero.train_run: 10 steps), bf16
    tracks fp32."""
    stages, layers = hetero.PLANS[plan_name]
    path = os.path.join(tempfile.mkdtemp(), "plan.json")  # this rank's copy, as the twin's
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"stages": [{"ranks": list(r), "tp": t, "layers": list(la)}
                              for r, t, la in stages]}, handle)
    fp32, bf16 = (hetero.train_run(family, dims, layers, 5, pipeline_plan=path,
                                   pipeline_schedule=schedule,
                                   pipeline_model_parallel_size=len(stages), **precision)
                  for precision in ({}, {"bf16": True}))
    assert_bf16_tracks(bf16, fp32, f"{family} {plan_name} {schedule}")


def _adopt(twin: DistSuite, prefix: str, world: int, names: tuple[str, ...], timeout: float,
           **options) -> None:
    for name in names:
        adopt(SUITE, twin, name, world, prefix=prefix, timeout=timeout, **options)


# World 2: PP2; 1F1B and interleaved (eager-1F1B at world 4).
_adopt(equivalence.SUITE, "eq", 2, ("gpt-pp2-1f1b", "llama-pp2-interleaved"), PASS)
_adopt(training.SUITE, "train", 2, ("gpt-pp2-interleaved",), LOOP, rel=FP32_REL)
_adopt(features.SUITE, "feat", 2, ("rampup_llama_pp2_interleaved", "decoupled_lr_gpt_pp2"),
       LOOP)
SUITE.case("bf16-gpt-pp2-eager-1f1b", track_bf16_pipeline, "gpt", C.pp2, "eager-1f1b", 7, 4,
           worlds=(2,), timeout=LOOP)
_adopt(equivalence.SUITE, "eq", 2, ("gpt-pp2-zb-h1", "llama-pp2-eager-zb", "llama-pp2-auto",
                                     "gpt-pp2-1f1b-outputs-freed", "gpt-pp2-zb-h1-outputs-freed",
                                     "gpt-pp2-zbv", "llama-pp2-odd-micro-zbv"), PASS)
_adopt(training.SUITE, "train", 2, ("gpt-pp2-zbv",), LOOP, rel=FP32_REL)
_adopt(schedule_auto.SUITE, "auto", 2, ("gpt-pp2-trains-as-its-choice",), LOOP,
       wrap=deterministic)

# World 3: a TP boundary and a batch-split boundary; training, bf16 and checkpoints at TP2 -> TP1.
_adopt(hetero.SUITE, "hetero", 3, ("gpt-tp2-tp1-1f1b", "llama-tp2-sp-tp1"), PASS)
SUITE.case("hetero-gpt-dp2-dp1-1f1b", hetero.check_hetero, "gpt", C.dp2_dp1, C.ref, "dp2_dp1",
           "1f1b", 4, 3, True, worlds=(3,), timeout=PASS)
_adopt(hetero.SUITE, "hetero", 3, ("llama-train-tp2-tp1",), LOOP)
SUITE.case("bf16-gpt-tp2-tp1-eager-1f1b", track_bf16_hetero, "gpt", C.tp2_tp1, "tp2_tp1",
           "eager-1f1b", worlds=(3,), timeout=LOOP)
_adopt(hetero_checkpoint.SUITE, "hetero-ckpt", 3, ("resume-plan",), LOOP, wrap=deterministic)
_adopt(hetero_checkpoint.SUITE, "hetero-ckpt", 3, ("plan-to-pp3", "pp3-to-plan"), LOOP)

# World 4: PP2 x TP2, PP2 x DP2, PP4; eager-1F1B; plans of 4 ranks.
_adopt(equivalence.SUITE, "eq", 4, ("gpt-pp2tp2-sp-eager-1f1b", "llama-pp2dp2-interleaved",
                                     "gpt-pp4-1f1b", "llama-pp4-interleaved",
                                     "gpt-pp2tp2-domino", "llama-pp2tp2-recompute",
                                     "llama-pp4-zb-h1", "gpt-pp4-eager-zb", "gpt-pp2tp2-sp-auto",
                                     "llama-pp4-zb-h1-outputs-freed", "llama-pp4-zbv",
                                     "gpt-pp4-few-micro-zbv", "llama-pp2dp2-zbv"), PASS)
_adopt(schedule_auto.SUITE, "auto", 4, ("gpt-pp2dp2-resolves-alike",
                                         "llama-pp4-resolves-alike"), PASS)
_adopt(training.SUITE, "train", 4, ("gpt-pp2dp2-zero1", "llama-pp2tp2-sp",
                                    "gpt-pp2tp2-domino", "gpt-pp2dp2-zero1-zbv"), LOOP,
       rel=FP32_REL)
_adopt(features.SUITE, "feat", 4, ("per_token_loss_llama_pp2dp2_eager", "decoupled_lr_gpt_pp4"),
       LOOP)
_adopt(features.SUITE, "feat", 4, ("overlap_param_gather_gpt_pp2dp2",), LOOP, wrap=deterministic)
_adopt(hetero.SUITE, "hetero", 4, ("gpt-tp1-tp2-tp1-tied",), PASS)
SUITE.case("hetero-llama-tp2-dp2-eager-1f1b", hetero.check_hetero, "llama", C.tp2_dp2, C.ref,
           "tp2_dp2", "eager-1f1b", 4, 3, True, worlds=(4,), timeout=PASS)
SUITE.case("hetero-gpt-dp1-dp3-1f1b", hetero.check_hetero, "gpt", C.dp1_dp3, C.ref, "dp1_dp3",
           "1f1b", 3, 5, True, worlds=(4,), timeout=PASS)

# --pipeline-reshard's collective strategies: each on every plan of 3 and 4 ranks, the schedules
# and families in turn (the twin's cases, the slow tier's among them); the loop through both.
for _turn, (_strategy, (_world, _name)) in enumerate(
        (s, p) for s in ("broadcast", "scatter-gather")
        for p in ((w, n) for w, names in hetero.RESHARD_PLANS.items() for n in names)):
    _family = ("gpt", "llama")[_turn % 2]
    _schedule = ("1f1b", "eager-1f1b", "zb-h1")[_turn % 3]
    _adopt(hetero.SUITE, "hetero", _world,
           (f"{_family}-{_name.replace('_', '-')}-{_strategy}-{_schedule}",), PASS)
_adopt(hetero.SUITE, "hetero", 3, ("gpt-train-tp1-tp2-broadcast",
                                   "llama-train-tp2-tp1-scatter-gather"), LOOP)


@pytest.fixture(scope="module")
def gpu_pipeline_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("gpu-pipeline")),)


test_gpu_pipeline_matches_no_pp = SUITE.test(args_fixture="gpu_pipeline_root")
