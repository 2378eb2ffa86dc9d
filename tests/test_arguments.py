"""The Megatron-LM command line: flag mapping, presets, the flag policy, validation, the docs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from configs import make_config
from megadomino.cli.arguments import build_parser, parse_args, render_flag_table
from megadomino.cli.flags import FINETUNE_FLAGS, FLAGS, NOTICE, RANGES, REFUSED, _count
from megadomino.config import ConfigError, ModelConfig, TrainConfig
from megadomino.config.validate import validate
from megadomino.zero import ZeroConfig

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "tests" / "fixtures" / "pipeline_plan_tp2_tp1.json"
BASE = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10"]


def parse(*argv: str, family: str = "gpt", base: list[str] = BASE):
    return parse_args([*base, *argv], family)


def field(parsed, path: str):
    """The value at `path` ('parallel.zero.stage') of parse_args's config."""
    value = parsed[0]
    for name in path.split("."):
        value = getattr(value, name)
    return value


RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "block",
             "--recompute-num-layers", "2")
MAPPED = [
    (("--num-layers", "3"), "model.num_layers", 3),
    (("--hidden-size", "128"), "model.hidden_size", 128),
    (("--ffn-hidden-size", "96"), "model.ffn_hidden_size", 96),
    (("--num-attention-heads", "8"), "model.num_attention_heads", 8),
    (("--group-query-attention", "--num-query-groups", "2"), "model.num_query_groups", 2),
    (("--num-key-value-heads", "2"), "model.num_query_groups", 2),
    (("--kv-channels", "32"), "model.kv_channels", 32),
    (("--seq-length", "32"), "model.seq_length", 32),
    (("--max-position-embeddings", "128"), "model.max_position_embeddings", 128),
    (("--position-embedding-type", "rope"), "model.position_embedding_type", "rope"),
    (("--use-rotary-position-embeddings",), "model.position_embedding_type", "rope"),
    (("--rotary-base", "500000"), "model.rotary_base", 500000.0),
    (("--normalization", "RMSNorm"), "model.normalization", "RMSNorm"),
    (("--norm-epsilon", "1e-6"), "model.norm_epsilon", 1e-6),
    (("--swiglu",), "model.swiglu", True),
    (("--disable-bias-linear",), "model.add_bias_linear", False),
    (("--untie-embeddings-and-output-weights",), "model.untie_embeddings_and_output_weights",
     True),
    (("--hidden-dropout", "0.0"), "model.hidden_dropout", 0.0),
    (("--attention-dropout", "0.05"), "model.attention_dropout", 0.05),
    (("--init-method-std", "0.01"), "model.init_method_std", 0.01),
    (("--vocab-size", "1000"), "model.vocab_size", 1000),
    (("--make-vocab-size-divisible-by", "64"), "model.make_vocab_size_divisible_by", 64),
    (("--tensor-model-parallel-size", "2"), "parallel.tensor_model_parallel_size", 2),
    (("--pipeline-model-parallel-size", "1"), "parallel.pipeline_model_parallel_size", 1),
    (("--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
      "interleaved", "--virtual-pipeline-model-parallel-size", "2"),
     "parallel.virtual_pipeline_model_parallel_size", 2),
    (("--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
      "interleaved", "--num-layers-per-virtual-pipeline-stage", "1"),
     "parallel.num_layers_per_virtual_pipeline_stage", 1),
    (("--pipeline-schedule", "eager-1f1b"), "parallel.pipeline_schedule", "eager-1f1b"),
    (("--num-layers", "3", "--pipeline-model-parallel-size", "2",
      "--untie-embeddings-and-output-weights", "--pipeline-plan", str(PLAN)),
     "parallel.pipeline_plan", str(PLAN)),
    (("--num-layers", "3", "--untie-embeddings-and-output-weights", "--pipeline-plan", str(PLAN),
      "--pipeline-reshard", "scatter-gather"), "parallel.pipeline_reshard", "scatter-gather"),
    (("--num-layers", "3", "--untie-embeddings-and-output-weights", "--pipeline-plan", str(PLAN),
      "--nics-per-node", "1"), "parallel.nics_per_node", 1),
    (("--pipeline-plan", "auto"), "parallel.pipeline_plan", "auto"),
    (("--pipeline-plan", "auto", "--pipeline-planner", "dt-fm"), "parallel.pipeline_planner",
     "dt-fm"),
    (("--pipeline-plan", "auto", "--pipeline-placement-dir", "placed"),
     "parallel.pipeline_placement_dir", "placed"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "int4"),
     "parallel.pipeline_codec", "int4"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "adatopk",
      "--pipeline-codec-density", "0.05"), "parallel.pipeline_codec_density", 0.05),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "auto",
      "--pipeline-codec-interval", "20"), "parallel.pipeline_codec_interval", 20),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "adatopk",
      "--pipeline-codec-values", "int8"), "parallel.pipeline_codec_values", "int8"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "adatopk",
      "--pipeline-codec-values", "int4"), "parallel.pipeline_codec_values", "int4"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "adatopk",
      "--pipeline-codec-grad-topk"), "parallel.pipeline_codec_grad_topk", True),
    (("--pipeline-model-parallel-size", "2", "--pipeline-codec", "int8",
      "--pipeline-codec-error-feedback"), "parallel.pipeline_codec_error_feedback", True),
    (("--pipeline-model-parallel-size", "2", "--pipeline-link-delay", "0.01"),
     "parallel.pipeline_link_delay", 0.01),
    (("--emulate-slow-rank", "0:2"), "parallel.emulate_slow_rank", "0:2"),
    (("--num-layers", "3", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "1"), "parallel.decoder_first_pipeline_num_layers",
     1),
    (("--num-layers", "3", "--pipeline-model-parallel-size", "2",
      "--decoder-last-pipeline-num-layers", "1"), "parallel.decoder_last_pipeline_num_layers", 1),
    (("--tensor-model-parallel-size", "2", "--sequence-parallel"), "parallel.sequence_parallel",
     True),
    (RECOMPUTE, "parallel.recompute_granularity", "full"),
    (RECOMPUTE, "parallel.recompute_method", "block"),
    (RECOMPUTE, "parallel.recompute_num_layers", 2),
    (("--recompute-activations",), "parallel.recompute_granularity", "selective"),
    (("--ddp-bucket-size", "1000"), "parallel.zero.bucket_numel", 1000),
    (("--micro-batch-size", "2"), "train.schedule.micro_batch_size", 2),
    (("--global-batch-size", "16"), "train.schedule.global_batch_size", 16),
    (("--train-iters", "7"), "train.schedule.train_iters", 7),
    (("--manual-gc",), "train.runtime.manual_gc", True),
    (("--profile",), "train.logging.profile", True),
    (("--profile", "--profile-step-start", "3"), "train.logging.profile_step_start", 3),
    (("--profile", "--profile-step-end", "15"), "train.logging.profile_step_end", 15),
    (("--profile", "--profile-ranks", "0", "1"), "train.logging.profile_ranks", [0, 1]),
    (("--profile", "--use-pytorch-profiler"), "train.logging.use_pytorch_profiler", True),
    (("--manual-gc", "--manual-gc-interval", "5"), "train.runtime.manual_gc_interval", 5),
    (("--manual-gc", "--no-manual-gc-eval"), "train.runtime.manual_gc_eval", False),
    (("--lr", "3e-4"), "train.schedule.lr", 3e-4),
    (("--min-lr", "1e-5"), "train.schedule.min_lr", 1e-5),
    (("--lr-decay-style", "cosine"), "train.schedule.lr_decay_style", "cosine"),
    (("--optimizer", "sgd"), "train.optimizer.optimizer", "sgd"),
    (("--optimizer", "SGD", "--sgd-momentum", "0.8"), "train.optimizer.sgd_momentum", 0.8),
    (("--lr-decay-iters", "8"), "train.schedule.lr_decay_iters", 8),
    (("--lr-warmup-iters", "2"), "train.schedule.lr_warmup_iters", 2),
    (("--lr-warmup-fraction", "0.1"), "train.schedule.lr_warmup_fraction", 0.1),
    (("--weight-decay", "0.1"), "train.optimizer.weight_decay", 0.1),
    (("--adam-beta1", "0.8"), "train.optimizer.adam_beta1", 0.8),
    (("--adam-beta2", "0.95"), "train.optimizer.adam_beta2", 0.95),
    (("--adam-eps", "1e-6"), "train.optimizer.adam_eps", 1e-6),
    (("--clip-grad", "0.5"), "train.optimizer.clip_grad", 0.5),
    (("--bf16",), "train.precision.bf16", True),
    (("--fp16",), "train.precision.fp16", True),
    (("--initial-loss-scale", "65536"), "train.precision.initial_loss_scale", 65536.0),
    (("--min-loss-scale", "2"), "train.precision.min_loss_scale", 2.0),
    (("--loss-scale-window", "500"), "train.precision.loss_scale_window", 500),
    (("--hysteresis", "3"), "train.precision.hysteresis", 3),
    (("--fp8-format", "e4m3"), "train.precision.fp8.format", "e4m3"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"), "train.precision.fp8.recipe",
     "tensorwise"),
    (("--fp8-format", "hybrid", "--use-distributed-optimizer", "--fp8-param-gather"),
     "parallel.zero.fp8_param_gather", True),
    (("--fp8-format", "hybrid", "--fp8-amax-history-len", "16"),
     "train.precision.fp8.amax_history_len", 16),
    (("--fp8-format", "hybrid", "--fp8-amax-compute-algo", "max"),
     "train.precision.fp8.amax_compute_algo", "max"),
    (("--fp8-format", "hybrid", "--fp8-margin", "1"), "train.precision.fp8.margin", 1),
    (("--fp8-format", "hybrid", "--fp8-interval", "4"), "train.precision.fp8.interval", 4),
    (("--fp8-format", "hybrid", "--fp8-linears", "fc1,fc2"), "train.precision.fp8.linears",
     ("fc1", "fc2")),
    (("--fp8-format", "hybrid", "--fp8-linears", "all"), "train.precision.fp8.linears",
     ("qkv", "proj", "fc1", "fc2")),
    (("--fp8-format", "hybrid", "--fp8-linears", "auto"), "train.precision.fp8.linears", "auto"),
    (("--fp8-format", "hybrid", "--first-last-layers-bf16"),
     "train.precision.fp8.first_last_layers_bf16", True),
    (("--fp8-format", "hybrid", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2"),
     "train.precision.fp8.num_layers_at_start_in_bf16", 2),
    (("--fp8-format", "hybrid", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "0"),
     "train.precision.fp8.num_layers_at_end_in_bf16", 0),
    (("--seed", "7"), "train.runtime.seed", 7),
    (("--log-interval", "5"), "train.logging.log_interval", 5),
    (("--eval-interval", "50"), "train.schedule.eval_interval", 50),
    (("--eval-iters", "3"), "train.schedule.eval_iters", 3),
    (("--mock-data",), "train.data.mock_data", True),
    (("--dataloader-type", "cyclic"), "train.data.dataloader_type", "cyclic"),
    (("--dataloader-type", "cyclic", "--no-data-sharding"), "train.data.data_sharding", False),
    (("--peak-tflops", "312"), "train.logging.peak_tflops", 312.0),
    (("--gpus-per-node", "4"), "parallel.gpus_per_node", 4),
    (("--domino",), "parallel.domino_auto", True),
    (("--domino-explicit-backward",), "parallel.domino.explicit_backward", True),
    (("--compile-layer-pieces",), "parallel.compile_layer_pieces", True),
    (("--domino", "--domino-batch-slices", "4"), "parallel.domino.batch_slices", 4),
    (("--domino-hidden-slices", "2"), "parallel.domino.hidden_slices", 2),
    (("--domino-batch-slices", "auto"), "parallel.domino_auto", True),
    (("--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"),
     "parallel.tp_comm_overlap", True),
    (("--enable-cuda-graph", "--hidden-dropout", "0", "--attention-dropout", "0"),
     "parallel.enable_cuda_graph", True),
    (("--no-gradient-accumulation-fusion",), "parallel.gradient_accumulation_fusion", False),
    (("--no-overlap-p2p-communication",), "parallel.overlap_p2p_communication", False),
    (("--overlap-p2p-communication",), "parallel.overlap_p2p_communication", True),
    (("--save", "/ckpt"), "train.checkpoint.save", "/ckpt"),
    (("--save-interval", "50"), "train.checkpoint.save_interval", 50),
    (("--load", "/ckpt"), "train.checkpoint.load", "/ckpt"),
    (("--load", "/ckpt", "--finetune"), "train.checkpoint.finetune", True),
    (("--load", "/ckpt", "--no-load-optim"), "train.checkpoint.no_load_optim", True),
    (("--load", "/ckpt", "--no-load-rng"), "train.checkpoint.no_load_rng", True),
    (("--ckpt-format", "torch_dist"), "train.checkpoint.ckpt_format", "torch_dist"),
    (("--use-dist-ckpt",), "train.checkpoint.ckpt_format", "torch_dist"),
    (("--no-save-optim",), "train.checkpoint.no_save_optim", True),
    (("--no-save-rng",), "train.checkpoint.no_save_rng", True),
    (("--load", "/ckpt", "--exit-on-missing-checkpoint"),
     "train.checkpoint.exit_on_missing_checkpoint", True),
    (("--exit-signal-handler",), "train.runtime.exit_signal_handler", True),
    (("--exit-duration-in-mins", "230"), "train.runtime.exit_duration_in_mins", 230),
    (("--distributed-timeout-minutes", "0.5"), "train.runtime.distributed_timeout_minutes", 0.5),
    (("--nccl-communicator-config-path", "nccl.yaml"), "parallel.nccl_communicator_config_path",
     "nccl.yaml"),
    (("--high-priority-stream-groups", "tp", "pp"), "parallel.high_priority_stream_groups",
     ["tp", "pp"]),
    (("--layernorm-epsilon", "1e-6"), "model.norm_epsilon", 1e-6),
    (("--exit-interval", "1000"), "train.runtime.exit_interval", 1000),
    (("--tensorboard-dir", "/tb"), "train.logging.tensorboard_dir", "/tb"),
    (("--use-distributed-optimizer",), "parallel.zero.stage", 1),
    (("--zero-stage", "3"), "parallel.zero.stage", 3),
    (("--use-distributed-optimizer", "--grad-reduce-in-bf16"), "parallel.zero.reduce_dtype",
     "bfloat16"),
    (("--zero-stage", "3", "--grad-reduce-in-bf16"), "parallel.zero.reduce_dtype", "bfloat16"),
    (("--zero-stage", "3", "--zeropp-quantized-weights"), "parallel.zero.quantized_weights", True),
    (("--zero-stage", "3", "--zeropp-hpz-partition-size", "2"), "parallel.zero.hpz_partition_size",
     2),
    (("--zero-stage", "1", "--zeropp-quantized-gradients"), "parallel.zero.quantized_gradients",
     True),
    (("--zero-stage", "1", "--zeropp-quantized-gradients", "--zeropp-gradient-bits", "8"),
     "parallel.zero.gradient_bits", 8),
    (("--zero-stage", "3", "--zeropp-quantized-weights", "--zeropp-block-size", "256"),
     "parallel.zero.block_size", 256),
    (("--zero-stage", "3", "--zero-layers-per-unit", "4"), "parallel.zero.layers_per_unit", 4),
    (("--zero-stage", "3", "--zero-unit-params", "5e7"), "parallel.zero.unit_params", 50_000_000),
    (("--zero-stage", "1", "--zeropp-quantized-gradients", "--zeropp-quantize-full-range"),
     "parallel.zero.quantize_full_range", True),
    (("--zero-stage", "1", "--zero-unit-params", "123456"), "parallel.zero.unit_params", 123456),
    (("--use-distributed-optimizer", "--overlap-param-gather"),
     "parallel.zero.overlap_param_gather", True),
    (("--apply-layernorm-1p",), "model.apply_layernorm_1p", True),
    (("--calculate-per-token-loss",), "train.schedule.calculate_per_token_loss", True),
    (("--decoupled-lr", "5e-4"), "train.schedule.decoupled_lr", 5e-4),
    (("--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5"),
     "train.schedule.decoupled_min_lr", 4.5e-5),
    (("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3"),
     "train.schedule.lr_wsd_decay_iters", 3),
    (("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3", "--lr-wsd-decay-style", "cosine"),
     "train.schedule.lr_wsd_decay_style", "cosine"),
    (("--save", "/ckpt", "--async-save"), "train.checkpoint.async_save", True),
    (("--diloco-inner-steps", "50"), "parallel.diloco.inner_steps", 50),
    (("--diloco-inner-steps", "50", "--diloco-sites", "4"), "parallel.diloco.sites", 4),
    (("--diloco-inner-steps", "50", "--diloco-outer-lr", "0.5"), "parallel.diloco.outer_lr", 0.5),
    (("--diloco-inner-steps", "50", "--diloco-outer-momentum", "0"),
     "parallel.diloco.outer_momentum", 0.0),
    (("--diloco-inner-steps", "50", "--diloco-pseudo-grad-dtype", "int8"),
     "parallel.diloco.pseudo_grad_dtype", "int8"),
]

