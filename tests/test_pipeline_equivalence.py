"""Pipeline parallelism against the same model without it (fp32, dropout 0, vocabulary 331 that
pads): the mean loss over the micro-batches and every full gradient within 1e-5 relative, for
GPT (tied embedding shared by the first and last stage; under ZBV's V both copies on stage 0)
and Llama, every schedule (1F1B, eager-1F1B, interleaved with 2 chunks a stage, ZB-H1, eager-zb
and ZBV (2 chunks a stage in a V) with their split backward, and auto's choice after its
profiling pass), at PP2, PP4,
PP2 x TP2 (with and without sequence parallelism) and PP2 x DP2, with uneven layer counts (7
layers over PP2 with --decoder-first-pipeline-num-layers 4; 5 over PP4 with first 2), full
recompute and Domino's schedule (3 batch x 2 hidden slices, sequence parallel) inside a stage;
ZB-H1 also with fewer micro-batches than stages (3 over PP4), an odd count (5 over PP2) and full
recompute under PP2 x TP2 with sequence parallelism (its W all-gathers the TP input); ZBV also
with fewer micro-batches than its V fills (2 P - 1: 3 over PP4, an odd 3 over PP2). The
reference sees every DP rank's micro-batches; the pipeline's DP ranks average their gradients as
the engine does. The slow tier adds PP4 x TP2 (sequence parallel) and PP2 x TP2 x DP2 on 8 ranks.

Sent outputs freed (the executor's `free_outputs`, Megatron's deallocate_output_tensor): the
loss and every gradient are bit for bit those of the same stage keeping its outputs, and the
bytes the executor holds (the distinct storages of its kept tensors, after every action) drop
on each sending stage by at least the outputs of all but one of the micro-batches it has in
flight, while the last stage, which sends no output, holds what it held: 1F1B and eager-1F1B
at PP2, ZB-H1 (its B through the engine on a freed output) at PP2 and PP4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_tp_equivalence import batch, tiny_config

from configs import parallel_config
from dist_utils import C, DistSuite, assert_close, tier
from megadomino.build import build_model, build_stage
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.config.pipeline_split import placement_of
from megadomino.distributed import ParallelDims, mappings
from megadomino.pipeline.executor import Executor
from megadomino.pipeline.runtime import PipelineRuntime
from megadomino.pipeline.stage import load_stage_full_state, stage_full_state

REL = 1e-5
MBS = 3


def reference_loss_and_grads(config, family, dims_ref, micro_batches):
    """The mean of the micro-batches' losses and its full gradients, one process, no PP."""
    torch.manual_seed(7)
    model = build_model(config, dims_ref, family, device="cpu")
    total = torch.zeros(())
    for tokens, labels, loss_mask in micro_batches:
        per_token = model(tokens, labels=labels, loss_mask=loss_mask)
        loss = per_token.sum() / loss_mask.sum()
        (loss / len(micro_batches)).backward()
        total += loss.detach()
    return model.full_state_dict(), total / len(micro_batches), model.full_grad_dict()


def reduce_stage_grads(stage, dims) -> None:
    """What the engine does after a step, by hand: SP's replicated-parameter gradients summed
    over TP, every gradient averaged over DP."""
    for model in stage:
        mappings.allreduce_sequence_parallel_grads(model, dims.tp_group)
        for param in model.parameters():
            if dims.dp > 1 and param.grad is not None:
                dist.all_reduce(param.grad, group=dims.dp_group)
                param.grad /= dims.dp


