"""Rows for the flags Megatron-LM makes from its config dataclasses.

megatron/training/arguments.py hands TransformerConfig (with ModelParallelConfig), and
megatron/training/config's TrainingConfig, ValidationConfig, SchedulerConfig, LoggerConfig,
CheckpointConfig, TokenizerConfig, ProfilingConfig, RNGConfig, DistributedInitConfig,
RerunStateMachineConfig, StragglerDetectionConfig and FaultInjectorConfig to its
ArgumentGroupFactory, which makes a flag of each field; argparse's BooleanOptionalAction adds the
`--no-X` of a few of its `add_argument` flags. Those flags megadomino implements are rows of
flags.py; the rest are here, under the rules of flags_megatron.py: a refusal names the missing
feature that would change results, a notice covers a flag that only tunes performance, logging or
memory, or that is read only by a refused feature. `--disable-X` is Megatron-LM's second spelling
of each store_false field's `--no-X`.
"""

from __future__ import annotations

from megadomino.cli.flag_row import (
    NOTICE,
    REFUSED,
    Flag,
    alias,
    notice,
    notices,
    refuse,
    value,
)

# Shared with flags_megatron.py's rows, so that given together their notices make one line.
from megadomino.cli.flags_megatron import (
    _FSDP,
    _INFERENCE,
    _RL,
    MOE,
    PIPELINE,
    ROPE,
)

_PIPELINE_COMM = ("the pipeline's transfers are asynchronous isend / irecv that the schedule "
                  "posts and waits: there is no such option of them to tune")
_CONTEXT_PARALLEL = "read only with --context-parallel-size above 1, which is refused"
_TE = ("Transformer Engine is not used: megadomino's layers are its own (torch GEMMs, "
       "torch._scaled_mm for FP8, SDPA attention)")
_TE_TP_OVERLAP = ("Transformer Engine userbuffer overlap option: --tp-comm-overlap fuses the "
                  "all-gather / reduce-scatter into the GEMMs with torch symmetric memory")
_COMM = "communicator tuning: process groups are created with NCCL's defaults"
_DIST_CKPT = ("tuning of megatron-core's distributed-checkpoint machinery: torch_dist checkpoints "
              "are read and written here with torch.distributed.checkpoint alone")
_ASYNC_SAVE = ("tunes Megatron-LM's asynchronous save workers: --async-save here writes each "
               "checkpoint from a CPU snapshot in one background thread")
_NON_PERSISTENT = ("non-persistent (local, in-memory or replicated) checkpoints are not "
                   "implemented: --save writes every checkpoint to its directory")
_FROM_CHECKPOINT_ARGS = "read only with --use-checkpoint-args, which is refused"
_ACTIVATION_OFFLOAD = ("activations are not offloaded to the CPU (offloading only saves GPU "
                       "memory)")
_CUDA_GRAPH_IMPL = ("use --enable-cuda-graph, which captures the transformer layers' forward and "
                    "backward")
_NOT_LOGGED = ("not logged here: every log line has loss, lr, grad norm, loss scale, throughput, "
               "memory and per-phase times")
_TIMERS = "Megatron-LM timer option: the times on every log line come from megadomino's timers"
_PROFILER = ("profiler detail: --use-pytorch-profiler records CPU and CUDA activities only, and "
             "no NVTX ranges or memory history are recorded")
_DUMPS = "tensors are not dumped for debugging"
_RERUN = ("Megatron-LM's re-run engine (re-running a step to check its result) is not "
          "implemented; a NaN loss stops the run")
_STRAGGLER = "straggler detection is not implemented; per-phase times are on every log line"
_FLIGHT_RECORDER = ("the NCCL flight recorder is not configured from flags (torch reads its "
                    "TORCH_NCCL_* variables)")
_FAULT_INJECTION = "fault injection (nvidia-resiliency-ext) is not implemented"
_WANDB = ("nothing is sent to Weights & Biases (not implemented): every scalar is on the log "
          "lines, and with --tensorboard-dir in TensorBoard")
