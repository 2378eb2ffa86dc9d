"""Domino's schedule against plain tensor parallelism at TP=2 and TP=4 (fp32, dropout 0): logits,
per-token loss and every full gradient within 1e-5 relative, for GPT and Llama, batch slices
N in {1,2,3,4} on an uneven batch (5), hidden slices K in {1,2,4}, with and without sequence
parallelism and full recompute. Plus: recompute replays dropout exactly under Domino, and the
data-parallel gradient buffer sees Domino's gradients (one spawn per world size). TP=4 runs a
part of the (N, K) grid in the default tier, the whole grid in the slow one (TP4_GRID)."""

from __future__ import annotations

import itertools

import torch
from test_tp_equivalence import FAMILIES, batch, loss_and_grads, tiny_config

from configs import make_config, parallel_config
from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_model
from megadomino.config import ConfigError
from megadomino.config.validate import validate_layers
from megadomino.distributed import ParallelDims
from megadomino.distributed.random import model_parallel_seed
from megadomino.overlap.domino.schedule import DominoRunner
from megadomino.train.loop import train

REL = 1e-5
BATCH = 5
GRID = list(itertools.product((1, 2, 3, 4), (1, 2, 4), (False, True)))
RECOMPUTE = list(itertools.product(((2, 1), (3, 2), (4, 4)), (False, True)))


def domino_config(family: str, **changes):
    # ffn 96: divisible by tp (4) x hidden slices (4)
    return tiny_config(family, ffn_hidden_size=96, **changes)


def check_equal(family, dims, batch_slices, hidden_slices, sequence_parallel, recompute,
                device: str = "cpu", params_dtype: str = "float32", rel: float = REL,
                explicit_backward: bool = False):
    """Domino (N, K) against plain TP, both at dims.tp in params_dtype, same full weights
    (`explicit_backward`: Domino's schedule even at 1 x 1)."""
    plain = domino_config(family, params_dtype=params_dtype)
    tp_only = dict(sequence_parallel=sequence_parallel)
    domino = dict(tp_only, batch_slices=batch_slices, hidden_slices=hidden_slices,
                  explicit_backward=explicit_backward)
    if recompute:
        domino.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    torch.manual_seed(7)
    reference = build_model(plain, dims, family, device=device,
                            parallel=parallel_config(**tp_only))
    model = build_model(plain, dims, family, device=device, parallel=parallel_config(**domino))
    model.load_full_state_dict(reference.full_state_dict())
    assert isinstance(model.decoder.runner, DominoRunner) == model.parallel.domino.enabled
    tokens, labels, loss_mask, _ = (t.to(device) for t in batch(plain, seed=13, b=BATCH))
    with torch.no_grad():
        assert_close(model(tokens).float(), reference(tokens).float(), rel, "logits (no grad)")
    loss, grads = loss_and_grads(model, dims, tokens, labels, loss_mask)
    ref_loss, ref_grads = loss_and_grads(reference, dims, tokens, labels, loss_mask)
    assert_close(loss, ref_loss, rel, "per-token loss")
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    for name, grad in grads.items():
        assert_close(grad.float(), ref_grads[name].float(), rel, f"grad {name}")


def check_recompute_dropout(family, dims):
    """Under Domino, full recompute restores each unit's RNG: same loss and grads as without."""
    config = domino_config(family, hidden_dropout=0.3, attention_dropout=0.3, num_layers=3)
    tokens, labels, loss_mask, _ = batch(config, seed=5, b=BATCH)
    results = []
    for recompute in (None, "full"):
        changes = dict(sequence_parallel=True, batch_slices=2, hidden_slices=2,
                       recompute_granularity=recompute)
        if recompute:
            changes.update(recompute_method="block", recompute_num_layers=2)
        model_parallel_seed(21, dims)
        model = build_model(config, dims, family, device="cpu",
                            parallel=parallel_config(**changes))
        results.append(loss_and_grads(model, dims, tokens, labels, loss_mask))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        assert_close(grads_b[name], grads_a[name], 1e-6, f"grad {name}")