SAMPLES = ["--model-preset", "gpt-tiny", "--mock-data", "--train-samples", "640"]
SAMPLE_MAPPED = [
    (("--lr-decay-samples", "600"), "train.schedule.lr_decay_samples", 600),
    (("--lr-warmup-samples", "60"), "train.schedule.lr_warmup_samples", 60),
    (("--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "100"),
     "train.schedule.lr_wsd_decay_samples", 100),
    (("--global-batch-size", "8", "--rampup-batch-size", "2", "2", "320"),
     "train.schedule.rampup_batch_size", [2, 2, 320]),
    # gpt-tiny's sequences are 64 tokens: thresholds in tokens become samples, pairs sorted
    (("--step-batch-size-schedule", "0:2 6.4K:4,128:8"),
     "train.schedule.step_batch_size_schedule", [[0, 2], [2, 8], [100, 4]]),
]
"""Flags of sample-based runs (--train-samples)."""


@pytest.mark.parametrize("argv, path, expected", SAMPLE_MAPPED,
                         ids=[c[0][-2] for c in SAMPLE_MAPPED])
def test_sample_flag_sets_its_field(argv, path, expected):
    assert field(parse(*argv, base=SAMPLES), path) == expected


@pytest.mark.parametrize("argv, named", [
    (("--train-iters", "10", "--lr-decay-samples", "600"), "--lr-decay-samples does not apply"),
    (("--train-iters", "10", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "8"),
     "--rampup-batch-size does not apply to a run of --train-iters"),
    (("--train-samples", "64", "--global-batch-size", "8", "--rampup-batch-size", "2", "2"),
     "--rampup-batch-size=.2, 2. is invalid: it must be three integers"),
    (("--train-samples", "64", "--global-batch-size", "8", "--rampup-batch-size", "8", "2", "8"),
     "START must be below --global-batch-size"),
    (("--train-samples", "64", "--global-batch-size", "8", "--rampup-batch-size", "2", "4", "8"),
     "reach it in whole INCREMENTs"),
    (("--train-samples", "64", "--global-batch-size", "8", "--micro-batch-size", "2",
      "--rampup-batch-size", "1", "1", "8"), "multiples of --micro-batch-size"),
    (("--train-samples", "64", "--global-batch-size", "4", "--step-batch-size-schedule",
      "0:2 1K:8"), "--global-batch-size=4 contradicts --step-batch-size-schedule, whose last "
                   "batch is 8"),
    (("--train-samples", "64", "--rampup-batch-size", "2", "2", "8", "--step-batch-size-schedule",
      "0:2 1K:4"), "--step-batch-size-schedule and --rampup-batch-size both set the batch size"),
    (("--train-samples", "64", "--step-batch-size-schedule", "64:2 1K:4"),
     "its first threshold must be 0 .samples., not 1"),
    (("--train-samples", "64", "--step-batch-size-schedule", "0:2 10:4"),
     "thresholds must increase, got 0 then 0 samples"),
    (("--train-samples", "64", "--step-batch-size-schedule", "0:2 1K"),
     "entry '1K' is invalid: each entry is THRESHOLD:BATCH"),
    (("--train-samples", "64", "--step-batch-size-schedule", "0:2 1x:4"),
     "entry '1x:4' is invalid"),
    (("--train-samples", "64", "--step-batch-size-schedule", " "),
     "--step-batch-size-schedule is empty"),
    (("--train-iters", "10", "--micro-batch-size", "2", "--step-batch-size-schedule",
      "0:2 1K:5"), "--step-batch-size-schedule batch 5 is invalid: every batch must be a "
                   "positive multiple of --micro-batch-size x data-parallel size .2."),
    (("--train-samples", "64", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "4"),
     "give one of --lr-warmup-fraction and --lr-warmup-samples"),
    (("--train-iters", "10", "--lr-decay-style", "WSD"), "needs the length of its annealing"),
    (("--train-iters", "10", "--lr-wsd-decay-iters", "3"), "applies to --lr-decay-style WSD"),
    (("--train-iters", "10", "--decoupled-min-lr", "1e-5"), "add --decoupled-lr"),
    (("--train-iters", "10", "--decoupled-lr", "1e-5", "--min-lr", "2e-5", "--lr", "1e-4"),
     "--decoupled-min-lr=2e-05 is invalid"),
    (("--train-iters", "10", "--overlap-param-gather"),
     "--overlap-param-gather=True is invalid: it must be used with --use-distributed-optimizer"),
    (("--train-iters", "10", "--use-distributed-optimizer", "--overlap-param-gather",
      "--domino-explicit-backward"), "--overlap-param-gather waits for each layer's gather"),
    (("--train-iters", "10", "--use-distributed-optimizer", "--overlap-param-gather",
      "--enable-cuda-graph", "--hidden-dropout", "0", "--attention-dropout", "0"),
     "Domino's schedule and CUDA graphs bypass"),
    (("--train-iters", "10", "--async-save"), "--async-save applies to --save"),
    (("--train-iters", "10", "--fp8-format", "hybrid", "--fp8-param-gather"),
     "--fp8-param-gather=True is invalid: it must be used with --use-distributed-optimizer"),
    (("--train-iters", "10", "--zero-stage", "3", "--fp8-param-gather"),
     "--fp8-param-gather gathers the weights of the FP8 linears: add --fp8-format"),
    (("--train-iters", "10", "--zero-stage", "3", "--fp8-format", "hybrid",
      "--zeropp-quantized-weights", "--fp8-param-gather"),
     "without --zeropp-quantized-weights: both quantize the weight gather"),
    (("--train-iters", "10", "--zero-stage", "3", "--fp8-format", "hybrid", "--gpus-per-node",
      "2", "--zeropp-hpz-partition-size", "2", "--fp8-param-gather"),
     "without --zeropp-hpz-partition-size: hpZ's secondary copies"),
])
def test_megatron_feature_rules_name_the_flag(argv, named):
    with pytest.raises(ConfigError, match=named):
        parse(*argv, base=["--model-preset", "gpt-tiny", "--mock-data"])


def test_step_schedule_with_its_last_batch_as_global_batch_is_a_notice():
    """Megatron-LM's GPT-3 175B example passes both; they agree, so the run takes them."""
    config, notices = parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--train-iters",
                                  "5", "--global-batch-size", "8", "--step-batch-size-schedule",
                                  "0:2 1K:8"], "gpt")
    assert config.train.schedule.step_batch_size_schedule == [[0, 2], [15, 8]]
    assert any(n.startswith("--global-batch-size: 8, the last batch of --step-batch-size-"
                            "schedule") for n in notices)

