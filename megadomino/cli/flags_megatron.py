"""The rest of Megatron-LM's command line: its flags for features beside GPT/Llama pretraining,
its tuning knobs, its old names and the forks' names (DeepSpeed-Domino, Megatron-DeepSpeed,
ROCm/Megatron-LM).

Each group shares one reason. Refusals name the missing feature that would change results;
notices cover flags that only tune performance, logging or memory, or that are read only by a
feature refused elsewhere (so that, as in Megatron-LM, they change nothing here). tests/
megatron_flags/ holds the names these rows must cover; tests/test_flag_coverage.py checks it.
"""

from __future__ import annotations

from megadomino.cli.flag_row import (
    NOTICE,
    REFUSED,
    Flag,
    alias,
    impl,
    notice,
    notices,
    refuse,
    value,
)

MOE = "Mixture-of-Experts is not implemented"
PIPELINE = ("this pipeline-parallel option is not implemented (the pipeline takes "
            "--pipeline-model-parallel-size, virtual stages and "
            "--decoder-first/last-pipeline-num-layers)")
ROPE = "only plain, unscaled RoPE is implemented"
MLA = "multi-latent attention is not implemented"
_DDP = ("data-parallel communication tuning: megadomino reduces gradients in its own fp32 buckets "
        "(all-reduce, or ZeRO's reduce-scatter)")
_LOADER = "data-loading speed: samples are read in-process from memory-mapped .bin/.idx files"
_INFERENCE = "read only by Megatron-LM's inference engine; training does not use it"
_OFFLOAD = "the optimizer is not offloaded to the CPU (offload only saves GPU memory)"
_FSDP = ("read only with Megatron FSDP (--use-megatron-fsdp, refused; --zero-stage 3 shards "
         "parameters here)")
_FAULTS = "fault tolerance: a failed rank ends the run (resume with --load)"
_TRACING = "external run telemetry is not sent; progress and times are on every log line"
_OPTIMIZER = "read only by an --optimizer megadomino refuses (Lion, Muon)"
_VISION = "vision models (ViT, Swin, DINO, inpainting) are not implemented"
_RETRIEVAL = "retrieval models (ICT, biencoder, REALM) are not implemented"
_BERT = "BERT and T5 masked-LM models and data are not implemented"
_RL = "reinforcement learning (GRPO rollouts) is not implemented"
_OLD = "Megatron-LM removed this flag and refuses it"
_DEEPSPEED_AC = ("DeepSpeed activation-checkpointing option: recompute is chosen by "
                 "--recompute-granularity / --recompute-method, and memory is not partitioned")
_DEEPSPEED_ZERO = ("DeepSpeed ZeRO tuning: ZeRO here is --zero-stage (stage 1 or 3), with its own "
                   "buckets")