_TOKENIZER = "tokenizer options are not implemented: each tokenizer runs with its defaults"
_MTP = "multi-token prediction (MTP) is not implemented"
_MAMBA = "hybrid Mamba models are not implemented"
_LINEAR_ATTENTION = "linear attention layers are not implemented"
_DSA = "DeepSeek sparse attention (DSA) is not implemented"
_MHC = "manifold-constrained hyper-connections (mHC) are not implemented"
_MUP = "maximal update parametrization (muP) is not implemented"
_GTP = "generalized tensor parallelism (sharded, rematerialized weights) is not implemented"
_FP4 = "FP4 training is not implemented"
_BATCH_INVARIANT = "batch-invariant kernels are not implemented"
_VALIDATION = ("evaluation runs --eval-iters batches of the training batch size on the one "
               "validation split: other evaluation schedules and sets are not implemented")
_WEIGHT_DECAY_SCHEDULE = "weight-decay schedules are not implemented: --weight-decay is constant"
_PAD_VOCAB = ("the vocabulary is always padded to a multiple of --make-vocab-size-divisible-by x "
              "TP; an exact model vocabulary is not implemented")

_NO_DISABLE_PAIRS = (
    "--no-align-grad-reduce", "--no-ckpt-load-validate-sharding-integrity",
    "--no-clone-scatter-output-in-embedding", "--no-dsa-indexer-rotate-activation",
    "--no-dsa-indexer-scoring-relu", "--no-flight-recorder-dump-on-timeout",
    "--no-flight-recorder-extra-dump-on-exec", "--no-flight-recorder-include-only-active",
    "--no-fp8-wgrad", "--no-log-loss-scale-to-tensorboard", "--no-pad-vocab-size",
    "--no-save-tokenizer-assets", "--no-strict-fsdp-dtensor-load",
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces", "--no-tp-comm-bulk-dgrad",
    "--no-tp-comm-bulk-wgrad", "--no-tp-comm-overlap-ag", "--no-tp-comm-overlap-rs",
    "--no-tp-comm-split-ag", "--no-tp-comm-split-rs",
    "--no-use-tokenizer-model-from-checkpoint-args")
"""store_false fields: Megatron-LM spells each `--no-X` and `--disable-X`."""