DATA = ["--model-preset", "gpt-tiny", "--train-iters", "10", "--tokenizer-type",
        "GPT2BPETokenizer", "--vocab-file", "vocab.json", "--merge-file", "merges.txt"]
DATA_MAPPED = [
    (("--data-path", "0.3", "a", "0.7", "b"), "train.data.data_path", ["0.3", "a", "0.7", "b"]),
    (("--data-path", "a", "--split", "98,2,0"), "train.data.split", "98,2,0"),
    (("--data-path", "a", "--tokenizer-type", "Llama2Tokenizer"), "train.data.tokenizer_type",
     "Llama2Tokenizer"),
    (("--data-path", "a", "--vocab-file", "v.json"), "train.data.vocab_file", "v.json"),
    (("--data-path", "a", "--merge-file", "m.txt"), "train.data.merge_file", "m.txt"),
    (("--data-path", "a", "--tokenizer-model", "m.model"), "train.data.tokenizer_model", "m.model"),
    (("--data-path", "a", "--eod-mask-loss"), "train.data.eod_mask_loss", True),
    (("--data-path", "a", "--data-cache-path", "/cache"), "train.data.data_cache_path", "/cache"),
]


@pytest.mark.parametrize("argv, path, expected", MAPPED, ids=[" ".join(c[0]) for c in MAPPED])
def test_flag_sets_its_field(argv, path, expected):
    assert field(parse(*argv), path) == expected