MEGATRON_ROWS: tuple[Flag, ...] = (
    # Old Megatron-LM spellings and launcher conventions.
    alias("--local_rank", "--local-rank",
          "The deepspeed launcher (and torch.distributed.launch) appends --local_rank=N."),
    notice("--DDP-impl", "data parallelism is megadomino's own bucketed all-reduce", value),
    notice("--use-contiguous-buffers-in-local-ddp",
           "gradients always live in contiguous fp32 buffers"),
    notice("--no-scatter-gather-tensors-in-pipeline",
           "activations go whole from each TP rank to its peer in the next stage"),
    Flag("--batch-size", REFUSED, f"{_OLD}: use --micro-batch-size"),
    Flag("--warmup", REFUSED, f"{_OLD}: use --lr-warmup-iters or --lr-warmup-fraction"),
    Flag("--model-parallel-size", REFUSED, f"{_OLD}: use --tensor-model-parallel-size"),
    Flag("--checkpoint-activations", REFUSED, f"{_OLD}: use --recompute-activations, or "
         "--recompute-granularity and --recompute-method"),
    Flag("--checkpoint-num-layers", REFUSED, f"{_OLD}: use --recompute-granularity full "
         "--recompute-method uniform --recompute-num-layers N"),
    # DeepSpeed-Domino and Megatron-DeepSpeed.
    notice("--deepspeed", "megadomino is its own engine (ZeRO is --zero-stage); with "
           "--deepspeed_config its JSON is read, as Megatron-DeepSpeed reads it only under "
           "--deepspeed"),
    impl("--deepspeed_config", None, str,
         "A DeepSpeed JSON config, read with --deepspeed as Megatron-DeepSpeed's run uses it: "
         "its batch, precision, loss scaling, clipping, optimizer and ZeRO keys set their flags' "
         "fields; where the JSON and a flag differ, the side Megatron-DeepSpeed uses wins, with "
         "a notice (docs/deepspeed_config.md lists every key).", group="deepspeed"),
    alias("--deepspeed-config", "--deepspeed_config", "The dashed spelling some scripts use."),
    impl("--llama-model", None, None,
         "DeepSpeed-Domino's switch to a Llama model: accepted by pretrain_llama.py, which builds "
         "one; pretrain_gpt.py refuses it (use pretrain_llama.py).", group="model"),
    notice("--causal-lm", "every model here is a causal language model"),
    impl("--num-key-value-heads", "model.num_query_groups", int,
         "Megatron-DeepSpeed's name for --num-query-groups; implies --group-query-attention."),
    notice("--no-pipeline-parallel",
           "--pipeline-model-parallel-size 1 (the default) runs without the pipeline engine"),
    *notices(("--deepspeed-activation-checkpointing", "--partition-activations",
              "--contigious-checkpointing", "--checkpoint-in-cpu", "--synchronize-each-layer",
              "--profile-backward"), _DEEPSPEED_AC),
    *notices(("--zero-reduce-scatter", "--zero-contigious-gradients"), _DEEPSPEED_ZERO),
    *notices(("--zero-reduce-bucket-size", "--zero-allgather-bucket-size"), _DEEPSPEED_ZERO,
             value),
    notice("--remote-device", "ZeRO-Infinity offload is not implemented (it only saves GPU "
           "memory)", value),
    notice("--use-pin-memory", "ZeRO-Infinity offload is not implemented (it only saves GPU "
           "memory)"),
    *notices(("--cpu-optimizer", "--cpu-torch-adam"), _OFFLOAD),
    Flag("--ds-sequence-parallel-size", REFUSED,
         "DeepSpeed-Ulysses sequence parallelism is not implemented", type=int, supported=(1,)),
    *notices(("--use-flash-attn-v2", "--use-flash-attn-triton"),
             "attention always runs through torch SDPA, which picks flash attention where it can"),
    # ROCm/Megatron-LM.
    notice("--fused-single-qkv-rope", "RoPE is applied to q and k in torch ops (no fused "
           "QKV-and-RoPE kernel), with the same result"),
    # Tuning that leaves results alone: notices.
    *notices(("--ddp-average-in-collective", "--ddp-pad-buckets-for-high-nccl-busbw",
              "--ddp-reduce-scatter-with-fp32-accumulation", "--no-gradient-reduce-div-fusion",
              "--create-all-gather-group", "--use-nccl-ub", "--disable-symmetric-registration",
              "--no-align-param-gather", "--overlap-param-gather-with-optimizer-step",
              "--gtp-remat-nccl-ub", "--gtp-expert-remat-nccl-ub",
              "--gtp-remat-reduce-scatter-with-fp32-accumulation",
              "--no-use-layer-wise-param-layout"), _DDP),
    *notices(("--ddp-num-buckets", "--suggested-communication-unit-size",
              "--num-distributed-optimizer-instances"), _DDP, value),
    Flag("--ddp-param-name-patterns-for-fp32-local-accumulation", NOTICE,
         "gradients of every parameter already accumulate in fp32", type=value, nargs="+"),
    *notices(("--dataloader-defer-npy-index-mmap", "--dataloader-fast-cache-load",
              "--disable-msc"), _LOADER),
    *notices(("--num-dataset-builder-threads", "--mid-level-dataset-surplus"), _LOADER, value),
    notice("--allow-ambiguous-pad-tokens",
           "pretraining samples are packed without padding, so no pad token is masked"),
    *notices(("--ckpt-fully-parallel-save", "--ckpt-drop-redundant-extra-state"),
             "checkpoint-writing speed: each tensor-parallel rank writes its own file"),
    notice("--dist-ckpt-workers", "checkpoint-writing speed: each tensor-parallel rank writes "
           "its own file", value),
    *[Flag(name, NOTICE, "--enable-cuda-graph captures whole transformer layers, forward and "
           "backward", type=value, nargs="+") for name in ("--cuda-graph-modules",
                                                          "--cuda-graph-scope")],
    notice("--optimizer-cuda-graph", "the optimizer step is not captured in a CUDA graph"),
    notice("--tp-comm-overlap-cfg", "--tp-comm-overlap uses torch symmetric memory, which takes "
           "no Transformer Engine userbuffer config", value),
    Flag("--cp-comm-type", NOTICE, "read only with --context-parallel-size above 1, which is "
         "refused", type=value, nargs="+"),
    notice("--use-precision-aware-optimizer", "optimizer states and master weights are fp32, "
           "so there is no precision to choose (other dtypes are refused)"),
    *notices(("--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
              "--use-torch-optimizer-for-cpu-offload", "--no-pin-cpu-grads",
              "--no-pin-cpu-params"), _OFFLOAD),
    notice("--optimizer-offload-fraction", _OFFLOAD, value),
    *notices(("--enable-full-sharding-in-hsdp", "--fsdp-db-use-persist-buf-on-alloc-fail",
              "--fsdp-double-buffer", "--fsdp-manual-registration",
              "--megatron-fsdp-enable-fine-grained-param-gather",
              "--megatron-fsdp-max-pool-double-buffer", "--torch-fsdp2-no-reshard-after-forward"),
             _FSDP),
    *notices(("--data-parallel-sharding-strategy", "--outer-dp-sharding-strategy",
              "--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype",
              "--megatron-fsdp-main-params-dtype", "--megatron-fsdp-version"), _FSDP, value),
    *notices(("--lion-beta1", "--lion-beta2", "--muon-coefficient-type",
              "--muon-extra-scale-factor", "--muon-fp32-matmul-prec", "--muon-momentum",
              "--muon-num-ns-steps", "--muon-scalar-optimizer", "--muon-scale-mode",
              "--muon-tp-mode"), _OPTIMIZER, value),
    *notices(("--muon-nesterov", "--muon-no-split-qkv", "--muon-use-syrk"), _OPTIMIZER),
    # Memory, logging, profiling (Megatron-LM's dataclass-made flags, common in scripts).
    impl("--manual-gc", "train.runtime.manual_gc", None,
         "Python's automatic garbage collector off for the run: every rank collects at the start, "
         "every --manual-gc-interval iterations and around evaluation, so that no rank pauses "
         "alone while the others wait in a collective."),
    impl("--manual-gc-interval", "train.runtime.manual_gc_interval", int,
         "With --manual-gc: iterations between collections (default 0: only at the start)."),
    impl("--no-manual-gc-eval", "train.runtime.manual_gc_eval", None,
         "With --manual-gc: no collection around evaluation.", const=False),
    alias("--disable-manual-gc-eval", "--no-manual-gc-eval",
          "Megatron-LM's second spelling of --no-manual-gc-eval."),
    notice("--no-log-loss-scale-to-tensorboard",
           "with --tensorboard-dir the loss scale is always written"),
    # Fault tolerance, telemetry, debugging: notices.
    *notices(("--adlr-autoresume", "--enable-ft-package", "--calc-ft-timeouts",
              "--inprocess-restart", "--inprocess-empty-cuda-cache"), _FAULTS),
    *notices(("--adlr-autoresume-interval", "--ft-num-warmup-iters",
              "--inprocess-active-world-size", "--inprocess-barrier-timeout",
              "--inprocess-completion-timeout", "--inprocess-granularity",
              "--inprocess-hard-timeout", "--inprocess-heartbeat-interval",
              "--inprocess-heartbeat-timeout", "--inprocess-last-call-wait",
              "--inprocess-max-iterations", "--inprocess-monitor-process-interval",
              "--inprocess-monitor-thread-interval", "--inprocess-progress-watchdog-interval",
              "--inprocess-soft-timeout", "--inprocess-termination-grace-time"), _FAULTS, value),
    *notices(("--no-one-logger", "--one-logger-async", "--otel-enabled",
              "--run-workload-inspector-server"), _TRACING),
    *notices(("--one-logger-project", "--one-logger-run-name", "--app-tag-run-name",
              "--app-tag-run-version", "--otel-service-name", "--otel-span-groups",
              "--result-rejected-tracker-filename"), _TRACING, value),
    notice("--dump-param-to-param-group-map", "no parameter-group map is written", value),
    notice("--check-for-large-grads",
           "no large-gradient check runs; the gradient norm is on every log line"),
    notice("--no-check-for-nan-in-loss-and-grad", "a NaN loss always stops the run (exit 1)"),
    notice("--enable-experimental", "megadomino has no experimental features to enable"),
    notice("--onnx-safe", "nothing is exported to ONNX", value),
    *notices(("--inference-cuda-graph-all-prefills", "--inference-dynamic-batching",
              "--inference-dynamic-batching-track-generated-token-events",
              "--inference-dynamic-batching-track-paused-request-events",
              "--enable-chunked-prefill", "--decode-only-cuda-graphs",
              "--use-legacy-static-engine"), _INFERENCE),
    *notices(("--inference-batch-times-seqlen-threshold", "--inference-coordinator-port",
              "--inference-cuda-graph-max-tokens", "--inference-disable-ep-consensus",
              "--inference-dynamic-batching-async-sched-mode",
              "--inference-dynamic-batching-block-size",
              "--inference-dynamic-batching-buffer-size-gb",
              "--inference-dynamic-batching-cuda-graph-mixed-prefill-count",
              "--inference-dynamic-batching-cuda-graph-sizing-distribution",
              "--inference-dynamic-batching-logprobs-mode",
              "--inference-dynamic-batching-mamba-memory-ratio",
              "--inference-dynamic-batching-max-requests",
              "--inference-dynamic-batching-max-tokens",
              "--inference-dynamic-batching-num-cuda-graphs",
              "--inference-dynamic-batching-paused-buffer-size-gb",
              "--inference-dynamic-batching-prefix-caching",
              "--inference-dynamic-batching-prefix-caching-coordinator-policy",
              "--inference-dynamic-batching-prefix-caching-eviction-policy",
              "--inference-dynamic-batching-prefix-caching-mamba-gb",
              "--inference-dynamic-batching-prefix-caching-routing-alpha",
              "--inference-dynamic-batching-sampling-backend",
              "--inference-dynamic-batching-unified-memory-level",
              "--inference-logging-step-interval", "--inference-max-requests",
              "--inference-max-seq-length", "--inference-shards",
              "--inference-text-gen-server-logging",
              "--inference-use-synchronous-zmq-collectives", "--inference-wandb-logging",
              "--max-tokens-to-oom", "--num-speculative-tokens",
              "--mamba-inference-conv-states-dtype", "--mamba-inference-ssm-states-dtype"),
             _INFERENCE, value),
    notice("--use-same-sampling-seed-across-dp-ranks", _INFERENCE),
    # Refused: features that would change results.
    *[Flag(name, REFUSED, "optimizer states, main gradients and master weights are always fp32",
           type=str, supported=("fp32",))
      for name in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype",
                   "--exp-avg-sq-dtype")],
    *refuse(("--enable-msc", "--object-storage-cache-path"),
            "object-storage paths (multi-storage client) are not implemented: --data-path, "
            "--load and --save are local paths"),
    *refuse(("--reset-attention-mask", "--reset-position-ids",
             "--dataloader-inter-document-masking"),
            "per-document attention masks and position resets are not implemented: documents "
            "packed in one sample attend across their boundary"),
    *refuse(("--fim-data", "--fim-rate", "--fim-spm-rate", "--fim-split-sample",
             "--fim-fragment-rate", "--fim-no-prefix", "--fim-prefix-token",
             "--fim-middle-token", "--fim-suffix-token", "--fim-pad-token", "--fim-eod-token"),
            "fill-in-the-middle data is not implemented"),
    *refuse(("--sft", "--sft-tokenizer-prompt-format"),
            "supervised fine-tuning is finetune_llama.py (JSONL prompt/response data)"),
    *refuse(("--data-args-path", "--per-split-data-args-path", "--per-dataset-sequences-path"),
            "dataset lists read from files are not implemented: give --data-path"),
    *refuse(("--sample-rate",), "subsampling the training data is not implemented"),
    *refuse(("--phase-transition-iterations",), "phased training is not implemented"),
    *refuse(("--dist-ckpt-format",), "Megatron-LM's deprecated spelling of --ckpt-format: give "
            "--ckpt-format torch_dist"),
    *refuse(("--override-ckpt-iteration",), "--load always resumes the iteration that "
            "latest_checkpointed_iteration.txt names"),
    *refuse(("--fake-process-group",), "a fake process group is not implemented: every rank "
            "runs"),
    *refuse(("--yaml-cfg",), "YAML configs are not read: give the flags"),
    *refuse(("--spec",), "layer specs are not implemented: the model comes from the flags"),
    *refuse(("--freeze-all-layers",), "freezing layers is not implemented"),
    *refuse(("--head-lr-mult",), "an LR multiplier for the output head is not implemented "
            "(--decoupled-lr gives the embedding and output layer their own schedule)"),
    *refuse(("--fp16-lm-cross-entropy",), "the cross-entropy is always computed in fp32"),
    *refuse(("--output-logit-dtype",), "choosing the output logits' dtype is not implemented"),
    notice("--keep-fp8-transpose-cache", "FP8 casts happen at each GEMM and keep no transpose "
           "cache (a memory knob)"),
    *refuse(("--fp4-param-gather",), "FP4 training is not implemented"),
    *refuse(("--reuse-grad-buf-for-mxfp8-param-ag",), "MXFP8 training is not implemented"),
    *refuse(("--te-precision-config-file", "--kitchen-config-file", "--kitchen-recipe-number"),
            "per-layer precision recipes (Transformer Engine, Kitchen) are not implemented"),
    *refuse(("--encoder-num-layers", "--encoder-seq-length", "--decoder-num-layers",
             "--decoder-seq-length"),
            "encoder-decoder (T5) models are not implemented: use --num-layers and --seq-length"),
    impl("--decoder-first-pipeline-num-layers", "parallel.decoder_first_pipeline_num_layers",
         int, "Layers of the first pipeline stage; the stages between share the rest evenly."),
    impl("--decoder-last-pipeline-num-layers", "parallel.decoder_last_pipeline_num_layers",
         int, "Layers of the last pipeline stage."),
    *refuse(("--pipeline-model-parallel-layout",),
            "a per-stage layout string is not implemented: use "
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"),
    *refuse(("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--v-head-dim",
             "--qk-pos-emb-head-dim", "--cache-mla-latents", "--mla-down-proj-fusion"), MLA),
    *refuse(("--mscale", "--mscale-all-dim", "--rotary-scaling-factor", "--rope-scaling-factor",
             "--yarn-beta-fast", "--yarn-beta-slow", "--yarn-original-max-position-embeddings",
             "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int",
             "--no-rope-freq"), ROPE),
    Flag("--rope-type", REFUSED, ROPE, type=str, supported=("rope",)),
    impl("--no-position-embedding", None, None,
         "Megatron-LM's deprecated switch: with rope it is accepted and changes nothing (rope adds "
         "no position embedding), as in Megatron-LM; with learned_absolute it is refused, since "
         "models without position embeddings are not implemented.", group="model"),
    *refuse(("--relative-attention-num-buckets", "--relative-attention-max-distance"),
            "relative position buckets (T5) are not implemented"),
    *refuse(("--window-size", "--window-attn-skip-freq"),
            "sliding-window attention is not implemented"),
    *refuse(("--linear-attention-freq",), "linear attention layers are not implemented"),
    *refuse(("--hybrid-layer-pattern", "--hybrid-override-pattern",
             "--mamba-training-ssm-states-dtype"), "hybrid Mamba models are not implemented"),
    *refuse(("--heterogeneous-layers-config-path", "--heterogeneous-layers-config-encoded-json"),
            "layers of different shapes are not implemented"),
    *refuse(("--moe-layer-freq", "--moe-use-upcycling", "--moe-upcycling-granularity"), MOE),
    *refuse(("--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type"),
            "QK normalization is not implemented, so there is no QK norm to decay"),
    *refuse(("--logits-save-dir", "--logits-save-dtype", "--logits-save-top-k",
             "--logits-save-top-p", "--logits-save-top-p-min-k", "--logits-load-dir",
             "--logits-load-decode-threads", "--logits-load-ignore-errors",
             "--logits-load-kd-loss-alpha", "--logits-load-msc-prefetch-depth",
             "--logits-load-prefetch-factor"),
            "knowledge distillation from saved logits is not implemented"),
    *refuse(("--img-h", "--img-w", "--num-channels", "--patch-dim", "--classes-fraction",
             "--data-per-class-fraction", "--num-classes", "--iter-per-epoch",
             "--vision-pretraining", "--vision-pretraining-type", "--vision-backbone-type",
             "--swin-backbone-type", "--mask-type", "--mask-factor", "--dino-local-img-size",
             "--dino-local-crops-number", "--dino-head-hidden-size", "--dino-bottleneck-size",
             "--dino-freeze-last-layer", "--dino-norm-last-layer", "--dino-warmup-teacher-temp",
             "--dino-teacher-temp", "--dino-warmup-teacher-temp-epochs"), _VISION),
    *refuse(("--mask-prob", "--short-seq-prob", "--bert-no-binary-head", "--bert-load",
             "--bert-embedder-type", "--output-bert-embeddings"), _BERT),
    *refuse(("--ict-head-size", "--ict-load", "--biencoder-projection-dim",
             "--biencoder-shared-query-context-model", "--query-in-block-prob",
             "--use-one-sent-docs", "--retriever-report-topk-accuracies",
             "--retriever-score-scaling", "--block-data-path", "--titles-data-path",
             "--evidence-data-path", "--embedding-path", "--indexer-batch-size",
             "--indexer-log-interval"), _RETRIEVAL),
    *refuse(("--perform-rl-step", "--langrl-env-config", "--refit-method",
             "--grpo-group-size", "--grpo-prompts-per-step", "--grpo-iterations",
             "--grpo-kl-beta", "--grpo-entropy-term-weight", "--grpo-clamp-eps-lower",
             "--grpo-clamp-eps-upper", "--grpo-filter-groups-with-same-reward",
             "--rl-consumption-granularity", "--rl-default-temperature", "--rl-default-top-k",
             "--rl-default-top-p", "--rl-durable-rollout-bank", "--rl-generation-lag",
             "--rl-importance-sampling-truncation-coef",
             "--rl-inference-expert-model-parallel-size",
             "--rl-inference-expert-tensor-model-parallel-size",
             "--rl-inference-logprobs-is-correction",
             "--rl-inference-model-unified-memory-level", "--rl-inference-parsers",
             "--rl-inference-pipeline-model-parallel-size",
             "--rl-inference-tensor-model-parallel-size", "--rl-kv-cache-management-mode",
             "--rl-max-inflight-requests", "--rl-offload-inference-model-weights-when-idle",
             "--rl-offload-optimizer-during-inference", "--rl-partial-rollouts",
             "--rl-persist-cuda-graphs", "--rl-profile", "--rl-profile-dir",
             "--rl-prompts-per-eval", "--rl-rollout-bank-dir", "--rl-rollout-bank-max-bytes",
             "--rl-sequence-packing-algo", "--rl-sequence-packing-max-sequences-per-bin",
             "--rl-skip-bos-token", "--rl-submission-granularity", "--rl-training-cuda-graphs",
             "--rl-use-sequence-packing", "--rl-verify-model-weights-swap"), _RL),
)
