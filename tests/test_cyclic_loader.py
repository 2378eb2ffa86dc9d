"""--dataloader-type cyclic (megadomino.data.cyclic) against Megatron-LM's cyclic loader, and the
Megatron-LM settings a launch script passes without the feature they tune (FP8 tuning flags
without --fp8-format, --eval-iters -1, --no-data-sharding without cyclic): not read, each with a
notice.

The reference below restates the formula of Megatron-LM's MegatronPretrainingRandomSampler as
each DP rank runs it, an epoch at a time, from the samples consumed so far: epoch and offset
from consumed // and % the epoch's whole batches of samples, torch.randperm seeded with the
epoch, a bucket per rank (data sharding) or the whole permutation from the offset dealt out
rank by rank, micro-batches cut from the rank's list with the last partial one dropped."""

from __future__ import annotations

import math

import pytest
import torch

from configs import make_config
from megadomino.cli.arguments import parse_args
from megadomino.config import ConfigError, DataConfig, ModelConfig
from megadomino.config.validate import validate
from megadomino.data.cyclic import CyclicOrder, loader_order
from megadomino.data.mock import MockDataset

BASE = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10"]


def permutation(size: int, epoch: int) -> list[int]:
    """torch.randperm(size) from a generator seeded with `epoch`, as Megatron-LM draws it."""
    generator = torch.Generator()
    generator.manual_seed(epoch)
    return torch.randperm(size, generator=generator).tolist()