def check_refused(family, dims):
    config = domino_config(family)
    model = build_model(config, dims, family, device="cpu",
                        parallel=parallel_config(batch_slices=BATCH + 1))
    tokens = batch(config, seed=1, b=BATCH)[0]
    try:
        model(tokens)
    except ConfigError as error:
        assert "--domino-batch-slices=6" in str(error), str(error)
    else:
        raise AssertionError("6 batch slices of a batch of 5 was accepted")
    try:
        validate_layers(config, parallel_config(hidden_slices=5), dims.tp)
    except ConfigError as error:
        assert "--domino-hidden-slices=5" in str(error), str(error)
    else:
        raise AssertionError("5 hidden slices of 96 / tp was accepted")


def run_training(dims, iters: int, **changes):
    config = make_config(
        domino_config("gpt"), tensor_model_parallel_size=dims.tp, micro_batch_size=4,
        global_batch_size=4 * dims.dp, train_iters=iters, lr=5e-3, min_lr=5e-4,
        lr_warmup_iters=2, log_interval=1, eval_interval=iters, eval_iters=1, mock_data=True,
        **changes)
    lines: list[str] = []
    history = train(config, dims, "gpt", log=lines.append)
    return history["losses"], lines


def check_training_matches(dims):
    """A few dozen steps with Domino give plain TP's losses (1e-5 relative)."""
    plain, _ = run_training(dims, 24)
    domino, _ = run_training(dims, 24, batch_slices=3, hidden_slices=2)
    assert plain[-1] < plain[0] - 0.5, plain
    for step, (a, b) in enumerate(zip(domino, plain)):
        assert abs(a - b) <= REL * abs(b), (step, a, b)


def check_auto(dims):
    losses, lines = run_training(dims, 2, domino_auto=True)
    if dims.rank == 0:
        assert any(line.startswith("domino auto:") for line in lines), lines
    assert len(losses) == 2


SUITE = DistSuite(worlds=(2, 4))


@SUITE.setup
def _setup(world: int) -> dict:
    return {"dims": ParallelDims(tp=world)}


TP4_GRID = {(1, 4), (2, 1), (3, 2), (4, 4)}
"""The (N, K) pairs TP=4 runs in the default tier: every N, every K, batch and hidden slices
together; the rest of GRID (and of the recompute and explicit-backward cases) runs at TP=4 in the
slow tier. TP=2 runs all of them in the default tier."""
SLOW_AT_TP4 = {"worlds": (2,), "slow_worlds": (4,)}

for family in FAMILIES:
    for n, k, sp in GRID:
        SUITE.case(f"{family}-N{n}-K{k}-sp{sp}", check_equal, family, C.dims, n, k, sp, False,
                   **{} if (n, k) in TP4_GRID else SLOW_AT_TP4)
    for (n, k), sp in RECOMPUTE:
        SUITE.case(f"{family}-N{n}-K{k}-sp{sp}-recompute", check_equal, family, C.dims, n, k, sp,
                   True, **{} if (n, k) == (3, 2) else SLOW_AT_TP4)
    for sp, recompute in itertools.product((False, True), (False, True)):
        SUITE.case(f"{family}-explicit-backward-sp{sp}-recompute{recompute}", check_equal,
                   family, C.dims, 1, 1, sp, recompute, explicit_backward=True,
                   **{} if sp != recompute else SLOW_AT_TP4)
    SUITE.case(f"{family}-recompute-dropout", check_recompute_dropout, family, C.dims)
    SUITE.case(f"{family}-refused", check_refused, family, C.dims)
SUITE.case("training", check_training_matches, C.dims)
SUITE.case("auto", check_auto, C.dims, **SLOW_AT_TP4)

test_domino_matches_plain_tp = SUITE.test()