def check_pipeline(family: str, dims, dims_ref, schedule: str, num_layers: int, micro: int,
                   chunks: int = 1, first: int | None = None, **parallel):
    config = tiny_config(family, num_layers=num_layers, vocab_size=331)
    every = [batch(config, seed=100 + m, b=MBS)[:3] for m in range(micro * dims.dp)]
    full, ref_loss, ref_grads = reference_loss_and_grads(config, family, dims_ref, every)
    plan = uniform_plan(num_layers, dims.world_size, dims.tp, dims.pp, chunks, first,
                        placement=placement_of(schedule))
    parallel_cfg = parallel_config(tensor_model_parallel_size=dims.tp,
                                   pipeline_model_parallel_size=dims.pp, **parallel)
    stage = build_stage(config, dims, plan, family, "cpu", parallel=parallel_cfg)
    load_stage_full_state(stage, full)
    runtime = PipelineRuntime(stage, plan, dims, config, parallel_cfg, schedule, MBS, micro)
    mine = [every[m * dims.dp + dims.dp_rank] for m in range(micro)]
    # the first step runs the loading list, the second the schedule's (PipelineRuntime)
    for step in ("first", "second"):
        stage.zero_grad(set_to_none=True)
        loss = runtime.forward_backward(mine)
        reduce_stage_grads(stage, dims)
        if dims.dp > 1:
            dist.all_reduce(loss, group=dims.dp_group)
            loss /= dims.dp
        assert_close(loss, ref_loss, REL, f"{step} step's mean loss")
        if runtime.tied_copy is not None:  # ZBV's V: both copies on stage 0, each the sum
            assert torch.equal(runtime.tied.grad, runtime.tied_copy.grad)
        grads = stage_full_state(stage, grads=True)
        params = stage_full_state(stage)
        assert grads.keys() == params.keys(), sorted(set(params) - set(grads))
        for name, grad in grads.items():
            assert_close(grad, ref_grads[name], REL, f"{step} step's grad {name}")
    # Every parameter of the whole model is on some stage (gathered over the pipeline).
    names = [None] * dims.pp
    dist.all_gather_object(names, sorted(params), group=dims.pp_group)
    assert set().union(*map(set, names)) == set(ref_grads)


SUITE = DistSuite(worlds=(2, 4))


@SUITE.setup
def _setup(world: int) -> dict:
    out = {"ref": ParallelDims(tp=1)}
    if world == 2:
        out["pp2"] = ParallelDims(tp=1, pp=2)
    else:
        out["pp4"] = ParallelDims(tp=1, pp=4)
        out["pp2tp2"] = ParallelDims(tp=2, pp=2)
        out["pp2dp2"] = ParallelDims(tp=1, pp=2, dp=2)
    return out


SCHEDULES = (("1f1b", 1), ("eager-1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("eager-zb", 1),
             ("zbv", 2), ("auto", 1))
for family in ("gpt", "llama"):
    for name, chunks in SCHEDULES:
        layers, first = (8, None) if chunks > 1 else (7, 4)
        SUITE.case(f"{family}-pp2-{name}", check_pipeline, family, C.pp2, C.ref, name, layers,
                   4, chunks, first, worlds=(2,))
        # each schedule on each world-4 mesh once in the default tier (one family each), the
        # other family in the slow tier: the schedule and the mesh code are the family's own
        SUITE.case(f"{family}-pp2tp2-sp-{name}", check_pipeline, family, C.pp2tp2, C.ref, name,
                   layers, 4, chunks, first, sequence_parallel=True,
                   **tier(family, "llama", 4))
        SUITE.case(f"{family}-pp2dp2-{name}", check_pipeline, family, C.pp2dp2, C.ref, name,
                   layers, 2, chunks, first, **tier(family, "gpt", 4))
        pp4_layers, pp4_first = (8, None) if chunks > 1 else (5, 2)
        SUITE.case(f"{family}-pp4-{name}", check_pipeline, family, C.pp4, C.ref, name,
                   pp4_layers, 4 if chunks > 1 else 6, chunks, pp4_first, worlds=(4,))
    SUITE.case(f"{family}-pp2-few-micro", check_pipeline, family, C.pp2, C.ref, "1f1b", 4, 1,
               worlds=(2,))
    # ZB-H1 with fewer micro-batches than stages, and an odd count (its W's delayed over the
    # cool-down), and with every layer's forward recomputed in its B
    SUITE.case(f"{family}-pp4-few-micro-zb-h1", check_pipeline, family, C.pp4, C.ref, "zb-h1",
               5, 3, first=2, worlds=(4,))
    SUITE.case(f"{family}-pp2-odd-micro-zb-h1", check_pipeline, family, C.pp2, C.ref, "zb-h1",
               7, 5, first=4, worlds=(2,))
    # ZBV with fewer micro-batches than its V fills (torch's order, cut to them)
    SUITE.case(f"{family}-pp4-few-micro-zbv", check_pipeline, family, C.pp4, C.ref, "zbv", 8,
               3, 2, worlds=(4,))
    SUITE.case(f"{family}-pp2-odd-micro-zbv", check_pipeline, family, C.pp2, C.ref, "zbv", 4,
               3, 2, worlds=(2,))
    SUITE.case(f"{family}-pp2tp2-recompute-zb-h1", check_pipeline, family, C.pp2tp2, C.ref,
               "zb-h1", 6, 3, sequence_parallel=True, recompute_granularity="full",
               recompute_method="uniform", recompute_num_layers=1, worlds=(4,))
    SUITE.case(f"{family}-pp2tp2-recompute", check_pipeline, family, C.pp2tp2, C.ref,
               "eager-1f1b", 6, 3, recompute_granularity="full", recompute_method="uniform",
               recompute_num_layers=1, worlds=(4,))

for family in ("gpt", "llama"):
    SUITE.case(f"{family}-pp2tp2-domino", check_pipeline, family, C.pp2tp2, C.ref, "1f1b", 4, 3,
               sequence_parallel=True, batch_slices=3, hidden_slices=2, worlds=(4,))



class HeldBytes(Executor):
    """The executor, recording the peak bytes of the distinct storages of the tensors it keeps
    (inputs, outputs, received and sent gradients), measured after every action."""

    peak = 0

    def _do(self, action, batches, state) -> None:
        super()._do(action, batches, state)
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in state.kept.values() if t is not None}
        self.peak = max(self.peak, sum(held.values()))


