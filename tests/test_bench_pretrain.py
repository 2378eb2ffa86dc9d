"""benchmarks/bench_pretrain.py's end-to-end comparison with megatron-core, checked on the CPU
before GPU time is spent on it: every launch it makes for ours is a valid pretrain command with
the row's layout and batch, the peer's (benchmarks/megatron_pretrain.py) takes the same shapes
and batch, and megatron-core's model built from our preset has exactly our model's parameters
(skipped where megatron-core does not import)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megadomino.cli.arguments import parse_args
from megadomino.distributed import ParallelDims
from megadomino.models import GPTModel, LlamaModel

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load("bench_pretrain")
peer = _load("megatron_pretrain")

# (bench flags, tp): DP with the sharded optimizer, TP, 1F1B and the interleaved schedule,
# with an uneven accumulation (3 micro-batches of 3)
ROWS = [(["--dp", "2", "--micro-batch-size", "2"], 1),
        (["--tp", "2", "--micro-batch-size", "3", "--accumulation", "3"], 2),
        (["--pp", "2", "--num-layers", "6", "--accumulation", "4"], 1),
        (["--pp", "2", "--num-layers", "8", "--vp", "2", "--accumulation", "4"], 1)]


@pytest.mark.parametrize("flags, tp", ROWS)
def test_both_columns_run_the_same_row(flags, tp):
    args = bench.parse(["--peer", "megatron", "--preset", "gpt3-1.3b", *flags])
    launches = bench.launches(args, gpus=8)
    ours = [cmd for row, cmd, _ in launches if row["system"] == "ours" and row["tp"] == tp]
    theirs = [cmd for row, cmd, env in launches
              if row["system"] == "megatron-core" and row["tp"] == tp
              and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"]
    assert len(ours) == len(theirs) == 1
    ours, theirs = ours[0], theirs[0]
    config, _ = parse_args(ours[ours.index("pretrain_gpt.py") + 1:], "gpt")
    peer_args = peer.parse(theirs[theirs.index(str(BENCH / "megatron_pretrain.py")) + 1:])
    world = int(ours[2].split("=")[1])
    assert theirs[2] == ours[2] and world == tp * args.pp * args.dp
    parallel = config.parallel
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size) == \
        (peer_args.tensor_model_parallel_size, peer_args.pipeline_model_parallel_size) == \
        (tp, args.pp)
    assert config.model == peer.model_config(peer_args).replace(
        params_dtype=config.model.params_dtype)
    assert config.model.hidden_dropout == config.model.attention_dropout == 0.0
    schedule = config.train.schedule
    assert (schedule.global_batch_size, schedule.micro_batch_size) == \
        (peer_args.global_batch_size, peer_args.micro_batch_size)
    assert schedule.global_batch_size == args.micro_batch_size * args.accumulation * args.dp
    if args.vp:
        assert parallel.pipeline_schedule == "interleaved" and peer_args.overlap_p2p_communication
        assert parallel.num_layers_per_virtual_pipeline_stage == \
            peer_args.num_layers_per_virtual_pipeline_stage == args.vp
        assert peer.virtual_chunks(peer.model_config(peer_args), peer_args) == 2
    if args.dp > 1:
        assert config.parallel.zero.stage == 1 and peer_args.use_distributed_optimizer
        assert peer_args.overlap_param_gather and config.parallel.zero.overlap_param_gather


def test_graphed_variant_drops_the_gather_overlap_it_refuses():
    args = bench.parse(["--peer", "megatron", "--tp", "1", "--dp", "2", "--variants",
                        " --compile-layer-pieces --enable-cuda-graph"])
    (_, ours, _), _ = bench.launches(args, gpus=2)
    config, _ = parse_args(ours[ours.index("pretrain_gpt.py") + 1:], "gpt")
    assert config.parallel.enable_cuda_graph and not config.parallel.zero.overlap_param_gather


def test_summary_takes_medians_and_the_ratio_of_medians():
    rows = [{"system": system, "tp": 1, "sequence_parallel": False, "variant": "",
             "tokens_per_s": tokens, "ms_per_iter": 1e3 / tokens, "mfu_percent": 1.0,
             "peak_mem_gib": 2.0}
            for system, tokens in [("ours", 110), ("ours", 130), ("ours", 120),
                                   ("megatron-core", 100), ("megatron-core", 90)]]
    rows.append({"system": "megatron-core", "tp": 1, "sequence_parallel": False, "variant": "",
                 "error": 1})
    ours, theirs = bench.summary(rows)
    assert (ours["tokens_per_s"], ours["tokens_min"], ours["tokens_max"]) == (120, 110, 130)
    assert theirs["failed"] == 1 and theirs["tokens_per_s"] == 95
    assert ours["vs_peer"] == pytest.approx(120 / 95) and "vs_peer" not in theirs


@pytest.mark.usefixtures("single_process_group")
@pytest.mark.parametrize("preset, model", [("gpt-tiny", GPTModel), ("llama-tiny", LlamaModel)])
def test_peer_builds_our_parameters(preset, model):
    pytest.importorskip("megatron.core")
    import torch
    from megatron_reference import cpu_only, init_megatron

    args = peer.parse(["--model-preset", preset, "--seq-length", "64", "--num-layers", "3"])
    config = peer.model_config(args)
    init_megatron(1)
    with cpu_only():
        chunks = peer.build_chunks(config, peer.transformer_config(config, args, torch.bfloat16,
                                                                   cpu=True), 1, "cpu")
    theirs = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    ours = sum(p.numel() for p in model(config, ParallelDims(tp=1), "cpu").parameters())
    assert len(chunks) == 1 and theirs == ours


def test_limit_runs_on_one_gpu_rows_only_and_each_column_gets_its_fraction():
    one = bench.launches(bench.parse(["--peer", "megatron", "--tp", "1", "--limit"]), gpus=8)
    two = bench.launches(bench.parse(["--peer", "megatron", "--tp", "1", "--dp", "2",
                                      "--limit"]), gpus=8)
    assert [row["system"] for row, _, _ in one] == ["ours", "megatron-core", "limit"]
    assert "limit" not in [row["system"] for row, _, _ in two]
    limit_flags = one[2][1][one[2][1].index(str(BENCH / "step_limit.py")) + 1:]
    assert peer.parse(limit_flags) == peer.parse(one[1][1][one[1][1].index(
        str(BENCH / "megatron_pretrain.py")) + 1:-1])  # the peer's flags less its reduce overlap
    rows = [{"system": system, "tp": 1, "sequence_parallel": False, "variant": "",
             "tokens_per_s": tokens, "ms_per_iter": 1.0, "mfu_percent": 1.0,
             "peak_mem_gib": 1.0}
            for system, tokens in [("ours", 90), ("megatron-core", 80), ("limit", 100)]]
    ours, theirs, limit = bench.summary(rows)
    assert (ours["of_limit"], theirs["of_limit"]) == (0.9, 0.8) and "of_limit" not in limit
    assert ours["vs_peer"] == 90 / 80 and "vs_peer" not in limit
