"""Domino's schedule is data: the action list for N=2 batch slices, K=2 hidden chunks over two
layers equals the golden table below (the order the paper's overlap needs: each slice's reduce is
launched before the next slice's GEMMs and waited only where its result is consumed; backward
launches an input-gradient reduce, then runs the weight-gradient GEMMs that overlap it), and the
executor runs exactly that list, forward and backward (one process, TP=1)."""

from __future__ import annotations

import pytest
import torch

from configs import parallel_config
from megadomino.build import build_model
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.overlap.domino import schedule
from megadomino.overlap.domino.actions import backward_actions, forward_actions, table

pytestmark = pytest.mark.usefixtures("single_process_group")

GOLDEN = """\
  0 F L0 S0 glue_in
  1 F L0 S0 attention -> reduce a
  2 F L0 S1 glue_in
  3 F L0 S1 attention -> reduce a
  4 F L0 S0 wait a
  5 F L0 S0 glue_mid
  6 F L0 S0 mlp x2 chunks -> reduce m each
  7 F L0 S1 wait a
  8 F L0 S1 glue_mid
  9 F L0 S1 mlp x2 chunks -> reduce m each
 10 F L0 S0 wait m
 11 F L1 S0 glue_in
 12 F L1 S0 attention -> reduce a
 13 F L0 S1 wait m
 14 F L1 S1 glue_in
 15 F L1 S1 attention -> reduce a
 16 F L1 S0 wait a
 17 F L1 S0 glue_mid
 18 F L1 S0 mlp x2 chunks -> reduce m each
 19 F L1 S1 wait a
 20 F L1 S1 glue_mid
 21 F L1 S1 mlp x2 chunks -> reduce m each
 22 F L1 S0 wait m
 23 F S0    glue_out
 24 F L1 S1 wait m
 25 F S1    glue_out
 26 B S0    glue_out
 27 B S1    glue_out
 28 B L1 S0 mlp -> reduce dv + weight grads
 29 B L1 S1 mlp -> reduce dv + weight grads
 30 B L1 S0 wait dv
 31 B L1 S0 glue_mid
 32 B L1 S0 attention -> reduce du + weight grads
 33 B L1 S1 wait dv
 34 B L1 S1 glue_mid
 35 B L1 S1 attention -> reduce du + weight grads
 36 B L1 S0 wait du
 37 B L1 S0 glue_in
 38 B L0 S0 mlp -> reduce dv + weight grads
 39 B L1 S1 wait du
 40 B L1 S1 glue_in
 41 B L0 S1 mlp -> reduce dv + weight grads
 42 B L1    flush
 43 B L0 S0 wait dv
 44 B L0 S0 glue_mid
 45 B L0 S0 attention -> reduce du + weight grads
 46 B L0 S1 wait dv
 47 B L0 S1 glue_mid
 48 B L0 S1 attention -> reduce du + weight grads
 49 B L0 S0 wait du
 50 B L0 S0 glue_in
 51 B L0 S1 wait du
 52 B L0 S1 glue_in
 53 B L0    flush
"""


def test_golden_table():
    assert table(forward_actions(2, 2, chunks=2) + backward_actions(2, 2)) == GOLDEN


def test_recompute_is_an_action_before_the_layers_backward():
    actions = [str(a) for a in backward_actions(3, 1, recomputed=frozenset({0, 2}))]
    assert actions.index("B L2    recompute") < actions.index("B L2 S0 mlp -> reduce dv + weight "
                                                               "grads")
    assert sum("recompute" in a for a in actions) == 2



def _run(monkeypatch, actions=None) -> tuple[float, list[int]]:
    """Loss of a Domino N=2 x K=2 step on a batch of 3 (slices of 2 and 1 sequences) and the
    batch size of every partial output the schedule reduced, in launch order; `actions`
    replaces the forward list the executor is given."""
    launched: list[int] = []
    reduce = schedule.DominoRunner._reduce
    monkeypatch.setattr(schedule.DominoRunner, "_reduce",
                        lambda self, partial, pending: (launched.append(partial.shape[1]),
                                                        reduce(self, partial, pending)))
    if actions is not None:
        monkeypatch.setattr(schedule, "forward_actions", lambda *args: actions)
    torch.manual_seed(0)
    config = ModelConfig.preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0,
                                seq_length=16, max_position_embeddings=16)
    model = build_model(config, ParallelDims(tp=1), "gpt", device="cpu",
                        parallel=parallel_config(batch_slices=2, hidden_slices=2))
    tokens = torch.randint(0, 512, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean().item()
    return loss, launched


def test_the_executor_follows_the_list(monkeypatch):
    """Run as given, then with layer 0's two attention units in the other slice order: the
    reductions launch in the list's order, and the result is the same."""
    loss, launched = _run(monkeypatch)
    assert launched[:2] == [2, 1] and len(launched) == 2 * (2 + 2 * 2)
    actions = forward_actions(2, 2, 2)
    assert [(a.op, a.slice) for a in actions[:4]] == [
        ("glue_in", 0), ("attention", 0), ("glue_in", 1), ("attention", 1)]
    monkeypatch.undo()
    swapped, launched_swapped = _run(monkeypatch, actions[2:4] + actions[:2] + actions[4:])
    assert launched_swapped[:2] == [1, 2] and sorted(launched_swapped) == sorted(launched)
    assert swapped == pytest.approx(loss, rel=1e-6)
