"""End to end: a tiny GPT trains on the learnable mock data and its loss falls, at TP=2 (2 gloo
ranks, sequence parallel, gradient accumulation) and TP=2 x DP=2 (4 ranks); the same global batch
gives the same loss curve whatever the split into TP, DP and micro-batches; bf16 and fp16 (fp32
masters, loss scaling) train too. The command line (launch.main, in this process) trains on an
indexed dataset through --data-path, stops at --exit-interval with a checkpoint and resumes, and
trains with --zero-stage 3 (tests/test_zero_training.py has ZeRO's multi-rank cases)."""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.distributed as dist

from configs import make_config
from dist_utils import DistSuite, free_port
from megadomino.cli.launch import main
from megadomino.config import ModelConfig
from megadomino.data import IndexedDatasetBuilder
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train

ITERS = 30


def _run(tp: int, dp: int, micro_batch_size: int, iters: int = ITERS, sequence_parallel=False,
         **train_overrides) -> tuple[dict, list[str]]:
    dims = ParallelDims(tp=tp, dp=dp)
    model_config = ModelConfig.preset("gpt-tiny", hidden_dropout=0.0, attention_dropout=0.0,
                                      seq_length=32)
    config = make_config(
        model_config, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        micro_batch_size=micro_batch_size, global_batch_size=8, train_iters=iters, lr=5e-3,
        min_lr=5e-4, lr_warmup_iters=3, log_interval=10, eval_interval=iters, eval_iters=2,
        mock_data=True, **train_overrides)
    lines: list[str] = []
    history = train(config, dims, "gpt", log=lines.append)
    return history, lines


def _check_learns(history: dict, ratio: float) -> None:
    losses = history["losses"]
    first, last = losses[0], sum(losses[-5:]) / 5
    assert first > 5.5, f"initial loss {first} should be near ln(512) = 6.24"
    assert last < ratio * first, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert history["eval"] and history["eval"][-1]["loss"] < ratio * first


def _check_same_on_every_rank(values: list[float]) -> None:
    mine = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    for other in gathered:
        assert torch.equal(other, mine), "ranks disagree on the loss curve"


def _check_same_curve(a: dict, b: dict) -> None:
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]),
                               rtol=1e-4, atol=0)