@pytest.mark.parametrize("argv, path, expected", DATA_MAPPED,
                         ids=[" ".join(c[0]) for c in DATA_MAPPED])
def test_data_flag_sets_its_field(argv, path, expected):
    assert field(parse(*argv, base=DATA), path) == expected


FINETUNE = ["--model-preset", "llama-tiny", "--train-iters", "10", "--mock-data"]
FINETUNE_MAPPED = [
    (("--hf-checkpoint", "/hf"), "train.checkpoint.hf_checkpoint", "/hf"),
    (("--prompt-template", "[INST] {prompt} [/INST]"), "train.data.prompt_template",
     "[INST] {prompt} [/INST]"),
]


@pytest.mark.parametrize("argv, path, expected", FINETUNE_MAPPED,
                         ids=[c[0][0] for c in FINETUNE_MAPPED])
def test_finetune_flag_sets_its_field(argv, path, expected):
    assert field(parse_args([*FINETUNE, *argv], "llama", finetune=True), path) == expected


def test_finetune_flags_belong_to_finetune_llama_only():
    with pytest.raises(ConfigError, match="unknown flag --hf-checkpoint"):
        parse("--hf-checkpoint", "/hf")


def test_every_mapped_flag_is_tested():
    tested = {arg for argv, _, _ in MAPPED + DATA_MAPPED + FINETUNE_MAPPED + SAMPLE_MAPPED
              for arg in argv}
    tested.add("--train-samples")  # see test_train_samples
    assert {flag.name for flag in FLAGS + FINETUNE_FLAGS if flag.field is not None} <= tested


def test_train_samples():
    configs = parse("--train-samples", "640", base=["--model-preset", "gpt-tiny", "--mock-data"])
    assert field(configs, "train.schedule.train_samples") == 640
    assert field(configs, "train.schedule.train_iters") is None


def test_megatron_defaults_and_no_notices():
    config, notices = parse()
    assert notices == []
    assert config.train.schedule.lr_decay_style == "linear"
    assert config.parallel.tensor_model_parallel_size == 1
    assert config.model.num_query_groups == config.model.num_attention_heads


SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--mock-data", "--train-iters", "1"]


@pytest.mark.parametrize("family, expected", [
    ("gpt", dict(normalization="LayerNorm", swiglu=False,
                 position_embedding_type="learned_absolute", add_bias_linear=True,
                 untie_embeddings_and_output_weights=False, hidden_dropout=0.1,
                 ffn_hidden_size=256, vocab_size=50257)),
    ("llama", dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                   add_bias_linear=False, untie_embeddings_and_output_weights=True,
                   hidden_dropout=0.0, ffn_hidden_size=128, vocab_size=32000)),
])
def test_family_defaults(family, expected):
    config, _ = parse_args(SHAPE, family)
    assert {name: getattr(config.model, name) for name in expected} == expected


def test_shape_flags_required_without_preset():
    with pytest.raises(ConfigError, match="--hidden-size, --num-attention-heads, --seq-length"):
        parse_args(["--num-layers", "2", "--mock-data", "--train-iters", "1"], "gpt")