def check_outputs_freed(family: str, dims, schedule: str, num_layers: int, micro: int,
                        first: int | None = None):
    """Freeing sent outputs changes no bit and holds less (module docstring)."""
    config = tiny_config(family, num_layers=num_layers, vocab_size=331)
    batches = [batch(config, seed=100 + m, b=MBS)[:3] for m in range(micro)]
    plan = uniform_plan(num_layers, dims.world_size, dims.tp, dims.pp, first=first)
    parallel = parallel_config(pipeline_model_parallel_size=dims.pp)
    torch.manual_seed(5)
    stage = build_stage(config, dims, plan, family, "cpu", parallel=parallel, init_seed=5)
    runtime = PipelineRuntime(stage, plan, dims, config, parallel, schedule, MBS, micro)
    runs = {}
    for free in (False, True):
        stage.zero_grad(set_to_none=True)
        runtime.executor = HeldBytes(stage, runtime.transport, dims.pp_rank, dims.pp,
                                     split_backward=runtime.executor.stores is not None,
                                     free_outputs=free)
        loss = runtime.forward_backward(batches)
        runs[free] = (loss, [p.grad.clone() for p in stage.parameters()],
                      runtime.executor.peak)
    (kept_loss, kept_grads, kept_peak), (loss, grads, peak) = runs[False], runs[True]
    assert torch.equal(loss, kept_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads, strict=True))
    if dims.pp_rank == dims.pp - 1:
        assert peak == kept_peak, (peak, kept_peak)
        return
    activation = config.seq_length * MBS * config.hidden_size * 4  # fp32
    in_flight = min(dims.pp - dims.pp_rank, micro)
    if schedule == "eager-1f1b":
        in_flight = min(2 * (dims.pp - dims.pp_rank) - 1, micro)
    # a freed output keeps one element (4 bytes)
    assert kept_peak - peak >= (in_flight - 1) * (activation - 4), (kept_peak, peak, in_flight)


for family, name in (("gpt", "1f1b"), ("llama", "eager-1f1b"), ("gpt", "zb-h1")):
    SUITE.case(f"{family}-pp2-{name}-outputs-freed", check_outputs_freed, family, C.pp2, name,
               7, 4, 4, worlds=(2,))
SUITE.case("llama-pp4-zb-h1-outputs-freed", check_outputs_freed, "llama", C.pp4, "zb-h1", 5, 6,
           2, worlds=(4,))

test_pipeline_matches_no_pp = SUITE.test()

SUITE_8 = DistSuite(worlds=(8,), timeout=400.0)


@SUITE_8.setup
def _setup_8(world: int) -> dict:
    return {"ref": ParallelDims(tp=1), "pp4tp2": ParallelDims(tp=2, pp=4),
            "pp2tp2dp2": ParallelDims(tp=2, pp=2, dp=2)}


for family in ("gpt", "llama"):
    for name, chunks in SCHEDULES:
        SUITE_8.case(f"{family}-pp4tp2-{name}", check_pipeline, family, C.pp4tp2, C.ref, name, 8,
                     4, chunks, sequence_parallel=True)
        SUITE_8.case(f"{family}-pp2tp2dp2-{name}", check_pipeline, family, C.pp2tp2dp2, C.ref,
                     name, 8 if chunks > 1 else 7, 2, chunks, None if chunks > 1 else 4)

test_pipeline_matches_no_pp_8_ranks = pytest.mark.slow(SUITE_8.test())
