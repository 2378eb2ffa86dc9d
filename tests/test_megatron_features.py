"""Megatron-LM's training features against a reference, on gloo ranks (2 and 4):

- --calculate-per-token-loss: one training step's reported loss and weight update equal a dense
  single-process model's loss over every token of the global batch (sum of token losses over
  the count of non-masked tokens) and its gradient, fp32, 1e-5 relative; the masks differ per
  sample (some all-masked) so micro-batches and DP ranks hold uneven token counts; ZeRO stages 0,
  1 and 3, TP=2 x DP=2 with sequence parallelism. Without the flag the same batch reports the
  mean of micro-batch means, which differs: the test can tell them apart.
- --decoupled-lr: with SGD (no momentum, no decay) the word embedding and output layer move by
  exactly decoupled_lr / lr times their plain update and every other parameter by its plain one,
  at stages 0, 1 and 3; a run stopped and resumed with it repeats the uninterrupted one.
- --overlap-param-gather: stage 1 with the all-gathers overlapped repeats the unoverlapped run
  bit for bit (losses and weights over four steps; DP=2, and TP=2 x DP=2 with sequence
  parallelism), and the gathers really are in flight until a forward waits on them.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import C, DistSuite, assert_close
from megadomino.build import build_model
from megadomino.cli.arguments import parse_args
from megadomino.data.mock import MockDataset
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train
from megadomino.train.step import collate

SEQ = 16
LR = 1000.0
"""SGD's step is -LR x gradient: large, so that the update stands well above the weights'
rounding and recovers the gradient to 1e-5."""


class MaskedData:
    """Mock samples, each with its own loss mask: sample i keeps a pseudo-random number of its
    labels (none for every seventh sample)."""

    def __init__(self, vocab_size: int):
        self.tokens = MockDataset(SEQ, vocab_size, seed=5)

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        keep = 0 if index % 7 == 3 else int(torch.randint(1, SEQ + 1, (1,), generator=gen))
        mask = torch.zeros(SEQ)
        mask[torch.randperm(SEQ, generator=gen)[:keep]] = 1.0
        return {"tokens": self.tokens[index], "loss_mask": mask}


def _config(dims: ParallelDims, *flags: str, iters: str = "1"):
    argv = ["--model-preset", "gpt-tiny", "--mock-data", "--seq-length", str(SEQ),
            "--vocab-size", "301", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
            "--global-batch-size", str(6 * dims.dp), "--train-iters", iters,
            "--hidden-dropout", "0", "--attention-dropout", "0", "--optimizer", "sgd",
            "--sgd-momentum", "0", "--weight-decay", "0", "--clip-grad", "0", "--lr", str(LR),
            "--lr-decay-style", "constant", "--log-interval", "1", "--eval-iters", "0",
            "--tensor-model-parallel-size", str(dims.tp), *flags]
    return parse_args(argv, "gpt")[0]


def _one_step(dims: ParallelDims, *flags: str, iters: str = "1") -> tuple[dict, dict, dict]:
    """(the run, the full weights before its step, after it)."""
    config = _config(dims, *flags, iters=iters)
    before: dict[str, torch.Tensor] = {}

    def init(config, dims):
        model = build_model(config.model, dims, "gpt", parallel=config.parallel)
        before.update(model.full_state_dict())
        return model

    run = train(config, dims, "gpt", log=lambda line: None,
                train_data=MaskedData(config.model.vocab_size), model_init=init)
    return run, before, run["optimizer"].full_state_dict()


def _reference(before: dict, dims_ref: ParallelDims, config, samples: int):
    """(loss over all tokens of samples [0, samples), full gradients) of a dense model."""
    model = build_model(config.model, dims_ref, "gpt", device="cpu")
    model.load_full_state_dict(before)
    data = MaskedData(config.model.vocab_size)
    tokens, mask = collate([data[i] for i in range(samples)])
    per_token = model(tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask)
    loss = per_token.sum() / mask.sum()
    loss.backward()
    micro_means = [(per_token[i:i + 2].sum() / mask[i:i + 2].sum().clamp(min=1)).item()
                   for i in range(0, samples, 2)]
    return loss.item(), model.full_grad_dict(), sum(micro_means) / len(micro_means)


def _case_per_token_loss(dims: ParallelDims, dims_ref: ParallelDims, *flags: str) -> None:
    run, before, after = _one_step(dims, "--calculate-per-token-loss", *flags)
    config = _config(dims)
    samples = config.train.schedule.global_batch_size
    loss, grads, mean_of_means = _reference(before, dims_ref, config, samples)
    reported = run["losses"][0]
    assert abs(reported - loss) <= 1e-5 * abs(loss), (reported, loss)
    assert abs(mean_of_means - loss) > 1e-3 * loss, "the masks must make the two losses differ"
    for name, grad in grads.items():
        assert_close((before[name] - after[name]) / LR, grad, 1e-5, f"gradient of {name}")
    plain, _, _ = _one_step(dims, *flags)
    assert abs(plain["losses"][0] - mean_of_means) <= 1e-5 * mean_of_means


def _case_decoupled_lr(dims: ParallelDims, stage: str) -> None:
    zero = ("--zero-stage", stage)
    _, before, plain = _one_step(dims, *zero)
    run, before_too, decoupled = _one_step(dims, *zero, "--decoupled-lr", str(3 * LR))
    special = {"word_embeddings.weight", "output_weight"}
    for name, weight in before.items():
        assert torch.equal(weight, before_too[name]), name
        factor = 3.0 if name in special else 1.0
        assert_close(weight - decoupled[name], factor * (weight - plain[name]), 1e-5, name)
    groups = run["optimizer"].optimizer.optimizer.param_groups
    assert sorted(group["lr"] for group in groups if group.get("decoupled")) == [3 * LR]


def _case_decoupled_resume(dims: ParallelDims, directory: str) -> None:
    flags = ("--zero-stage", "1", "--decoupled-lr", "1e-2", "--lr", "1e-3", "--min-lr", "1e-4",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--optimizer", "adam")
    straight, _, _ = _one_step(dims, *flags, iters="4")
    first, _, _ = _one_step(dims, *flags, "--save", directory, "--exit-interval", "2", iters="4")
    second, _, _ = _one_step(dims, *flags, "--save", directory, "--load", directory, iters="4")
    assert first["losses"] + second["losses"] == straight["losses"]


def _case_overlap_param_gather(dims: ParallelDims, *flags: str) -> None:
    """Stage 1's all-gathers left in flight after the step and waited on in the forward: the
    same losses and weights, bit for bit, as waiting before the step returns."""
    adam = ("--zero-stage", "1", "--optimizer", "adam", "--lr", "1e-2", "--hidden-dropout", "0.1",
            *flags)
    plain, _, plain_weights = _one_step(dims, *adam, iters="4")
    run, _, weights = _one_step(dims, *adam, "--overlap-param-gather", iters="4")
    engine = run["optimizer"]
    assert engine.params.overlap and not plain["optimizer"].params.overlap
    assert run["losses"] == plain["losses"]
    assert weights.keys() == plain_weights.keys()
    assert all(torch.equal(weights[name], plain_weights[name]) for name in weights)
    engine.params.refresh()  # as after a step: the gathers are in flight until a forward needs them
    assert all(work is not None for work in engine.params.pending)
    engine.model.eval()
    with torch.no_grad():
        engine(torch.zeros(1, SEQ, dtype=torch.long))
    assert all(work is None for work in engine.params.pending)


SUITE = DistSuite(worlds=(2, 4), timeout=300)


@SUITE.setup
def _setup(world: int, root: str) -> dict:
    dp = ParallelDims(tp=1)  # also the dense reference's: TP=1
    context = {"ref": dp, "dp": dp, "root": root}
    if world == 4:
        context["tp2_dp2"] = ParallelDims(tp=2)
    return context


for stage in ("0", "3"):
    SUITE.case(f"per_token_loss_stage{stage}", _case_per_token_loss, C.dp, C.ref,
               "--zero-stage", stage)
SUITE.case("per_token_loss_stage1", _case_per_token_loss, C.dp, C.ref, "--zero-stage", "1",
           worlds=(4,))
SUITE.case("per_token_loss_tp2_dp2_sp", _case_per_token_loss, C.tp2_dp2, C.ref,
           "--sequence-parallel", worlds=(4,))
for stage in ("0", "1", "3"):
    SUITE.case(f"decoupled_lr_stage{stage}", _case_decoupled_lr, C.dp, stage, worlds=(2,))
SUITE.case("decoupled_lr_resume", _case_decoupled_resume, C.dp, C.root, worlds=(2,))
SUITE.case("overlap_param_gather_dp2", _case_overlap_param_gather, C.dp, worlds=(2,))
SUITE.case("overlap_param_gather_tp2_dp2", _case_overlap_param_gather, C.tp2_dp2,
           "--sequence-parallel", worlds=(4,))


@pytest.fixture(scope="module")
def features_root(tmp_path_factory) -> tuple[str]:
    return (str(tmp_path_factory.mktemp("features")),)


test_megatron_features = SUITE.test(args_fixture="features_root")