def test_preset_with_overrides():
    config, _ = parse("--num-layers", "4", base=["--model-preset", "gpt3-1.3b",
                                                          "--mock-data", "--train-iters", "1"])
    assert (config.model.num_layers, config.model.hidden_size) == (4, 2048)
    config, _ = parse("--hidden-size", "128")
    assert (config.model.ffn_hidden_size, config.model.kv_channels) == (512, 32)
    config, _ = parse_args(["--model-preset", "llama2-70b", "--mock-data",
                                     "--train-iters", "1"], "gpt")
    assert (config.model.num_query_groups, config.model.normalization) == (8, "RMSNorm")
    config, _ = parse_args(["--model-preset", "llama-tiny", "--mock-data",
                                     "--train-iters", "1", "--num-attention-heads", "8"], "llama")
    assert config.model.num_query_groups == 8
    with pytest.raises(ConfigError, match="--model-preset 'nope' is unknown"):
        parse(base=["--model-preset", "nope", "--mock-data", "--train-iters", "1"])


def test_group_query_attention_alone_means_one_group():
    config, _ = parse("--group-query-attention")
    assert config.model.num_query_groups == 1


def _example_value(flag) -> list[str]:
    if flag.choices is not None:
        return [str(flag.choices[-1])]
    return {None: [], int: ["2"], float: ["0.5"]}.get(flag.type, ["x"])


NOTICES = [flag for flag in FLAGS if flag.policy == NOTICE]


def _rows_failing(rows, check) -> list[str]:
    """'flag: what went wrong' for every row whose `check(row)` raises or returns a complaint;
    a row table's test reports every failing row at once."""
    failing = []
    for row in rows:
        try:
            complaint = check(row)
        except Exception as err:  # reported with the row, whatever it is
            complaint = f"{type(err).__name__}: {err}"
        if complaint:
            failing.append(f"{row.name}: {complaint}")
    return failing


def test_every_notice_flag_is_accepted_with_one_notice_and_changes_nothing():
    """Each notice row parses to the config of the command without it (a notice sets no field)
    and gives one line: the flag and its row's text."""
    baseline = parse()[0]

    def check(flag) -> str | None:
        config, notices = parse(flag.name, *_example_value(flag))
        if notices != [f"{flag.name}: {flag.text}"] or "\n" in notices[0]:
            return f"notices {notices!r}"
        return "the config differs from the command's without it" if config != baseline else None

    failing = _rows_failing(NOTICES, check)
    assert not failing, f"{len(failing)} of {len(NOTICES)} notice rows:\n" + "\n".join(failing)


def test_sequence_parallel_is_dropped_at_tp1_with_a_notice():
    config, notices = parse("--sequence-parallel")
    assert config.parallel.sequence_parallel is False
    assert notices == ["--sequence-parallel: dropped, it has no effect with "
                       "--tensor-model-parallel-size 1"]


REFUSALS = [flag for flag in FLAGS if flag.policy == REFUSED]


def test_every_refused_flag_names_itself_and_the_reason():
    def check(flag) -> str | None:
        try:
            parse(flag.name, *_example_value(flag))
        except ConfigError as error:
            message = str(error)
            if message.startswith(flag.name) and message.endswith(f"is refused: {flag.text}"):
                return None
            return f"refused with {message!r}"
        return "accepted"

    failing = _rows_failing(REFUSALS, check)
    assert not failing, f"{len(failing)} of {len(REFUSALS)} refused rows:\n" + "\n".join(failing)


@pytest.mark.parametrize("argv, reason", [
    (("--context-parallel-size", "2"), "context parallelism is not implemented"),
    (("--position-embedding-type", "mrope"),
     "only learned_absolute and rope positions are implemented"),
    (("--lr-decay-style", "inverse-square-root"), "inverse-square-root decay is not implemented"),
    (("--optimizer", "dist_muon"), "Muon is not implemented: use adam or sgd"),
    (("--ckpt-format", "zarr"), "only the torch and torch_dist formats are implemented"),
    (("--tokenizer-type", "TikTokenizer"), "that tokenizer type is not implemented"),
    (("--pretrained-checkpoint", "/ckpt"), "use --load DIR --finetune"),
])
def test_refusals_give_the_reason(argv, reason):
    with pytest.raises(ConfigError) as error:
        parse(*argv)
    assert str(error.value).startswith(argv[0])
    assert str(error.value).endswith(f"is refused: {reason}")


@pytest.mark.parametrize("argv", [("--context-parallel-size", "1"),
                                  ("--expert-model-parallel-size", "1"),
                                  ("--rotary-percent", "1.0"), ("--optimizer", "adam"),
                                  ("--ckpt-format", "torch"), ("--main-grads-dtype", "fp32"),
                                  ("--dataloader-type", "single"),
                                  ("--ds-sequence-parallel-size", "1"), ("--rope-type", "rope")])
def test_values_that_ask_for_nothing_are_accepted(argv):
    """A refused row's supported value, or an implemented row's default, parses without a
    notice to the config of the command without it; an implemented row's field reads it."""
    parsed = parse(*argv)
    assert parsed[1] == []
    assert parsed[0] == parse()[0]
    row = next(flag for flag in FLAGS if flag.name == argv[0])
    if row.field is not None:
        assert field(parsed, row.field) == argv[1]


def test_no_data_source_is_refused():
    with pytest.raises(ConfigError, match="no data source: pass --data-path"):
        parse_args(["--model-preset", "gpt-tiny", "--train-iters", "1"], "gpt")


@pytest.mark.parametrize("argv, named", [
    (("--data-path", "a", "--mock-data"), "--mock-data and --data-path exclude each other"),
    (("--data-path", "a", "--tokenizer-type", "NullTokenizer", "--save-interval", "0"),
     "--save-interval=0 is invalid"),
    (("--data-path", "a", "--tokenizer-type", "NullTokenizer", "--exit-duration-in-mins", "-1"),
     "--exit-duration-in-mins=-1 is invalid"),
    (("--mock-data", "--distributed-timeout-minutes", "0"),
     "--distributed-timeout-minutes=0.0 is invalid: it must be > 0"),
    (("--data-path", "a"), "--data-path needs --tokenizer-type"),
])
def test_data_and_checkpoint_rules(argv, named):
    with pytest.raises(ConfigError, match=named):
        parse_args(["--model-preset", "gpt-tiny", "--train-iters", "1", *argv], "gpt")


@pytest.mark.parametrize("flag", ["--finetune", "--no-load-optim", "--no-load-rng",
                                  "--exit-on-missing-checkpoint"])
def test_load_options_need_load(flag):
    with pytest.raises(ConfigError, match=f"{flag} applies to --load"):
        parse(flag)


@pytest.mark.parametrize("argv, named", [
    (("--eod-mask-loss",), "--eod-mask-loss is refused by finetune_llama.py"),
    (("--prompt-template", "[INST] [/INST]"), "it must contain {prompt}"),
    (("--hf-checkpoint", "/nonexistent"), "--hf-checkpoint=/nonexistent: cannot read"),
])
def test_finetune_rules(argv, named):
    base = ["--train-iters", "1", "--mock-data"]
    if "--hf-checkpoint" not in argv:
        base += ["--model-preset", "llama-tiny"]
    with pytest.raises(ConfigError, match=named):
        parse_args([*base, *argv], "llama", finetune=True)


@pytest.mark.parametrize("argv, named", [
    (("--bogus-flag",), "unknown flag --bogus-flag"),
    (("--bogus=3",), "unknown flag --bogus:"),
    (("--num-layer", "2"), "unknown flag --num-layer: .*did you mean --num-layers\\?"),
    (("--tensor-model-parallel", "2"), "unknown flag --tensor-model-parallel:"),
    (("--num-layers", "2", "3"), "unexpected argument '3'"),
    (("--num-layers", "two"), "argument --num-layers: invalid int value: 'two'"),
    (("--normalization", "BatchNorm"), "argument --normalization: invalid choice"),
])
def test_unknown_or_malformed_flags_are_named(argv, named):
    with pytest.raises(ConfigError, match=named):
        parse(*argv)


