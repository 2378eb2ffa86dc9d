"""A model too small for ZeRO's data-parallel degree, where some DP rank's chunk of every unit
would be padding alone, is one ConfigError on every rank before anything is sharded: ranks of
one pipeline stage agree by construction (their layouts are equal), stages share their verdict,
so no rank is left waiting in a collective for one that refused."""

from __future__ import annotations

import pytest
import torch

from dist_utils import C, DistSuite
from megadomino.distributed import ParallelDims
from megadomino.zero.partition import idle_dp_rank


@pytest.mark.parametrize("numels, dp, idle", [([1], 2, 1), ([2], 2, None), ([5], 4, 3),
                                              ([9], 4, 3), ([10], 4, None), ([2, 9], 4, 3),
                                              ([12, 25], 8, 7), ([2], 4, 2)])
def test_idle_dp_rank(numels, dp, idle):
    """Rank r owns elements [r * ceil(n / dp), (r + 1) * ceil(n / dp)) of a unit of n."""
    assert idle_dp_rank(numels, dp) == idle
    for rank in range(dp):
        holds = any(rank * -(-n // dp) < n for n in numels)
        assert holds == (idle is None or rank < idle)


def _case_too_small_to_shard(dims: ParallelDims, stage: int) -> None:
    """One weight on the last pipeline stage (every rank, without stages): its DP ranks from 1
    on would hold only padding. A first stage whose own layout is fine refuses too."""
    from torch import nn

    from megadomino.config import ConfigError, ZeroConfig
    from megadomino.zero import ZeroPlusPlus

    model = nn.Linear(1, 1, bias=False) if dims.pp_rank == dims.pp - 1 else nn.Linear(8, 8)
    with pytest.raises(ConfigError, match=rf"--zero-stage {stage} .* over the {dims.dp} "
                                          r"data-parallel ranks.* would hold nothing"):
        ZeroPlusPlus(model, dims, torch.optim.AdamW, ZeroConfig(stage=stage))


SUITE = DistSuite(worlds=(4,))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"dp4": ParallelDims(tp=1), "pp2": ParallelDims(tp=1, pp=2)}


for _stage in (1, 3):
    SUITE.case(f"dp4-stage{_stage}", _case_too_small_to_shard, C.dp4, _stage)
SUITE.case("pp2-stage1", _case_too_small_to_shard, C.pp2, 1)

test_model_too_small_to_shard_is_refused_on_every_rank = SUITE.test()
