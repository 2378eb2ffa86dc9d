"""Megatron-LM's training features under pipeline parallelism, through the training loop on gloo
ranks: each run with --pipeline-model-parallel-size 2 (or 4) against the same run without PP on
the same world (the DP degree takes the stages' ranks; the global batch, hence every step's
samples, is the same), fp32, dropout 0, SGD with momentum (linear in the gradients, so that the
weights after a few steps carry them at 1e-5; Adam's normalization would magnify last-ulp
differences of small gradients), a vocabulary that pads (301), 3 layers (uneven:
2 + 1) or 4 (interleaved). Per step the reported loss and the grad norm, and at the end every
weight, within 1e-5 (relative) of the run without PP:

- --calculate-per-token-loss: samples whose masks keep pseudo-random token counts (some none),
  so that micro-batches and DP ranks hold uneven counts; the reported loss is Megatron's (the
  token losses' sum over the global batch's tokens), which differs from the mean of
  micro-batch means by far more than the tolerance; validation weighs tokens alike.
- --rampup-batch-size: the step's micro-batch count goes 2, 4, 6, 8 (one schedule each), under
  1F1B and the interleaved schedule.
- --decoupled-lr / --decoupled-min-lr: the tied GPT embedding (its first- and last-stage copies
  both in the decoupled groups) and Llama's untied output layer; at PP 4 the middle stages have
  no decoupled group.
- --overlap-param-gather (ZeRO stage 1, PP2 x DP2, 1F1B and interleaved): bit for bit the
  unoverlapped pipelined run's losses and weights.
"""

from __future__ import annotations

import torch
from test_megatron_features import MaskedData

from dist_utils import C, DistSuite, assert_close
from megadomino.cli.arguments import parse_args
from megadomino.distributed import ParallelDims
from megadomino.pipeline.stage import stage_full_state
from megadomino.train.loop import train

REL = 1e-5
BASE = ("--mock-data", "--seq-length", "16", "--vocab-size", "301",
        "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--optimizer", "sgd", "--lr", "0.5", "--min-lr", "0.05",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--clip-grad", "1.0",
        "--log-interval", "1", "--eval-iters", "0")


def _run(family: str, dims: ParallelDims, *flags: str) -> tuple[dict, dict]:
    """(the run, its full weights under the whole model's names: this stage's with PP)."""
    argv = ["--model-preset", f"{family}-tiny", *BASE, "--tensor-model-parallel-size",
            str(dims.tp), "--pipeline-model-parallel-size", str(dims.pp), *flags]
    config = parse_args(argv, family)[0]
    run = train(config, dims, family, log=lambda line: None,
                train_data=MaskedData(config.model.vocab_size),
                valid_data=MaskedData(config.model.vocab_size))
    run["optimizer"].params.materialize()
    weights = (stage_full_state(run["model"]) if dims.pp > 1
               else run["model"].full_state_dict())
    return run, weights


def _compare(family: str, dims: ParallelDims, dims_ref: ParallelDims, *flags: str,
             pipeline: tuple[str, ...] = ("--num-layers", "3",
                                          "--decoder-first-pipeline-num-layers", "2")) -> dict:
    """The pipelined run (with `pipeline`'s flags) against the one without PP. Returns the
    pipelined run."""
    layers = pipeline[pipeline.index("--num-layers"):][:2]
    ref, ref_weights = _run(family, dims_ref, *layers, *flags)
    run, weights = _run(family, dims, *pipeline, *flags)
    for what in ("losses", "grad_norms"):
        assert len(run[what]) == len(ref[what]) > 1, what
        for step, (a, b) in enumerate(zip(run[what], ref[what])):
            assert abs(a - b) <= REL * abs(b), (what, step, a, b)
    (a,), (b,) = ([e["loss"] for e in r["eval"]] for r in (run, ref))
    assert abs(a - b) <= REL * abs(b), ("validation", a, b)
    assert weights and set(weights) <= set(ref_weights)
    for name, weight in weights.items():
        assert_close(weight, ref_weights[name], REL, name)
    return run


def _case_per_token_loss(dims: ParallelDims, dims_ref: ParallelDims, family: str,
                         *pipeline: str) -> None:
    flags = ("--calculate-per-token-loss", "--global-batch-size", "8", "--train-iters", "3",
             "--eval-interval", "3", "--eval-iters", "1")
    run = _compare(family, dims, dims_ref, *flags, **({"pipeline": pipeline} if pipeline else {}))
    plain, _ = _run(family, dims, *flags[1:], "--num-layers", "3",
                    "--decoder-first-pipeline-num-layers", "2")
    assert abs(plain["losses"][0] - run["losses"][0]) > 1e-3 * run["losses"][0], \
        "the masks must make per-token and per-micro-batch losses differ"