@pytest.mark.parametrize("argv, named", [
    (("--bf16", "--fp16"), "--bf16 and --fp16 are exclusive"),
    (("--train-samples", "64"), "exactly one of --train-iters and --train-samples"),
    (("--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"), "one of --lr-warmup-fraction"),
    (("--min-lr", "1e-3", "--lr", "1e-4"), "--min-lr=0.001 is invalid"),
    (("--num-query-groups", "2"), "--num-query-groups is read only with --group-query-attention"),
    (("--recompute-granularity", "selective", "--recompute-method", "uniform"),
     "--recompute-method applies to --recompute-granularity full only"),
])
def test_cross_flag_rules(argv, named):
    with pytest.raises(ConfigError, match=named):
        parse(*argv)


def test_zero_flags_make_the_engine_config():
    zero_pp = ("--zero-stage", "3", "--zeropp-quantized-weights", "--zeropp-hpz-partition-size",
               "2", "--zeropp-quantized-gradients", "--zeropp-gradient-bits", "8",
               "--zeropp-block-size", "256")
    config, notices = parse(*zero_pp)
    assert notices == []
    assert config.parallel.zero == ZeroConfig(
        stage=3, quantized_weights=True, hpz_partition_size=2, quantized_gradients=True,
        gradient_bits=8, block_size=256)

    def zero(*argv: str) -> ZeroConfig:
        return parse(*argv)[0].parallel.zero

    assert zero("--zero-stage", "3") == ZeroConfig(stage=3)
    assert zero("--zero-stage", "1", "--zero-layers-per-unit", "3") == \
        ZeroConfig(stage=1, layers_per_unit=3)
    assert zero("--use-distributed-optimizer") == ZeroConfig(stage=1)
    assert zero("--zero-stage", "3", "--zero-unit-params", "1e6") == \
        ZeroConfig(stage=3, unit_params=1_000_000)
    assert ZeroConfig().layers_per_unit is None and ZeroConfig().unit_params == 200_000_000
    assert zero("--zero-stage", "3", "--zeropp-quantized-weights",
                "--zeropp-quantize-full-range") == \
        ZeroConfig(stage=3, quantized_weights=True, quantize_full_range=True)
    assert zero() == ZeroConfig(stage=0)  # plain data parallelism
    assert zero("--ddp-bucket-size", "1000") == ZeroConfig(stage=0, bucket_numel=1000)
    # Domino runs with stage 1
    parse("--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--domino")


@pytest.mark.parametrize("argv, named", [
    (("--zeropp-quantized-weights",),
     "--zeropp-quantized-weights is a ZeRO option: add --zero-stage 3"),
    (("--zeropp-block-size", "256"), "--zeropp-block-size is a ZeRO option"),
    (("--zero-unit-params", "1e8"), "--zero-unit-params is a ZeRO option"),
    (("--zero-stage", "3", "--zeropp-quantize-full-range"),
     "--zeropp-quantize-full-range sets how qwZ and qgZ quantize: add"),
    (("--zero-stage", "3", "--zero-unit-params", "1e8", "--zero-layers-per-unit", "2"),
     "--zero-layers-per-unit 2 fixes the layers a unit, --zero-unit-params 100000000 sizes "
     "units by parameters: give one of them"),
    (("--zero-stage", "3", "--zero-unit-params", "0"),
     "--zero-unit-params=0 is invalid: it must be an integer >= 1"),
    (("--zero-stage", "1", "--zeropp-quantized-weights"),
     "--zeropp-quantized-weights=True is invalid: it must be off at --zero-stage 1"),
    (("--zero-stage", "1", "--zeropp-hpz-partition-size", "2"),
     "--zeropp-hpz-partition-size=2 is invalid: it must be 1 at --zero-stage 1"),
    (("--zero-stage", "3", "--zeropp-gradient-bits", "8"),
     "--zeropp-gradient-bits sets qgZ's precision: add --zeropp-quantized-gradients"),
    (("--zero-stage", "3", "--zeropp-block-size", "256"), "--zeropp-block-size sets the blocks"),
    (("--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-block-size", "7"),
     "--zeropp-block-size=7 is invalid: it must be an even integer"),
    (("--zero-stage", "3", "--zeropp-quantized-gradients", "--zeropp-gradient-bits", "2"),
     "argument --zeropp-gradient-bits: invalid choice"),
    (("--zero-stage", "2"), "--zero-stage=2 is refused: ZeRO stage 2"),
    (("--zero-stage", "4"), "argument --zero-stage: invalid choice"),
    (("--zero-layers-per-unit", "2"), "--zero-layers-per-unit is a ZeRO option: add --zero-stage"),
    (("--zero-stage", "1", "--zero-layers-per-unit", "0"),
     "--zero-layers-per-unit=0 is invalid: it must be an integer >= 1"),
    (("--use-distributed-optimizer", "--zero-stage", "3"),
     "--use-distributed-optimizer is ZeRO stage 1 and contradicts --zero-stage 3"),
    (("--zero-stage", "1", "--ddp-bucket-size", "1000"), "--ddp-bucket-size sizes plain"),
    (("--zero-stage", "3", "--tensor-model-parallel-size", "2", "--domino"),
     "--zero-stage 3 gathers .* --domino-batch-slices auto"),
    (("--zero-stage", "3", "--tensor-model-parallel-size", "2", "--domino-explicit-backward"),
     "--zero-stage 3 gathers .* Domino \\(--domino"),
    (("--zero-stage", "3", "--domino-batch-slices", "auto"),
     "--zero-stage 3 gathers .* --domino-batch-slices auto"),
])
def test_zero_rules(argv, named):
    with pytest.raises(ConfigError, match=named):
        parse(*argv)


NO_DROPOUT = ("--enable-cuda-graph", "--hidden-dropout", "0", "--attention-dropout", "0")


@pytest.mark.parametrize("argv, named", [
    ((*NO_DROPOUT, "--recompute-granularity", "selective"),
     "--recompute-granularity=selective is invalid: it must be unset with --enable-cuda-graph"),
    ((*NO_DROPOUT, "--tensor-model-parallel-size", "2", "--domino-batch-slices", "2",
      "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"),
     "--recompute-granularity=full is invalid: it must be unset with --enable-cuda-graph"),
    ((*NO_DROPOUT, "--tensor-model-parallel-size", "2", "--domino-batch-slices", "2",
      "--zero-stage", "3"), "--enable-cuda-graph captures the layers, but --zero-stage 3"),
    ((*NO_DROPOUT, "--tensor-model-parallel-size", "2", "--domino"),
     "--domino-batch-slices auto times the plans eagerly"),
    ((*NO_DROPOUT, "--domino-batch-slices", "auto"),
     "--domino-batch-slices auto times the plans eagerly"),
    ((*NO_DROPOUT, "--zero-stage", "3"), "--enable-cuda-graph captures the layers, but "
     "--zero-stage 3"),
    ((*NO_DROPOUT, "--fp8-format", "hybrid", "--use-distributed-optimizer",
      "--fp8-param-gather"), "--fp8-param-gather hands each step's gathered codes"),
])
def test_cuda_graph_rules(argv, named):
    with pytest.raises(ConfigError, match=named):
        parse(*argv)