MEGATRON_CONFIG_ROWS: tuple[Flag, ...] = (
    # Second spellings.
    *[alias("--disable-" + name[len("--no-"):], name, f"Megatron-LM's second spelling of {name}.")
      for name in _NO_DISABLE_PAIRS],
    alias("--persistent-save-interval", "--save-interval",
          "Megatron-LM's second spelling of --save-interval."),
    # Parallelism and its communication.
    *refuse(("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
             "--microbatch-group-size-per-virtual-pipeline-stage"), PIPELINE),
    *notices(("--overlap-p2p-communication-warmup-flush", "--use-ring-exchange-p2p",
              "--defer-embedding-wgrad-compute", "--no-align-grad-reduce"), _PIPELINE_COMM),
    *notices(("--pipeline-model-parallel-comm-backend", "--wgrad-deferral-limit"),
             _PIPELINE_COMM, value),
    *refuse(("--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank"),
            "context parallelism is not implemented"),
    Flag("--hierarchical-context-parallel-sizes", NOTICE, _CONTEXT_PARALLEL, type=value,
         nargs="+"),
    *refuse(("--tensor-parallel-num-weight-shards",
             "--expert-tensor-parallel-num-weight-shards", "--gtp-remat-opt-in-modules"), _GTP),
    *notices(("--no-tp-comm-bulk-dgrad", "--no-tp-comm-bulk-wgrad", "--no-tp-comm-overlap-ag",
              "--no-tp-comm-overlap-rs", "--no-tp-comm-split-ag", "--no-tp-comm-split-rs",
              "--tp-comm-overlap-rs-dgrad"), _TE_TP_OVERLAP),
    notice("--tp-comm-bootstrap-backend", _TE_TP_OVERLAP, value),
    notice("--use-sharp", _COMM),
    notice("--disable-gloo-process-groups", "no Gloo process groups are created beside the NCCL "
           "ones"),
    notice("--sharp-enabled-group", _COMM, value),
    notice("--use-tp-pp-dp-mapping", "at pipeline size 1 both rank orders are the same: "
           "tensor-parallel ranks adjacent, then data-parallel"),
    notice("--distributed-timeout-seconds-after-init",
           "--distributed-timeout-minutes holds for the whole run", value),
    *refuse(("--lazy-mpu-init",),
            "handing the process groups' set-up to an external manager is not implemented"),
    # Model features that would change results.
    *refuse(("--fp32-residual-connection",),
            "fp32 residuals are not implemented: the residual stream has the parameters' dtype"),
    *refuse(("--attention-output-gate",), "gated attention outputs are not implemented"),
    *refuse(("--qk-l2-norm",), "QK normalization is not implemented"),
    *refuse(("--qk-clip", "--qk-clip-alpha", "--qk-clip-threshold"),
            "QK-clip (rescaling query and key weights by the max attention logit) is not "
            "implemented"),
    Flag("--softmax-type", REFUSED, "off-by-one and learnable softmax offsets are not "
         "implemented", type=str, supported=("vanilla",)),
    Flag("--glu-linear-offset", REFUSED, "an offset in the gated linear unit is not implemented",
         type=float, supported=(0.0,)),
    *refuse(("--activation-func-clamp-value",), "clamping the MLP activation is not implemented"),
    *refuse(("--mrope-section",), ROPE),
    *refuse(("--experimental-attention-variant",),
            "attention variants (gated delta net, DSA) are not implemented"),
    *refuse(("--dsa-indexer-head-dim", "--dsa-indexer-k-norm-epsilon", "--dsa-indexer-k-norm-fp32",
             "--dsa-indexer-loss-coeff", "--dsa-indexer-n-heads", "--dsa-indexer-rope-interleaved",
             "--dsa-indexer-skip-topk-offset", "--dsa-indexer-topk", "--dsa-indexer-topk-freq",
             "--dsa-indexer-use-sparse-loss", "--dsa-kernel-backend",
             "--no-dsa-indexer-rotate-activation", "--no-dsa-indexer-scoring-relu"), _DSA),
    *refuse(("--linear-conv-kernel-dim", "--linear-key-head-dim", "--linear-num-key-heads",
             "--linear-num-value-heads", "--linear-value-head-dim", "--gdp-cutedsl-kernel",
             "--gdp-num-chunk-states-to-recompute", "--gdp-num-householder"), _LINEAR_ATTENTION),
    *refuse(("--is-hybrid-model", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads",
             "--mamba-state-dim", "--disable-mamba-mem-eff-path"), _MAMBA),
    *refuse(("--enable-mhc-connections", "--mhc-init-gating-factor", "--mhc-num-residual-streams",
             "--mhc-recompute-layer-num", "--mhc-sinkhorn-iterations"), _MHC),
    *refuse(("--mtp-detach-heads", "--mtp-hsm", "--mtp-hybrid-override-pattern",
             "--mtp-loss-scaling-factor", "--mtp-num-layers", "--mtp-standalone",
             "--mtp-use-repeated-layer"), _MTP),
    *refuse(("--use-mup", "--mup-attn-scale-power", "--mup-base-head-dim",
             "--mup-base-hidden-size", "--mup-embedding-mult", "--mup-output-mult",
             "--mup-width-mult"), _MUP),
    *refuse(("--moe-apply-probs-on-input", "--moe-combine-bwd-dtype", "--moe-deepep-num-sms",
             "--moe-dispatch-fwd-dtype", "--moe-enable-deepep", "--moe-enable-routing-replay",
             "--moe-expert-capacity-factor", "--moe-expert-rank-capacity-factor",
             "--moe-flex-dispatcher-backend", "--moe-flex-dispatcher-num-sms",
             "--moe-hybridep-num-blocks-permute", "--moe-hybridep-num-blocks-unpermute",
             "--moe-hybridep-num-sms", "--moe-hybridep-num-sms-preprocessing",
             "--moe-hybridep-pad-uneven-dispatch-inputs", "--moe-input-jitter-eps",
             "--moe-latent-size", "--moe-layer-recompute", "--moe-mlp-glu-interleave-size",
             "--moe-ncclep-zero-copy", "--moe-pad-expert-input-to-capacity",
             "--moe-pad-experts-for-cuda-graph-inference", "--moe-paged-stash",
             "--moe-paged-stash-buffer-size-factor-cpu",
             "--moe-paged-stash-buffer-size-factor-cuda", "--moe-paged-stash-page-size",
             "--moe-per-layer-logging", "--moe-permute-fusion",
             "--moe-permute-fusion-into-hybridep",
             "--moe-router-bias-update-rate", "--moe-router-dtype",
             "--moe-router-enable-expert-bias", "--moe-router-force-biased",
             "--moe-router-force-load-balancing", "--moe-router-fusion", "--moe-router-group-topk",
             "--moe-router-num-groups", "--moe-router-padding-for-fp8",
             "--moe-router-padding-for-quantization", "--moe-router-pre-softmax",
             "--moe-router-quantile-balancing-ema", "--moe-router-score-function",
             "--moe-router-topk-scaling-factor", "--moe-routing-trace-capture-hidden-states",
             "--moe-routing-trace-capture-logits", "--moe-routing-trace-dump-weights",
             "--moe-routing-trace-max-training-iters", "--moe-routing-trace-path",
             "--moe-shared-expert-gate", "--moe-shared-expert-glu-interleave-size",
             "--moe-shared-expert-intermediate-size", "--moe-shared-expert-overlap",
             "--moe-single-grouped-bias", "--moe-single-grouped-weight", "--moe-token-drop-policy",
             "--moe-use-grouped-tensor", "--moe-z-loss-coeff",
             "--use-fused-weighted-squared-relu", "--use-grouped-gemm-for-shared-expert",
             "--overlap-moe-expert-parallel-comm", "--overlap-dispatch-backward-with-experts-wgrad",
             "--ep-overlap-early-attn-memory-release", "--high-priority-a2a-comm-stream"), MOE),
    # Precision.
    *refuse(("--no-fp8-wgrad",), "under --fp8-format the weight-gradient GEMMs run in FP8 like "
            "the others: a high-precision wgrad is not implemented"),
    *refuse(("--fp8-output-proj",), "the output layer stays in high precision: FP8 covers the "
            "transformer layers' linears"),
    *refuse(("--fp8-quantizer-factory",), "custom FP8 recipes are not implemented"),
    *refuse(("--fp4-format", "--fp4-recipe", "--fp4-quantizer-factory"), _FP4),
    *refuse(("--use-kitchen-attention", "--kitchen-attention-backend"),
            "Kitchen's quantized attention is not implemented"),
    *refuse(("--disable-bf16-reduced-precision-matmul",),
            "bf16 GEMMs use torch's default accumulation (reduced-precision reductions allowed); "
            "choosing it is not implemented"),
    *refuse(("--deterministic-mode",),
            "a deterministic-kernels mode is not implemented: torch picks its default kernels"),
    *refuse(("--batch-invariant-mode", "--batch-invariant-backend"), _BATCH_INVARIANT),
    notice("--apply-query-key-layer-scaling", "Megatron-LM undoes this scaling inside its fp16 "
           "softmax (the same function, an overflow guard); SDPA accumulates the softmax in fp32"),
    # Kernels, Transformer Engine and memory: notices.
    *notices(("--use-te-activation-func", "--use-transformer-engine-op-fuser",
              "--use-grouped-gemm-for-dense-mlp", "--fused-residual-rmsnorm", "--te-rng-tracker"),
             _TE),
    *notices(("--cross-entropy-fusion-impl", "--symmetric-ar-type"), _TE, value),
    notice("--flash-attention-version",
           "attention always runs through torch SDPA, which picks its flash-attention kernel",
           value),
    notice("--disable-jit-fuser", "no TorchScript-fused kernels are used here, so nothing to "
           "disable"),
    notice("--delay-wgrad-compute", "weight-gradient GEMMs run where autograd puts them "
           "(--domino-explicit-backward runs them behind the input-gradient all-reduce)"),
    notice("--mlp-chunks-for-training", "the MLP runs on the whole sequence (chunking it only "
           "saves memory)", value),
    notice("--no-clone-scatter-output-in-embedding",
           "a memory knob of Megatron-LM's embedding, which megadomino's does not share"),
    *notices(("--fine-grained-activation-offloading", "--cpu-offloading-retain-pinned-cpu-buffers",
              "--delay-offload-until-cuda-graph"), _ACTIVATION_OFFLOAD),
    *notices(("--cpu-offloading-num-layers", "--fine-grained-offloading-max-inflight-offloads",
              "--activation-offload-fraction", "--delta-offload-bytes-across-pp-ranks",
              "--min-offloaded-tensor-size"), _ACTIVATION_OFFLOAD, value),
    Flag("--offload-modules", NOTICE, _ACTIVATION_OFFLOAD, type=value, nargs="+"),
    *refuse(("--recompute-modules",),
            "--recompute-granularity selective recomputes the attention core (Megatron-LM's "
            "core_attn); choosing other modules is not implemented"),
    Flag("--cuda-graph-impl", REFUSED, _CUDA_GRAPH_IMPL, type=str, supported=("none",)),
    *refuse(("--external-cuda-graph",), _CUDA_GRAPH_IMPL),
    notice("--cuda-graph-warmup-steps",
           "--enable-cuda-graph captures after its own warm-up iterations", value),
    notice("--use-cpu-initialization", "weights are always drawn whole and then sharded, so "
           "initialization is the same at every TP degree (as CPU initialization is in "
           "Megatron-LM)"),
    notice("--no-initialization", "weights are always initialized, and --load overwrites them "
           "(skipping it only saves start-up time)"),
    *refuse(("--data-parallel-random-init",),
            "data-parallel replicas always start from the same weights"),
    notice("--init-model-with-meta-device", _FSDP),
    notice("--no-strict-fsdp-dtensor-load", _FSDP),
    # Inference only.
    *notices(("--flash-decode", "--inference-disable-triton-nvls-kernels",
              "--inference-fuse-tp-communication", "--inference-moe-disable-fused-quant-kernels",
              "--inference-rng-tracker", "--nccl-all-reduce-for-prefill",
              "--no-inference-disable-ep-consensus",
              "--no-inference-dynamic-batching-prefix-caching",
              "--no-inference-text-gen-server-logging",
              "--no-inference-use-synchronous-zmq-collectives", "--no-inference-wandb-logging"),
             _INFERENCE),
    *notices(("--inference-cuda-graph-scope", "--inference-grouped-gemm-backend",
              "--inference-moe-token-dispatcher-type", "--mlp-chunks-for-prefill"),
             _INFERENCE, value),
    *refuse(("--no-rl-inference-logprobs-is-correction",
             "--no-rl-offload-inference-model-weights-when-idle", "--no-rl-partial-rollouts",
             "--no-rl-persist-cuda-graphs", "--no-rl-skip-bos-token",
             "--no-rl-training-cuda-graphs",
             "--no-rl-use-sequence-packing", "--no-rl-verify-model-weights-swap"), _RL),
    # Training loop, evaluation and schedules.
    *refuse(("--decrease-batch-size-if-needed",),
            "the global batch is fixed: it must be a multiple of micro x DP"),
    *refuse(("--iterations-to-skip",), "skipping iterations is not implemented"),
    *refuse(("--skip-train",), "evaluation-only runs are not implemented"),
    *refuse(("--eval-micro-batch-size", "--eval-global-batch-size", "--full-validation",
             "--multiple-validation-sets", "--validation-set-names", "--start-eval-at-iter"),
            _VALIDATION),
    Flag("--lr-warmup-init", REFUSED, "warmup always starts from lr 0, as Megatron-LM's default",
         type=float, supported=(0.0,)),
    Flag("--weight-decay-incr-style", REFUSED, _WEIGHT_DECAY_SCHEDULE, type=str,
         supported=("constant",)),
    *refuse(("--start-weight-decay", "--end-weight-decay"), _WEIGHT_DECAY_SCHEDULE),
    notice("--override-opt-param-scheduler", "the LR schedule always comes from the flags; a "
           "checkpoint gives only its position"),
    alias("--override-opt_param-scheduler", "--override-opt-param-scheduler",
          "Megatron-LM's older spelling of --override-opt-param-scheduler."),
    *refuse(("--use-checkpoint-opt-param-scheduler",),
            "the LR schedule comes from the flags, never from the checkpoint"),
    alias("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
          "Megatron-LM's older spelling of --use-checkpoint-opt-param-scheduler."),
    Flag("--exit-signal", REFUSED, "--exit-signal-handler catches SIGTERM only", type=str,
         supported=("SIGTERM",)),
    notice("--exit-signal-handler-for-training", "a signal ends the run as it would without this "
           "flag; --exit-signal-handler saves first and exits 0"),
    notice("--exit-signal-handler-for-dataloader",
           "samples are read in-process: there are no loader workers to signal"),
    notice("--train-sync-interval", "the host is not held back to the GPU on an interval (a "
           "performance knob)", value),
    *notices(("--check-weight-hash-across-dp-replicas-interval", "--gpu-sniff-test-interval"),
             "no such health check runs; the gradient norm and times are on every log line",
             value),
    notice("--test-mode", "Megatron-LM's real-time tests are not run (they check, they change "
           "nothing)"),
    # Rerun engine, stragglers, faults.
    *notices(("--check-for-spiky-loss",), _RERUN),
    *notices(("--rerun-mode", "--error-injection-type"), _RERUN, value),
    Flag("--error-injection-rate", REFUSED, "injecting wrong results is not implemented",
         type=int, supported=(0,)),
    *notices(("--log-straggler", "--disable-straggler-on-startup"), _STRAGGLER),
    *notices(("--straggler-ctrlr-port", "--straggler-minmax-count"), _STRAGGLER, value),
    *refuse(("--fault-injector-delay-start-iteration", "--fault-injector-fault-delay",
             "--fault-injector-fault-probabilities", "--fault-injector-fault-types",
             "--fault-injector-mtti-seconds", "--fault-injector-num-ranks",
             "--fault-injector-offset-seconds", "--fault-injector-ranks", "--fault-injector-seed"),
            _FAULT_INJECTION),
    *notices(("--flight-recorder-include-stack-trace", "--no-flight-recorder-dump-on-timeout",
              "--no-flight-recorder-extra-dump-on-exec",
              "--no-flight-recorder-include-only-active"), _FLIGHT_RECORDER),
    *notices(("--flight-recorder-dump-path", "--flight-recorder-trace-buffer-size"),
             _FLIGHT_RECORDER, value),
    # Logging and profiling: notices.
    *notices(("--log-device-memory-used", "--log-energy", "--log-max-attention-logit",
              "--log-progress", "--log-world-size-to-tensorboard"), _NOT_LOGGED),
    *notices(("--log-memory-interval", "--logging-level", "--tensorboard-queue-size",
              "--config-logger-dir"), _NOT_LOGGED, value),
    notice("--no-barrier-with-level-1-timing", _TIMERS),
    notice("--timing-log-option", _TIMERS, value),
    *notices(("--pytorch-profiler-collect-callstack", "--pytorch-profiler-collect-chakra",
              "--pytorch-profiler-collect-shapes", "--record-shapes", "--nvtx-ranges",
              "--record-memory-history"), _PROFILER),
    notice("--memory-snapshot-path", _PROFILER, value),
    *notices(("--save-params-interval", "--save-activations-interval", "--save-dgrads-interval",
              "--save-wgrads-interval", "--save-tokens-per-expert-interval"), _DUMPS, value),
    *notices(("--wandb-project", "--wandb-entity", "--wandb-exp-name", "--wandb-save-dir"),
             _WANDB, value),
    # Checkpoints.
    *notices(("--ckpt-assume-constant-structure", "--ckpt-fully-parallel-load",
              "--ckpt-fully-parallel-load-per-rank-objects", "--ckpt-pg-tensors-cache-create",
              "--dist-ckpt-optim-fully-reshardable", "--dist-ckpt-save-pre-mcore-014",
              "--distrib-optim-fully-reshardable-mem-efficient", "--no-ckpt-fully-parallel-save",
              "--no-ckpt-load-validate-sharding-integrity"), _DIST_CKPT),
    *notices(("--ckpt-fully-parallel-load-exchange-algo",
              "--ckpt-fully-parallel-load-process-group",
              "--ckpt-fully-parallel-save-process-group", "--ckpt-pg-tensors-cache-path"),
             _DIST_CKPT, value),
    notice("--dist-ckpt-strictness", "--load of a Megatron-LM checkpoint is always strict on the "
           "model's tensors: each must be there with its shape, and none may be left unused",
           value),
    *notices(("--async-ckpt-use-cpu-shm", "--use-persistent-ckpt-worker"), _ASYNC_SAVE),
    *notices(("--async-ckpt-cpu-priority", "--async-ckpt-io-priority", "--async-strategy"),
             _ASYNC_SAVE, value),
    *refuse(("--non-persistent-ckpt-type", "--non-persistent-global-ckpt-dir",
             "--non-persistent-local-ckpt-algo", "--non-persistent-local-ckpt-dir",
             "--non-persistent-save-interval", "--replication", "--replication-factor",
             "--replication-jump"), _NON_PERSISTENT),
    *refuse(("--save-retain-interval",),
            "deleting older checkpoints is not implemented: every saved checkpoint is kept"),
    *refuse(("--ckpt-step",),
            "--load always resumes the iteration that latest_checkpointed_iteration.txt names"),
    *refuse(("--ckpt-convert-format", "--ckpt-convert-save"),
            "checkpoint conversion is not implemented"),
    *refuse(("--ckpt-convert-update-legacy-dist-opt-format",),
            "Megatron-LM's distributed-optimizer checkpoints are not read: optimizer states load "
            "from megadomino's own files"),
    notice("--auto-detect-ckpt-format", "--load always detects the format from the files: "
           "ours, Megatron-LM's torch_dist or its legacy torch"),
    notice("--load-main-params-from-ckpt",
           "the fp32 master weights are always built from the loaded weights"),
    notice("--verify-integrity", "every checkpoint file's size and CRC-32 are written to "
           "manifest.json and checked at every load"),
    notice("--no-save-tokenizer-assets", "tokenizer files are never copied into checkpoints"),
    *notices(("--use-mp-args-from-checkpoint-args",
              "--no-use-tokenizer-model-from-checkpoint-args"), _FROM_CHECKPOINT_ARGS),
    # Tokenizer and vocabulary.
    *refuse(("--padded-vocab-size", "--no-pad-vocab-size"), _PAD_VOCAB),
    Flag("--vocab-extra-ids", REFUSED, "extra vocabulary ids (T5's span masks) are not "
         "implemented", type=int, supported=(0,)),
    *refuse(("--null-tokenizer-eod-id",),
            "NullTokenizer's end-of-document id is --vocab-size; choosing it is not implemented"),
    Flag("--null-tokenizer-pad-id", REFUSED, "NullTokenizer has no pad token here (Megatron-LM's "
         "default, -1)", type=int, supported=(-1,)),
    *refuse(("--tokenizer-hf-no-use-fast", "--tokenizer-hf-no-include-special-tokens",
             "--tokenizer-sentencepiece-legacy",
             "--no-tokenizer-sentencepiece-ignore-extra-whitespaces", "--tokenizer-metadata",
             "--tokenizer-special-tokens"), _TOKENIZER),
    *refuse(("--chat-template",), "chat templates are not implemented: finetune_llama.py lays "
            "prompts out with --prompt-template"),
    *refuse(("--trust-remote-code",),
            "Hugging Face tokenizers are loaded from local files, never running remote code"),
    notice("--tiktoken-num-special-tokens",
           "read only by the tiktoken tokenizer, which is not implemented", value),
    notice("--use-gigatoken", "tokenizing speed: megadomino's tokenizers have one implementation "
           "each"),
)