def _case_rampup(dims: ParallelDims, dims_ref: ParallelDims, family: str,
                 *pipeline: str) -> None:
    flags = ("--rampup-batch-size", "2", "2", "12", "--global-batch-size", "8",
             "--train-samples", "36", "--lr-warmup-iters", "0", "--lr-warmup-samples", "4",
             "--lr-decay-samples", "36", "--eval-interval", "6", "--eval-iters", "1")
    run = _compare(family, dims, dims_ref, *flags, **({"pipeline": pipeline} if pipeline else {}))
    assert len(run["losses"]) == 6  # batches 2, 4, 6, 8, 8, 8


def _case_decoupled_lr(dims: ParallelDims, dims_ref: ParallelDims, family: str,
                       *pipeline: str) -> None:
    flags = ("--decoupled-lr", "1.5", "--decoupled-min-lr", "0.1", "--global-batch-size", "8",
             "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1")
    run = _compare(family, dims, dims_ref, *flags, **({"pipeline": pipeline} if pipeline else {}))
    groups = run["optimizer"].optimizer.optimizer.param_groups
    decoupled = [g for g in groups if g.get("decoupled")]
    stage, last = dims.pp_rank, dims.pp - 1
    assert bool(decoupled) == (stage == 0 or stage == last), (stage, len(decoupled))
    assert all(g["lr"] == decoupled[0]["lr"] != groups[0]["lr"] for g in decoupled)


def _case_overlap_param_gather(dims: ParallelDims, dims_ref: ParallelDims, family: str,
                               *pipeline: str) -> None:
    flags = ("--zero-stage", "1", "--global-batch-size", "8", "--train-iters", "3",
             "--eval-interval", "3", "--eval-iters", "1")
    run = _compare(family, dims, dims_ref, *flags, "--overlap-param-gather", pipeline=pipeline)
    plain, plain_weights = _run(family, dims, *pipeline, *flags)
    assert run["optimizer"].params.overlap and not plain["optimizer"].params.overlap
    assert run["losses"] == plain["losses"]
    weights = stage_full_state(run["model"])
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[name], plain_weights[name]) for name in weights)


SUITE = DistSuite(worlds=(2, 4), timeout=600)
INTERLEAVED = ("--num-layers", "4", "--virtual-pipeline-model-parallel-size", "2",
               "--pipeline-schedule", "interleaved")
EAGER = ("--num-layers", "3", "--decoder-first-pipeline-num-layers", "2",
         "--pipeline-schedule", "eager-1f1b")


@SUITE.setup
def _setup(world: int) -> dict:
    context = {"pp2": ParallelDims(pp=2), "dp": ParallelDims()}
    if world == 4:
        context["pp4"] = ParallelDims(pp=4)
    return context


SUITE.case("per_token_loss_gpt_pp2", _case_per_token_loss, C.pp2, C.dp, "gpt", worlds=(2,))
SUITE.case("per_token_loss_llama_pp2dp2_eager", _case_per_token_loss, C.pp2, C.dp, "llama",
           *EAGER, worlds=(4,))
SUITE.case("rampup_gpt_pp2", _case_rampup, C.pp2, C.dp, "gpt", worlds=(2,))
SUITE.case("rampup_llama_pp2_interleaved", _case_rampup, C.pp2, C.dp, "llama", *INTERLEAVED,
           worlds=(2,))
SUITE.case("decoupled_lr_gpt_pp2", _case_decoupled_lr, C.pp2, C.dp, "gpt", worlds=(2,))
SUITE.case("decoupled_lr_llama_pp2", _case_decoupled_lr, C.pp2, C.dp, "llama", worlds=(2,))
SUITE.case("decoupled_lr_gpt_pp4", _case_decoupled_lr, C.pp4, C.dp, "gpt",
           "--num-layers", "4", worlds=(4,))
SUITE.case("overlap_param_gather_gpt_pp2dp2", _case_overlap_param_gather, C.pp2, C.dp, "gpt",
           "--num-layers", "3", "--decoder-first-pipeline-num-layers", "2", worlds=(4,))
SUITE.case("overlap_param_gather_llama_pp2dp2_interleaved", _case_overlap_param_gather, C.pp2,
           C.dp, "llama", *INTERLEAVED, worlds=(4,))

test_pipeline_features = SUITE.test()