def test_cuda_graph_with_dropout_parses():
    """The graphs capture dropout (the RNG streams are registered with them)."""
    parsed = parse("--enable-cuda-graph")
    assert field(parsed, "parallel.enable_cuda_graph")
    assert field(parsed, "model.hidden_dropout") == 0.1


def test_cuda_graph_takes_fp8_linears():
    """Captured FP8 linears cast their weights at every replay (tests/gpu/test_gpu_cuda_graph.py
    trains them graphed against eager), auto included (it times the roles graphed)."""
    for linears in ("all", "auto"):
        config, _ = parse(*NO_DROPOUT, "--fp8-format", "hybrid", "--fp8-linears", linears)
        validate(config, 1)


def test_cuda_graph_allows_data_parallelism():
    """TP 2 x DP 2 graphed training equals eager (tests/gpu/test_gpu_cuda_graph.py)."""
    config, _ = parse(*NO_DROPOUT, "--tensor-model-parallel-size", "2",
                                          "--micro-batch-size", "2", "--global-batch-size", "8")
    validate(config, 4)


@pytest.mark.parametrize("plan", [
    ("--domino-batch-slices", "2", "--domino-hidden-slices", "1"),
    ("--domino-batch-slices", "3", "--domino-hidden-slices", "2", "--sequence-parallel"),
    ("--domino-explicit-backward",)])
def test_cuda_graph_captures_domino(plan):
    """Domino's schedule is captured in its capture mode (tests/gpu/test_gpu_cuda_graph_domino.py),
    also with the distributed optimizer."""
    config, _ = parse(*NO_DROPOUT, "--tensor-model-parallel-size", "2", *plan,
                      "--micro-batch-size", "4", "--global-batch-size", "16",
                      "--use-distributed-optimizer")
    assert config.parallel.enable_cuda_graph and config.parallel.domino.enabled
    validate(config, 4)


HPZ = ("--zero-stage", "3", "--zeropp-hpz-partition-size")


@pytest.mark.parametrize("argv, world, local, named", [
    ((*HPZ, "2", "--gpus-per-node", "1"), 2, None, "ranks per node \\(1: --gpus-per-node 1 /"),
    ((*HPZ, "2"), 4, 4, "ranks per node \\(4: --gpus-per-node 4 / tensor-parallel 1"),
    ((*HPZ, "4", "--tensor-model-parallel-size", "2", "--gpus-per-node", "4"), 8, None,
     "ranks per node \\(2: --gpus-per-node 4 / tensor-parallel 2"),
])
def test_hpz_partition_must_be_the_node(argv, world, local, named):
    config, _ = parse(*argv)
    with pytest.raises(ConfigError, match=f"--zeropp-hpz-partition-size={argv[3]} .*{named}"):
        validate(config, world, local)


@pytest.mark.parametrize("argv, world, local", [
    ((*HPZ, "2"), 4, 2),
    ((*HPZ, "2", "--gpus-per-node", "2"), 4, 4),
    ((*HPZ, "2", "--tensor-model-parallel-size", "2", "--gpus-per-node", "4"), 8, None),
    ((*HPZ, "1"), 4, 1),
])
def test_hpz_partition_of_a_node_is_accepted(argv, world, local):
    validate(parse(*argv)[0], world, local)


def test_sample_based_runs_refuse_iteration_schedules():
    with pytest.raises(ConfigError, match="--lr-warmup-iters does not apply to a run of "
                                          "--train-samples"):
        parse("--train-samples", "64", "--lr-warmup-iters", "2",
              base=["--model-preset", "gpt-tiny", "--mock-data"])


@pytest.mark.parametrize("argv, named", [
    (("--tensor-model-parallel-size", "3"), "--num-attention-heads=4 is invalid"),
    (("--hidden-size", "66"), "--hidden-size=66 is invalid"),
    (("--group-query-attention", "--num-query-groups", "3"), "--num-query-groups=3 is invalid"),
    (("--group-query-attention", "--tensor-model-parallel-size", "2"),
     "--num-query-groups=1 is invalid: it must be a multiple of --tensor-model-parallel-size"),
])
def test_shape_validation_names_the_flag(argv, named):
    with pytest.raises(ConfigError, match=named):
        parse(*argv)


@pytest.mark.parametrize("argv, world, named", [
    (("--tensor-model-parallel-size", "2"), 3, "world size 3 is not divisible"),
    (("--micro-batch-size", "4", "--global-batch-size", "10"), 2,
     "--global-batch-size=10 is invalid: .* = 8"),
    (("--tensor-model-parallel-size", "4", "--gpus-per-node", "2"), 8, "--gpus-per-node=2"),
])
def test_world_validation_names_the_flag(argv, world, named):
    config, _ = parse(*argv)
    with pytest.raises(ConfigError, match=named):
        validate(config, world)


def test_world_validation_accepts_a_good_layout():
    config, _ = parse("--tensor-model-parallel-size", "2",
                                          "--micro-batch-size", "2", "--global-batch-size", "8")
    validate(config, 4)


@pytest.mark.parametrize("marker, flags", [("flag-table", FLAGS),
                                           ("finetune-flag-table", FINETUNE_FLAGS)])
def test_docs_table_matches_code(marker, flags):
    text = (ROOT / "docs" / "flags.md").read_text()
    table = text.split(f"<!-- {marker}:begin -->\n")[1].split(f"<!-- {marker}:end -->")[0]
    assert table == render_flag_table(flags), f"regenerate the {marker} in docs/flags.md"


def test_flag_names_are_unique_and_help_renders():
    names = [flag.name for flag in FLAGS + FINETUNE_FLAGS]
    assert len(names) == len(set(names))
    help_text = build_parser("llama", finetune=True, show_all=True).format_help()
    assert all(name in help_text for name in names)


@pytest.mark.parametrize("script, family", [("pretrain_gpt.py", "gpt"),
                                            ("pretrain_llama.py", "llama")])
def test_documented_commands_are_valid(script, family):
    docstring = (ROOT / script).read_text().split('"""')[1]
    commands = re.findall(r"^    torchrun (.*?)(?:\n\n|\Z)", docstring, re.S | re.M)
    assert len(commands) == 3
    for command in commands:
        words = shlex.split(command.replace("\\\n", " "))
        launcher, argv = words[:words.index(script)], words[words.index(script) + 1:]
        nodes = int(launcher[launcher.index("--nnodes") + 1]) if "--nnodes" in launcher else 1
        world = nodes * int(launcher[launcher.index("--nproc_per_node") + 1])
        config, _ = parse_args(argv, family)
        validate(config, world)