def _case_tp_then_dp(tp: int, dp: int, sequence_parallel: bool) -> None:
    """TP x DP with accumulation (2 micro-batches) learns; the pure-DP split of the same global
    batch (tp=1, dp=world, 1 micro-batch) gives the same curve; every rank logs the same loss."""
    history, lines = _run(tp, dp, micro_batch_size=8 // (2 * dp),
                          sequence_parallel=sequence_parallel)
    _check_learns(history, ratio=0.6)
    _check_same_on_every_rank(history["losses"])
    assert history["skipped_iterations"] == 0
    if dist.get_rank() == 0:
        # the start-up summary (6 lines), per log interval an iteration line and the engine's
        # line, then validation's start and result lines, and the end-of-run line
        summary, log, validation = lines[:6], lines[6:-3], lines[-3:-1]
        assert [line.split(":")[0] for line in summary] == [
            " model", " parallelism", " data parallelism", " data", " samples", " schedule"], \
            summary
        assert lines[-1].startswith(f" run ended: iterations 1-{ITERS} of {ITERS} in "), lines
        assert f"TP {tp} x PP 1 x DP {dp}" in summary[1], summary
        assert len(log) == 2 * (ITERS // 10), lines
        assert all("per rank: held" in line for line in log[1::2]), lines
        assert validation[0].startswith(f" validation at iteration {ITERS}: "), validation
        line = log[0]
        for field in ("loss", "lr", "grad norm", "ms/iter", "tokens/s", "peak mem"):
            assert field in line, f"{field!r} missing from the log line {line!r}"
        on_gpu = next(history["model"].parameters()).is_cuda
        for field in ("TFLOP/s/GPU", "MFU"):  # GPU figures: absent from a CPU run's line
            assert (field in line) == on_gpu, line
    world = dist.get_world_size()
    reference, _ = _run(1, world, micro_batch_size=8 // world)
    _check_same_curve(history, reference)


def _case_low_precision(flag: str) -> None:
    overrides = {flag: True}
    if flag == "fp16":
        overrides["initial_loss_scale"] = 2.0**16
    history, _ = _run(2, 1, micro_batch_size=4, iters=20, **overrides)
    _check_learns(history, ratio=0.75)
    model = history["model"]
    expected = torch.bfloat16 if flag == "bf16" else torch.float16
    assert all(p.dtype == expected for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in history["optimizer"].optimizer.masters)


SUITE = DistSuite()
SUITE.case("tp2_sp", _case_tp_then_dp, 2, 1, True, worlds=(2,))
SUITE.case("tp2_bf16", _case_low_precision, "bf16", worlds=(2,))
SUITE.case("tp2_fp16", _case_low_precision, "fp16", worlds=(2,))
SUITE.case("tp2_dp2", _case_tp_then_dp, 2, 2, False, worlds=(4,))

test_train_e2e = SUITE.test()


def test_command_line_trains_on_data_path_and_resumes(tmp_path, monkeypatch, capsys):
    """pretrain_gpt.py's main on a --data-path corpus, which the start-up summary names: stops at
    --exit-interval after saving, then --load resumes at the next iteration; saving and loading
    say where they start."""
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"))
    for _ in range(40):
        start, step = rng.integers(0, 50), rng.integers(1, 4)
        document = (start + step * np.arange(rng.integers(10, 40))) % 50
        builder.add_document(document, [len(document)])
    builder.finalize(str(tmp_path / "corpus.idx"))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    argv = ["--model-preset", "gpt-tiny", "--seq-length", "16", "--data-path",
            str(tmp_path / "corpus"), "--split", "90,10,0", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "50", "--micro-batch-size", "4", "--train-iters", "8",
            "--log-interval", "2", "--eval-interval", "4", "--eval-iters", "1",
            "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    assert main("gpt", [*argv, "--exit-interval", "4"]) == 0
    first = capsys.readouterr().out
    assert "no checkpoint in --load" in first and "stopping: --exit-interval=4" in first
    assert f"\n data: --data-path {tmp_path / 'corpus'} (--split 90,10,0); " in first, first
    saved = tmp_path / "ckpt" / "iter_0000004"
    assert f" saving checkpoint {saved}\n saved checkpoint {saved} (iteration 4)\n" in first
    assert main("gpt", argv) == 0
    second = capsys.readouterr().out
    assert f" loading checkpoint {saved}\n loaded checkpoint {saved} (iteration 4)\n" in second
    iterations = [int(i) for i in re.findall(r" iteration +(\d+)/", first + second)]
    assert iterations == [2, 4, 6, 8], first + second
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"


def test_command_line_zero(monkeypatch, capsys):
    """pretrain_gpt.py's main with --zero-stage 3 and qwZ trains and logs the engine's line; an
    hpZ partition this world cannot have exits 2 naming the flag, before any process group."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    argv = ["--model-preset", "gpt-tiny", "--seq-length", "16", "--mock-data", "--train-iters",
            "4", "--log-interval", "2", "--zero-stage", "3", "--zeropp-quantized-weights"]
    assert main("gpt", argv) == 0
    out = capsys.readouterr().out
    # one rank: no data-parallel bytes to count
    assert len(re.findall(r"^ ZeRO-3 per rank: held .* MiB$", out, re.M)) == 2, out
    assert main("gpt", [*argv, "--zeropp-hpz-partition-size", "2"]) == 2
    assert "error: --zeropp-hpz-partition-size=2 is invalid" in capsys.readouterr().err
    assert not dist.is_initialized()
