"""Pipeline parallelism through the training loop (`train.loop.train`, as pretrain_gpt.py runs
it): 30 AdamW steps, clipping on, mock data, fp32, dropout 0, give the losses and grad norms of
the same run without PP (1e-5 relative): PP2 against DP2 (world 2), PP2 x DP2 (ZeRO stage 1)
against DP4 and PP2 x TP2 (sequence parallel) against TP2 x DP2 (world 4), for each schedule
(ZB-H1, eager-zb and ZBV included: their split backward under the engine; ZBV's two tied
embedding copies on stage 0, summed on the rank; auto: its start-up choice) and both families,
and with Domino's schedule inside the stages (PP2 x TP2); a vocabulary that pads (331), uneven
layers (7 over PP2). Validation loss (forwards only through the pipeline) too. The run without PP
has the same global batch: every step reads the same samples. bf16 and fp16 (loss scaling) at PP2
stay within
3e-2 of the run without PP; fp16 starts from a scale that does not overflow: at 2^32 the tied
embedding's two fp16 gradient halves overflow as one sum without PP and not apart, so the runs
would skip different steps. The default tier runs one family of each schedule, half-precision and
world-4 case; the slow tier the other (dist_utils.tier)."""

from __future__ import annotations

from test_tp_equivalence import tiny_config

from configs import make_config
from dist_utils import C, DistSuite, tier
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train

REL = 1e-5
ITERS = 30
MBS = 2
GLOBAL = 8


def run(family: str, dims, layers: int, **changes) -> dict:
    config = make_config(
        tiny_config(family, num_layers=layers, vocab_size=331),
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        micro_batch_size=MBS, global_batch_size=GLOBAL, train_iters=ITERS, lr=3e-3,
        min_lr=3e-4, lr_warmup_iters=2, clip_grad=0.5, log_interval=10, eval_interval=ITERS,
        eval_iters=1, mock_data=True, **changes)
    return train(config, dims, family, log=lambda line: None)


def check_training(family: str, dims, dims_ref, schedule: str, layers: int, rel: float = REL,
                   **changes):
    pipeline = dict(changes, pipeline_schedule=schedule)
    if schedule in ("interleaved", "zbv"):
        pipeline["virtual_pipeline_model_parallel_size"] = 2
    elif layers % 2:
        pipeline["decoder_first_pipeline_num_layers"] = layers // 2 + 1
    ref = run(family, dims_ref, layers, **changes)
    mine = run(family, dims, layers, **pipeline)
    assert ref["losses"][-1] < ref["losses"][0] - 0.3, ref["losses"]
    for what in ("losses", "grad_norms"):
        for step, (a, b) in enumerate(zip(mine[what], ref[what], strict=True)):
            assert abs(a - b) <= rel * abs(b), (what, step, a, b)
    (a,), (b,) = ([e["loss"] for e in h["eval"]] for h in (mine, ref))
    assert abs(a - b) <= rel * abs(b), ("validation", a, b)


SUITE = DistSuite(worlds=(2, 4), timeout=400.0)


@SUITE.setup
def _setup(world: int) -> dict:
    if world == 2:
        return {"pp2": ParallelDims(pp=2), "dp2": ParallelDims()}
    return {"pp2dp2": ParallelDims(pp=2), "dp4": ParallelDims(),
            "pp2tp2": ParallelDims(tp=2, pp=2), "tp2dp2": ParallelDims(tp=2)}


for family in ("gpt", "llama"):
    # each schedule's steps in the default tier once, the families alternating (both run
    # every schedule's single step in test_pipeline_equivalence.py)
    for index, schedule in enumerate(("1f1b", "eager-1f1b", "interleaved", "zb-h1", "eager-zb",
                                      "zbv", "auto")):
        layers = 8 if schedule in ("interleaved", "zbv") else 7
        SUITE.case(f"{family}-pp2-{schedule}", check_training, family, C.pp2, C.dp2, schedule,
                   layers, **tier(family, ("gpt", "llama")[index % 2], 2))
    # Half precision: the stages sum in another order than one process, so only close. GPT's
    # tied embedding is the case fp16's scale matters for (see the docstring).
    SUITE.case(f"{family}-pp2-bf16", check_training, family, C.pp2, C.dp2, "eager-1f1b", 7,
               rel=3e-2, bf16=True, **tier(family, "gpt", 2))
    SUITE.case(f"{family}-pp2-fp16", check_training, family, C.pp2, C.dp2, "1f1b", 7,
               rel=3e-2, fp16=True, initial_loss_scale=4096.0, **tier(family, "gpt", 2))
    SUITE.case(f"{family}-pp2dp2-zero1", check_training, family, C.pp2dp2, C.dp4, "eager-1f1b",
               7, stage=1, **tier(family, "gpt", 4))
    # pipelined TP x SP trains in the default tier under Domino's schedule (GPT) and ZB-H1
    # (Llama), below
    SUITE.case(f"{family}-pp2tp2-sp", check_training, family, C.pp2tp2, C.tp2dp2, "1f1b", 4,
               sequence_parallel=True, worlds=(), slow_worlds=(4,))

SUITE.case("gpt-pp2tp2-domino", check_training, "gpt", C.pp2tp2, C.tp2dp2, "eager-1f1b", 4,
           sequence_parallel=True, batch_slices=2, worlds=(4,))
# ZB-H1's B's and W's under the engine's no_sync (fused fp32 gradient buffers), reduced after
# the last W: ZeRO stage 1 over DP, and TP with sequence parallelism
SUITE.case("gpt-pp2dp2-zero1-zb-h1", check_training, "gpt", C.pp2dp2, C.dp4, "zb-h1", 7,
           stage=1, worlds=(4,))
SUITE.case("gpt-pp2dp2-zero1-zbv", check_training, "gpt", C.pp2dp2, C.dp4, "zbv", 8, stage=1,
           worlds=(4,))
SUITE.case("llama-pp2tp2-sp-zb-h1", check_training, "llama", C.pp2tp2, C.tp2dp2, "zb-h1", 4,
           sequence_parallel=True, worlds=(4,))

test_pipeline_training_matches_no_pp = SUITE.test()
