"""The collectives a training step issues are the protocol of its data-parallel engine and of
Domino's schedule: recorded on 4 gloo ranks (TP=2 x DP=2, sequence parallel, 2 micro-batches,
2 steps) for plain data parallelism (ZeRO stage 0), stage 1, stage 3 and Domino N=2 x K=2, they
equal the committed trace (tests/fixtures/collective_trace.json, written by
`python tests/collective_trace.py --write`): the same ops on the same groups, with the same
dtypes and sizes, in the same order against the backward (how many parameter gradients had
arrived when each was issued).

Domino's trace was recorded before the layer exposed its pieces and the schedule drove them.
Plain, stage 1 and stage 3 were re-recorded when the layer pieces took over the linears' biases
(the QKV bias's gradient now comes from the split's backward, the projections' from the residual
piece): the same collectives, groups, bytes and order as before, some of them issued after one
more gradient had arrived. The re-recording also holds plain data parallelism's one intended
change since the first recording: it sums the gradients of sequence-parallel parameters over the
TP group at the start of the optimizer step, as the sharded stages do, instead of at the end of
the last backward (at the end of each synced backward it summed again if a step had several:
gradients counted twice)."""

from __future__ import annotations

import json

import torch.distributed as dist
from collective_trace import CONFIGS, EXPECTED, record

from dist_utils import DistSuite

SUITE = DistSuite(worlds=(4,))


def check_trace(kind: str) -> None:
    expected = json.loads(EXPECTED.read_text())[kind][str(dist.get_rank())]
    got = json.loads(json.dumps(record(kind)))  # tuples as lists, as in the file
    for index, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine == theirs, (f"{kind}: collective {index} of this rank is {mine}, the trace "
                                f"has {theirs}")
    assert len(got) == len(expected), (f"{kind}: {len(got)} collectives, the trace has "
                                       f"{len(expected)}; first extra: "
                                       f"{(got + expected)[min(len(got), len(expected))]}")


for kind in CONFIGS:
    SUITE.case(kind, check_trace, kind)

test_collective_trace = SUITE.test()