def test_entry_script_exits_2_naming_a_bad_flag():
    result = subprocess.run([sys.executable, "pretrain_gpt.py", "--bogus-flag"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown flag --bogus-flag")


@pytest.mark.parametrize("given, missing", [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_half_of_torchruns_environment_is_one_line(given, missing):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, "pretrain_gpt.py", "--model-preset", "gpt-tiny",
                             "--mock-data", "--train-iters", "1"], cwd=ROOT,
                            env={**env, given: "0" if given == "RANK" else "1"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"error: the environment sets {given} but not {missing}: "
                                     "launch with torchrun (it sets both), or set both, or "
                                     "neither for one process"), result.stderr


def test_entry_script_reports_every_bad_flag_of_a_command_at_once():
    """A misspelt flag, a refused one and a value out of range: three `error:` lines, exit 2."""
    result = subprocess.run([sys.executable, "pretrain_gpt.py", "--model-preset", "gpt-tiny",
                             "--micro-batch-szie", "4", "--fp16-lm-cross-entropy",
                             "--lr-warmup-fraction", "1.5", "--mock-data", "--train-iters", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("error: unknown flag --micro-batch-szie") and \
        lines[0].endswith("did you mean --micro-batch-size?"), lines[0]
    assert lines[1].startswith("error: --lr-warmup-fraction=1.5 is invalid"), lines[1]
    assert lines[2].startswith("error: --fp16-lm-cross-entropy is refused"), lines[2]


@pytest.mark.parametrize("virtual", [("--virtual-pipeline-model-parallel-size", "2"),
                                     ("--num-layers-per-virtual-pipeline-stage", "2")])
def test_virtual_stages_imply_the_interleaved_schedule(virtual):
    """As in Megatron-LM: virtual stages without --pipeline-schedule run interleaved; with
    another schedule named, that schedule is refused by name."""
    argv = ["--model-preset", "gpt-tiny", "--num-layers", "8", "--pipeline-model-parallel-size",
            "2", *virtual]
    config, _ = parse(*argv)
    assert config.parallel.pipeline_schedule == "interleaved"
    with pytest.raises(ConfigError, match="--pipeline-schedule=eager-1f1b is invalid"):
        parse(*argv, "--pipeline-schedule", "eager-1f1b")
    config, _ = parse("--model-preset", "gpt-tiny", "--num-layers", "8",
                      "--pipeline-model-parallel-size", "2",
                      "--num-layers-per-virtual-pipeline-stage", "4")
    assert config.parallel.pipeline_schedule == "1f1b"  # one chunk a stage: nothing to interleave


NUMERIC = [flag for flag in FLAGS + FINETUNE_FLAGS
           if flag.type in (int, float, _count) and flag.policy != REFUSED and not flag.choices]


def test_every_numeric_flag_declares_its_range():
    assert sorted(flag.name for flag in NUMERIC if flag.name not in RANGES) == []
    assert set(RANGES) <= {flag.name for flag in NUMERIC}, "a range for a flag that is not here"


def _outside(allowed) -> list[str]:
    """Values just outside a range: below it, at an excluded bound, above it, NaN for floats."""
    values = []
    if allowed.low is not None:
        values.append(allowed.low if not allowed.low_inclusive else allowed.low - 1)
    if allowed.high is not None:
        values.append(allowed.high if not allowed.high_inclusive else allowed.high + 1)
    return [f"{value:g}" if value != int(value) else str(int(value)) for value in values]


@pytest.mark.parametrize("flag", NUMERIC, ids=[flag.name for flag in NUMERIC])
def test_a_value_outside_a_flags_range_is_refused_naming_it(flag):
    """parse_args runs on every rank before any process group exists (launch.main)."""
    allowed = RANGES[flag.name]
    for value in _outside(allowed):
        if flag.type is int and float(value) != int(float(value)):
            continue
        with pytest.raises(ConfigError, match=f"^{flag.name}=.* is invalid: it must be "
                                              f"(an integer )?{re.escape(str(allowed))}$"):
            parse(f"{flag.name}={value}")


def test_the_cases_users_hit_are_refused_naming_the_flag():
    for argv, named in ((("--seq-length", "0"), "--seq-length=0 is invalid"),
                        (("--weight-decay=-0.1",), "--weight-decay=-0.1 is invalid"),
                        (("--adam-beta2", "1.5"), "--adam-beta2=1.5 is invalid"),
                        (("--lr", "1e39"), "--lr=1e+39 is invalid"),
                        (("--lr=-1e-3",), "--lr=-0.001 is invalid"),
                        (("--log-interval", "0"), "--log-interval=0 is invalid"),
                        (("--micro-batch-size", "0"), "--micro-batch-size=0 is invalid"),
                        (("--make-vocab-size-divisible-by", "0"),
                         "--make-vocab-size-divisible-by=0 is invalid"),
                        (("--ffn-hidden-size", "0"), "--ffn-hidden-size=0 is invalid"),
                        (("--kv-channels", "0"), "--kv-channels=0 is invalid"),
                        (("--init-method-std=-0.02",), "--init-method-std=-0.02 is invalid")):
        with pytest.raises(ConfigError, match=re.escape(named)):
            parse(*argv)


def test_an_unwritable_save_directory_is_refused_at_start(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="--save=.*a_file/ckpt is invalid: .*a_file is a file"):
        parse("--save", str(tmp_path / "a_file" / "ckpt"))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root can write anywhere: nothing to refuse then
        with pytest.raises(ConfigError, match="--save=.* is invalid: .*locked is not writable"):
            parse("--save", str(locked / "ckpt"))
    parse("--save", str(tmp_path / "new" / "ckpt"))  # creatable: fine


@pytest.mark.parametrize("argv", [("--local_rank=3",), ("--local_rank", "3"), ("--local-rank=3",)])
def test_the_deepspeed_launchers_local_rank_is_accepted(argv):
    """The deepspeed launcher appends --local_rank=N to every rank's command line."""
    _, notices = parse(*argv)
    assert [notice.split(":")[0] for notice in notices] == ["--local-rank"]


def test_the_node_size_comes_from_torchrun_or_the_deepspeed_launcher(monkeypatch):
    from megadomino.cli.launch import _local_world_size

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert _local_world_size(8) == 8
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the deepspeed launcher's name
    assert _local_world_size(8) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's wins where both are set
    assert _local_world_size(8) == 2


def test_zero_stage_0_is_plain_data_parallelism_and_2_is_refused_with_its_reason():
    assert field(parse("--zero-stage", "0"), "parallel.zero.stage") == 0
    assert field(parse(), "parallel.zero.stage") == 0
    assert field(parse("--zero-stage", "0"), "parallel.zero.stage") == field(parse(),
                                                                          "parallel.zero.stage")
    with pytest.raises(ConfigError, match="--zero-stage=2 is refused: ZeRO stage 2 .* use 1 or 3"):
        parse("--zero-stage", "2")


def test_one_default_per_field_from_python_and_the_cli():
    """Every field the flags leave alone has the dataclass's default: a run configured from
    Python and one from the command line differ only in what was given (Megatron-LM's defaults,
    e.g. linear LR decay, on both sides)."""
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128,
                 max_position_embeddings=128, vocab_size=512)
    argv = [item for name, value in shape.items()
            for item in (f"--{name.replace('_', '-')}", str(value))]
    config, _ = parse_args([*argv, "--train-iters", "10", "--mock-data"], "gpt")
    assert config == make_config(ModelConfig(**shape), train_iters=10, mock_data=True)
    assert TrainConfig().schedule.lr_decay_style == "linear"