def megatron_stream(total: int, mbs: int, dp: int, rank: int, sharding: bool, consumed: int,
                    count: int) -> list[list[int]]:
    """The first `count` micro-batches (lists of dataset indices) DP rank `rank` reads from
    Megatron-LM's cyclic loader started after `consumed` samples."""
    slot = mbs * dp
    active = total - total % slot
    micro_batches: list[list[int]] = []
    while len(micro_batches) < count:
        epoch, offset = divmod(consumed, active)
        assert offset % slot == 0, "Megatron-LM resumes only at whole batches of the DP group"
        if sharding:
            bucket = total // slot * mbs
            mine = [rank * bucket + i for i in permutation(bucket, epoch)[offset // dp:]]
        else:
            mine = permutation(total // mbs * mbs, epoch)[offset:][rank::dp]
        for start in range(0, len(mine) - mbs + 1, mbs):  # the partial micro-batch is dropped
            micro_batches.append(mine[start:start + mbs])
            consumed += slot  # the rank's sampler counts the whole DP group's samples
            if len(micro_batches) == count:
                break
    return micro_batches


def our_stream(order: CyclicOrder, rank: int, consumed: int, count: int) -> list[list[int]]:
    """The micro-batches DP rank `rank` reads from `order` after `consumed` samples: the read
    positions of train/step.py."""
    slot = order.mbs * order.dp
    return [[order.index(consumed + k * slot + rank * order.mbs + j) for j in range(order.mbs)]
            for k in range(count)]


def in_step(total: int, mbs: int, dp: int, sharding: bool) -> bool:
    """Whether Megatron-LM's ranks read the same number of micro-batches per epoch: always with
    data sharding; without, unless rank 0's share of the permutation's tail past the epoch's
    whole batches holds a whole micro-batch."""
    tail = total % (mbs * dp) - total % mbs
    return sharding or math.ceil(tail / dp) < mbs


SHAPES = [(total, mbs, dp) for dp in (1, 2, 3) for mbs in (1, 2, 3) for total in (37, 40)]


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("total, mbs, dp", SHAPES)
def test_cyclic_order_is_megatrons_across_epochs(total, mbs, dp, sharding):
    """Two and a half epochs from the start and from mid-epoch resumes, every rank: the same
    micro-batches as Megatron-LM's sampler wherever its ranks stay in step; where they fall out
    of step, the same up to the first epoch's end (from where Megatron-LM's rank reads the
    tail's micro-batch and runs one ahead)."""
    slot = mbs * dp
    active = total - total % slot
    order = CyclicOrder(list(range(total)), total, mbs, dp, sharding)
    epochs = 5 * active // (2 * slot)
    for consumed in (0, slot, active - slot, active + 2 * slot):
        count = epochs if in_step(total, mbs, dp, sharding) else (active - consumed) // slot
        if count <= 0:
            continue
        for rank in range(dp):
            ours = our_stream(CyclicOrder(None, total, mbs, dp, sharding), rank, consumed, count)
            assert ours == megatron_stream(total, mbs, dp, rank, sharding, consumed, count)
            assert ours == our_stream(order, rank, consumed, count)  # any instance agrees


def test_where_megatrons_ranks_fall_out_of_step():
    """37 samples, micro-batch 1, 2 ranks: an epoch is 36 samples, 18 micro-batches a rank, but
    Megatron-LM's rank 0 also reads the 37th of the permutation as its 19th micro-batch, while
    rank 1's 19th is the next epoch's. Here both read the next epoch's first two. The grid above
    holds such shapes, so the comparison's cut for them is exercised."""
    apart = [(t, m, d) for t, m, d in SHAPES if not in_step(t, m, d, False)]
    assert (37, 1, 2) in apart and (40, 1, 2) not in apart and len(apart) >= 4
    total, mbs, dp = 37, 1, 2
    megatron = [megatron_stream(total, mbs, dp, rank, False, 0, 19)[18] for rank in range(dp)]
    assert megatron == [[permutation(37, 0)[36]], [permutation(37, 1)[1]]]
    order = CyclicOrder(None, total, mbs, dp, False)
    assert [our_stream(order, rank, 0, 19)[18] for rank in range(dp)] == [
        [permutation(37, 1)[0]], [permutation(37, 1)[1]]]


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("total, mbs, dp", [(37, 1, 3), (40, 2, 2), (41, 3, 2)])
def test_every_epoch_reads_each_of_its_samples_once(total, mbs, dp, sharding):
    """Each epoch's positions read `active` distinct samples: without data sharding the first
    `active` of the epoch's permutation; with it, rank r only its bucket; epochs differ."""
    order = CyclicOrder(None, total, mbs, dp, sharding)
    slot, active = mbs * dp, order.active
    bucket = total // slot * mbs
    epochs = []
    for epoch in range(3):
        indices = [order.index(p) for p in range(epoch * active, (epoch + 1) * active)]
        assert len(set(indices)) == active and all(0 <= i < total for i in indices)
        if sharding:
            for p in range(epoch * active, (epoch + 1) * active):
                assert order.index(p) // bucket == p % slot // mbs  # rank r: bucket r
        else:
            full = permutation(total // mbs * mbs, epoch)
            assert sorted(indices) == sorted(full[:active])
        epochs.append(indices)
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("sharding", [True, False])
def test_resuming_mid_epoch_reads_on_as_the_uninterrupted_run(sharding):
    """Megatron-LM's sampler started after 16 samples (mid-epoch: an epoch is 24) reads on, into
    the next epochs, as one started at 0 did after its first 16 samples, and so does a fresh
    CyclicOrder."""
    total, mbs, dp, consumed = 26, 2, 2, 16
    for rank in range(dp):
        straight = megatron_stream(total, mbs, dp, rank, sharding, 0, 15)
        resumed = megatron_stream(total, mbs, dp, rank, sharding, consumed, 15 - consumed // 4)
        assert straight[consumed // 4:] == resumed
        assert our_stream(CyclicOrder(None, total, mbs, dp, sharding), rank, consumed,
                          len(resumed)) == resumed


def test_loader_order_single_cyclic_and_a_dataset_without_length():
    samples = list(range(10, 50))
    assert loader_order(samples, DataConfig(), 2, 2, 8) is samples
    assert loader_order(None, DataConfig(dataloader_type="cyclic"), 2, 2, 8) is None
    cyclic = DataConfig(dataloader_type="cyclic", data_sharding=False)
    sized = loader_order(samples, cyclic, 2, 2, 8)
    assert sized.total == 40 and sized[5] == samples[sized.index(5)]
    mock = MockDataset(8, 100, seed=1)
    unsized = loader_order(mock, cyclic, 2, 2, 8)
    assert unsized.total == 8 and sorted(unsized.index(p) for p in range(8)) == list(range(8))
    assert torch.equal(unsized[3], mock[unsized.index(3)])
    with pytest.raises(ConfigError, match="--dataloader-type cyclic reads whole micro-batches"):
        loader_order(samples[:3], cyclic, 2, 2, 8)


def test_an_unknown_loader_in_a_config_is_one_line():
    config = make_config(ModelConfig.preset("gpt-tiny"), train_iters=2, mock_data=True,
                         dataloader_type="external")
    with pytest.raises(ConfigError, match="^--dataloader-type=external is invalid: it must be "
                                          "single or cyclic$"):
        validate(config)


def test_dataloader_flags_set_the_config():
    data = parse_args([*BASE, "--dataloader-type", "cyclic", "--no-data-sharding"], "gpt")[0]
    assert (data.train.data.dataloader_type, data.train.data.data_sharding) == ("cyclic", False)
    config, notices = parse_args([*BASE, "--dataloader-type", "cyclic"], "gpt")
    assert config.train.data.data_sharding and notices == []
    with pytest.raises(ConfigError, match="--dataloader-type=external is refused: an external"):
        parse_args([*BASE, "--dataloader-type", "external"], "gpt")


@pytest.mark.parametrize("argv, notice, check", [
    (["--fp8-margin", "0", "--fp8-interval", "1", "--fp8-amax-history-len", "1024",
      "--fp8-amax-compute-algo", "max"],
     "--fp8-amax-history-len, --fp8-amax-compute-algo, --fp8-margin, --fp8-interval: not read, "
     "FP8 is off without --fp8-format", lambda c: c.train.precision.fp8 is None),
    (["--fp8-recipe", "tensorwise", "--fp8-interval", "2"], "--fp8-recipe, --fp8-interval: not "
     "read", lambda c: c.train.precision.fp8 is None),
    (["--eval-iters", "10", "--eval-iters", "-1"], "--eval-iters=-1: no evaluation",
     lambda c: c.train.schedule.eval_iters == 0),
    (["--no-data-sharding"], "--no-data-sharding: not read, the single loader",
     lambda c: c.train.data.data_sharding),
])
def test_settings_without_their_feature_are_not_read_and_say_so(argv, notice, check):
    """As in Megatron-LM, which reads them only with the feature they tune."""
    config, notices = parse_args([*BASE, *argv], "gpt")
    assert check(config) and [line for line in notices if line.startswith(notice)], notices


def test_eval_iters_below_minus_one_is_refused():
    with pytest.raises(ConfigError, match=r"^--eval-iters=-2 is invalid: it must be an integer "
                                          r">= -1$"):
        parse_args([*BASE, "--eval-iters", "-2"], "gpt")
