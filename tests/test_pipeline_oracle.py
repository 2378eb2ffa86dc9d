"""The executor against torch's own pipeline schedules (`torch.distributed.pipelining`
`Schedule1F1B` and `ScheduleInterleaved1F1B`), on gloo at PP2 (one rank a stage, which is what
torch's schedules support): the same stage modules (copies), weights and micro-batches give the
same loss and every parameter gradient, 1e-5 relative. GPT (its tied embedding's gradients
summed over the first and last stage on both sides, as torch leaves that to the caller) and
Llama; 8 layers, vocabulary 331, 4 micro-batches of 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_tp_equivalence import batch, tiny_config
from torch import nn

from configs import parallel_config
from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_stage
from megadomino.config.pipeline_plan import uniform_plan
from megadomino.distributed import ParallelDims
from megadomino.pipeline.runtime import PipelineRuntime
from megadomino.pipeline.stage import embedding_group, tied_embedding

REL = 1e-5
MICRO, MBS = 4, 2


class OracleStage(nn.Module):
    """A chunk as torch's PipelineStage wants it: one tensor in (tokens on the first virtual
    stage, else the hidden (s, b, h)), one out (the logits (s, b, V) on the last)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model
        seq = x.shape[1] if model.pre_process else x.shape[0]
        hidden = model.embed(x, None) if model.pre_process else x
        hidden = model.decoder(hidden, model.rotary(seq, None, x.device))
        return model.logits_parallel(hidden) if model.post_process else hidden


def check_oracle(family: str, dims, name: str, chunks: int):
    try:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )
    except ImportError as error:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.pipelining: {error}")
    config = tiny_config(family, num_layers=8, vocab_size=331)
    plan = uniform_plan(8, dims.world_size, 1, dims.pp, chunks)
    stage = build_stage(config, dims, plan, family, "cpu", init_seed=11)
    oracle = build_stage(config, dims, plan, family, "cpu", init_seed=11)
    micro = [batch(config, seed=40 + m, b=MBS) for m in range(MICRO)]
    ones = torch.ones(MBS, config.seq_length)
    runtime = PipelineRuntime(stage, plan, dims, config, _parallel(dims), name, MBS, MICRO)
    loss = runtime.forward_backward([(t, labels, ones) for t, labels, _, _ in micro])

    last = oracle[-1]

    def loss_fn(logits, labels):
        return last.loss_parallel(logits, labels).mean()

    stages = [PipelineStage(OracleStage(model), v * dims.pp + dims.pp_rank, dims.pp * chunks,
                            torch.device("cpu")) for v, model in enumerate(oracle)]
    tokens = torch.cat([t for t, _, _, _ in micro])
    labels = torch.cat([lab for _, lab, _, _ in micro])
    losses = []
    if chunks == 1:
        schedule = Schedule1F1B(stages[0], MICRO, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss_fn)
    first = dims.pp_rank == 0
    schedule.step(tokens if first else None, target=labels, losses=losses)
    tied = tied_embedding(oracle, plan)
    group = embedding_group(plan, dims) if family == "gpt" else None
    if tied is not None:
        dist.all_reduce(tied.grad, group=group)
    if dims.pp_rank == dims.pp - 1:
        assert_close(loss, torch.stack(losses).mean(), REL, "mean loss")
    for mine, theirs in zip(stage, oracle, strict=True):
        for (name_, param), ref in zip(mine.named_parameters(), theirs.parameters(), strict=True):
            assert_close(param.grad, ref.grad, REL, f"grad {name_}")


def _parallel(dims):
    return parallel_config(pipeline_model_parallel_size=dims.pp)


SUITE = DistSuite(worlds=(2,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"pp2": ParallelDims(pp=2)}


for family in ("gpt", "llama"):
    SUITE.case(f"{family}-1f1b", check_oracle, family, C.pp2, "1f1b", 1)
    SUITE.case(f"{family}-interleaved", check_oracle, family, C.pp2, "interleaved", 2)

test_executor_matches_torch_schedules = SUITE.test()
