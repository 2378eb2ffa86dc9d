"""The flag policy table: every flag megadomino knows, under one of the policies of
`megadomino.cli.flag_row` (implemented, alias, ours, notice, refused).

`FLAGS` is what pretrain_gpt.py and pretrain_llama.py take; finetune_llama.py takes
`FINETUNE_FLAGS` too. The rows here are the flags megadomino implements and the notices and
refusals written with them; `flags_megatron.MEGATRON_ROWS` covers the rest of Megatron-LM's
command line (and the old and fork names launch scripts still pass), and
`flags_megatron_config.MEGATRON_CONFIG_ROWS` the flags it makes of its config dataclasses.
`RANGES` bounds the numeric flags. `megadomino.cli.arguments` parses them; docs/flags.md
renders them.
"""

from __future__ import annotations

from megadomino.cli.flag_row import (
    ALIAS,
    IMPLEMENTED,
    NOTICE,
    OURS,
    REFUSED,
    Flag,
    Range,
)
from megadomino.cli.flag_row import count as _count
from megadomino.cli.flag_row import impl as _impl
from megadomino.cli.flag_row import notice as _notice
from megadomino.cli.flag_row import ours as _ours
from megadomino.cli.flag_row import refuse as _refuse
from megadomino.cli.flag_row import roles_or_auto as _roles_or_auto
from megadomino.cli.flag_row import slices_or_auto as _slices_or_auto
from megadomino.cli.flag_row import value as _value
from megadomino.cli.flags_megatron import MEGATRON_ROWS, MOE
from megadomino.cli.flags_megatron_config import MEGATRON_CONFIG_ROWS
from megadomino.config.diloco import PSEUDO_GRAD_DTYPES
from megadomino.config.parallel import PIPELINE_PLANNERS
from megadomino.config.pipeline_codec import CODEC_VALUES, PIPELINE_CODECS

__all__ = ["ALIAS", "FINETUNE_FLAGS", "FLAGS", "IMPLEMENTED", "NOTICE", "OURS", "RANGES",
           "REFUSED", "Flag"]

_NO_KERNEL = ("the layers' element-wise pieces run eagerly unless --compile-layer-pieces compiles "
              "them all; there is no per-piece switch")
_SDPA = "attention always runs through torch SDPA, which picks flash attention where it can"
_TENSORBOARD = ("with --tensorboard-dir every scalar is written at each --log-interval: loss, lr, "
                "grad norm, loss scale, throughput, memory, timers, validation loss and ppl")
_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                    "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                    "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer", "NullTokenizer",
                    "NullMultimodalTokenizer", "SFTTokenizer")

FLAGS: tuple[Flag, ...] = (
    # Model shape. Later rows win over earlier ones they overlap, as in Megatron-LM.
    _impl("--num-layers", "model.num_layers", int, "Transformer layers."),
    _impl("--hidden-size", "model.hidden_size", int, "Hidden size."),
    _impl("--ffn-hidden-size", "model.ffn_hidden_size", int,
          "MLP hidden size; default 4 x hidden, or int(8 x hidden / 3 / 64) x 64 with --swiglu."),
    _impl("--num-attention-heads", "model.num_attention_heads", int, "Attention heads."),
    _impl("--group-query-attention", None, None,
          "Grouped-query attention with --num-query-groups groups; alone it means 1 group "
          "(multi-query), as in Megatron-LM.", group="model"),
    _impl("--num-query-groups", "model.num_query_groups", int,
          "Key/value heads; only with --group-query-attention (Megatron-LM silently ignores it "
          "without; here that is an error)."),
    _impl("--kv-channels", "model.kv_channels", int, "Per-head dim; default hidden / heads."),
    _impl("--seq-length", "model.seq_length", int, "Sequence length."),
    _impl("--max-position-embeddings", "model.max_position_embeddings", int,
          "Learned position table size; default --seq-length."),
    _impl("--position-embedding-type", "model.position_embedding_type", str,
          "Position encoding.", choices=("learned_absolute", "rope", "mrope", "relative", "none"),
          supported=("learned_absolute", "rope"),
          unsupported="only learned_absolute and rope positions are implemented"),
    _impl("--use-rotary-position-embeddings", "model.position_embedding_type", None,
          "Megatron-LM's older spelling of --position-embedding-type rope.", const="rope"),
    _impl("--rotary-base", "model.rotary_base", float, "RoPE base (theta)."),
    _impl("--normalization", "model.normalization", str, "Norm layer.",
          choices=("LayerNorm", "RMSNorm")),
    _impl("--norm-epsilon", "model.norm_epsilon", float, "Norm epsilon."),
    _impl("--layernorm-epsilon", "model.norm_epsilon", float,
          "Megatron-LM's older name of --norm-epsilon, still passed by forks' scripts (dropping it "
          "would change the epsilon)."),
    _impl("--apply-layernorm-1p", "model.apply_layernorm_1p", None,
          "Zero-centred norm weights: stored as gamma - 1 (initialised to 0), the norm scales "
          "by weight + 1; LayerNorm and RMSNorm, as Megatron-LM's."),
    _impl("--swiglu", "model.swiglu", None, "SwiGLU MLP instead of GELU."),
    _impl("--disable-bias-linear", "model.add_bias_linear", None, "No biases in linear layers.",
          const=False),
    _impl("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights",
          None, "Separate output layer instead of the tied input embedding."),
    _impl("--hidden-dropout", "model.hidden_dropout", float, "Dropout after attention and MLP."),
    _impl("--attention-dropout", "model.attention_dropout", float, "Dropout on attention probs."),
    _impl("--init-method-std", "model.init_method_std", float,
          "Init std (output projections scaled by 1 / sqrt(2 x layers))."),
    _impl("--vocab-size", "model.vocab_size", int,
          "Vocabulary before padding, without a tokenizer (--mock-data) and for NullTokenizer; "
          "default the preset's, else the family tokenizer's (GPT-2 50257, Llama-2 32000). With "
          "--tokenizer-type the tokenizer's vocabulary is used, as in Megatron-LM."),
    _impl("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by", int,
          "Pad the vocabulary to a multiple of this times TP."),
    # Parallelism and memory.
    _impl("--tensor-model-parallel-size", "parallel.tensor_model_parallel_size", int,
          "Tensor-parallel degree."),
    _impl("--pipeline-model-parallel-size", "parallel.pipeline_model_parallel_size", int,
          "Pipeline-parallel degree: Megatron's split of the layers, stages in Megatron's rank "
          "order (PP slowest); the schedule is --pipeline-schedule (docs/pipeline.md)."),
    _impl("--virtual-pipeline-model-parallel-size",
          "parallel.virtual_pipeline_model_parallel_size", int,
          "Model chunks per pipeline stage, for --pipeline-schedule interleaved (any count) or "
          "zbv (2)."),
    _impl("--num-layers-per-virtual-pipeline-stage",
          "parallel.num_layers_per_virtual_pipeline_stage", int,
          "Layers per model chunk (chunks = layers / (pipeline size x this)), for "
          "--pipeline-schedule interleaved."),
    _ours("--pipeline-schedule", "parallel.pipeline_schedule", str,
          "1f1b (Megatron's), interleaved (virtual stages, Megatron's), eager-1f1b (Alpa's "
          "overlap-friendly 1F1B: more warm-up forwards, each forward's send overlaps the next "
          "compute), zb-h1 (zero-bubble ZB-H1: 1F1B with each backward split into input- and "
          "weight-gradient passes, the weight gradients delayed into the bubbles; 1F1B's "
          "activation memory, about a third of its bubble), eager-zb (eager-1f1b's forwards "
          "with zb-h1's delayed weight gradients: both gains over slow links; eager-1f1b's "
          "memory), zbv (the same paper's V-shaped zero-bubble schedule: 2 chunks a stage, "
          "--virtual-pipeline-model-parallel-size 2, placed in a V, stage s holding virtual "
          "stages s and 2P-1-s, so the last stage feeds its own second chunk and stage 0 "
          "computes the loss; half zb-h1's bubble where forward, input- and weight-gradient "
          "passes take alike, 1F1B's peak activation memory on every stage; any micro-batch "
          "count; not with --pipeline-codec) (the split ones not with Domino, --tp-comm-overlap "
          "or CUDA graphs), or auto (at start-up each stage's forward, backward and split "
          "backward are timed on a random micro-batch and a message over the links, and the "
          "schedule the pipeline simulator predicts fastest runs; the start-up prints every "
          "prediction; with virtual "
          "stages the interleaved schedule). Default: interleaved with virtual stages (as in "
          "Megatron), else 1f1b.",
          choices=("1f1b", "interleaved", "eager-1f1b", "zb-h1", "eager-zb", "zbv", "auto")),
    _impl("--no-overlap-p2p-communication", "parallel.overlap_p2p_communication", None,
          "Post each pipeline receive just before its compute needs it instead of one compute "
          "of its pass ahead (--overlap-p2p-communication; --pipeline-schedule eager-1f1b "
          "always does). Default: ahead on gloo, just before on NCCL, where a posted receive "
          "holds SMs through the compute it overlaps (docs/pipeline.md).", const=False),
    _ours("--overlap-p2p-communication", "parallel.overlap_p2p_communication", None,
          "Post each pipeline receive one compute of its pass ahead, on NCCL too, so that the "
          "transfer overlaps the computes between: for slow links between GPU hosts, where "
          "the transfer outweighs the SMs the waiting receive holds (docs/pipeline.md).",
          const=True),
    _impl("--nccl-communicator-config-path", "parallel.nccl_communicator_config_path", str,
          "A YAML file of NCCL settings per process group by Megatron-LM's names (tp, dp, pp: "
          "the pipeline group and its P2P channels, embd), each of min_ctas, max_ctas, "
          "cga_cluster_size, net_name (IB or socket) and is_high_priority_stream, e.g. "
          "'pp: {max_ctas: 2}' (docs/nccl.md); Megatron-LM's other group names are accepted and "
          "not applied. Default NCCL's settings."),
    _impl("--high-priority-stream-groups", "parallel.high_priority_stream_groups", str,
          "Groups (tp, dp, pp, embd) whose NCCL kernels run on a high-priority stream.",
          nargs="+"),
    _ours("--pipeline-plan", "parallel.pipeline_plan", str,
          "A JSON file of pipeline stages, each with its ranks, TP degree and layer range: "
          "stage meshes of different shapes, joined by cross-mesh resharding (docs/pipeline.md); "
          "its stage count is --pipeline-model-parallel-size unless that flag is given; or "
          "'auto': planned at start-up from the measured links between every pair of ranks and "
          "each rank's GEMM speed (docs/placement.md), the plan and its predicted step time "
          "printed; default Megatron's uniform plan."),
    _ours("--pipeline-planner", "parallel.pipeline_planner", str,
          "With --pipeline-plan auto: op-fence (default: ranks clustered by bandwidth, the "
          "clusters chained, the layers cut exactly to balance the slowest stage or link), "
          "dt-fm (DT-FM's equal groups and objective) or brute-force (every ordering of the "
          "ranks into stages: the oracle, slow beyond 8 ranks).",
          choices=PIPELINE_PLANNERS),
    _ours("--pipeline-placement-dir", "parallel.pipeline_placement_dir", str,
          "With --pipeline-plan auto: the directory the plan (plan.json, a --pipeline-plan "
          "file) and the start-up measurement (links.json) are written to; default --save's "
          "directory when given, else they are only printed."),
    _ours("--pipeline-link-delay", "parallel.pipeline_link_delay", float,
          "Seconds added to every received pipeline message, and to the start-up measurement's "
          "latency probes: an emulation of link latency for experiments where the kernel has "
          "no netem (an upper bound: a message that arrived during a compute waits too). "
          "Default 0."),
    _ours("--emulate-slow-rank", "parallel.emulate_slow_rank", str,
          "RANK:FACTOR: rank RANK computes FACTOR times slower, an emulated slow device for "
          "experiments (after each pipeline compute action, and each GEMM of --pipeline-plan "
          "auto's speed probe, it waits FACTOR - 1 times as long as the work took)."),
    _ours("--pipeline-reshard", "parallel.pipeline_reshard", str,
          "How a --pipeline-plan's boundaries between stages of different layouts move an "
          "activation and its gradient: send-recv (a message per overlapping tile), broadcast "
          "(a collective from one holder to every replica of a tile), scatter-gather (each "
          "replica receives a part, then all-gathers with the others, as Megatron's "
          "scatter-gather between pipeline stages) or auto (default: per boundary and "
          "direction the strategy the cost model predicts fastest; each choice is printed at "
          "start-up with its predicted time). Only with --pipeline-plan.",
          choices=("auto", "send-recv", "broadcast", "scatter-gather")),
    _ours("--pipeline-codec", "parallel.pipeline_codec", str,
          "How each pipeline boundary encodes activations and their gradients "
          "(docs/pipeline_codec.md): none (default), int8 or int4 (per-token scales, the ZeRO++ "
          "quantizer), adatopk (the top-k entries of each token row, the gradient sent at the "
          "kept indices: the exact gradient of the masked activation) or auto (per link the "
          "least of none, int8, int4, adatopk whose transfer fits under the slowest stage's "
          "compute). With --pipeline-model-parallel-size, not --pipeline-plan.",
          choices=PIPELINE_CODECS),
    _ours("--pipeline-codec-density", "parallel.pipeline_codec_density", float,
          "adatopk's kept share of each token row, k = ceil(density x hidden): the fixed k with "
          "--pipeline-codec-interval 0, else the least k adaptation may choose. Default 0.1."),
    _ours("--pipeline-codec-interval", "parallel.pipeline_codec_interval", int,
          "Steps between re-estimates of each link's codec from its transfers' own timings "
          "(rank 0 decides, every rank applies it from the next step; each link gets the least "
          "compression of --pipeline-codec that fits; the first steps run the most). 0: every "
          "link at the codec's fixed setting. Default 10."),
    _ours("--pipeline-codec-values", "parallel.pipeline_codec_values", str,
          "adatopk's kept values: native (default: the activation's dtype), int8 or int4 (the "
          "ZeRO++ quantizer, a scale per token row; int4 packs two a byte); indices are int16, "
          "relative to their row.",
          choices=CODEC_VALUES),
    _ours("--pipeline-codec-grad-topk", "parallel.pipeline_codec_grad_topk", None,
          "adatopk's gradient as its own top-k instead of at the forward's kept indices (an "
          "approximation of the masked activation's gradient)."),
    _ours("--pipeline-codec-error-feedback", "parallel.pipeline_codec_error_feedback", None,
          "Each boundary message adds the encoding error the previous message of its "
          "micro-batch slot left; approximate, as consecutive steps carry other samples."),
    _ours("--nics-per-node", "parallel.nics_per_node", int,
          "Network interfaces per node, the GPUs spread evenly over them: the resharding cost "
          "model of --pipeline-plan's boundaries balances senders per NIC (1, the default: per "
          "host; --gpus-per-node: one NIC per GPU, per device). Only with --pipeline-plan."),
    _impl("--sequence-parallel", "parallel.sequence_parallel", None,
          "Shard norm and dropout activations over TP ranks; dropped with a notice at TP 1, as in "
          "Megatron-LM."),
    _impl("--recompute-granularity", "parallel.recompute_granularity", str,
          "Recompute whole layers (full) or the attention core (selective).",
          choices=("full", "selective")),
    _impl("--recompute-method", "parallel.recompute_method", str,
          "Which layers full recompute covers.", choices=("uniform", "block")),
    _impl("--recompute-num-layers", "parallel.recompute_num_layers", int,
          "Layers per recompute chunk (uniform) or recomputed layers (block)."),
    _impl("--recompute-activations", "parallel.recompute_granularity", None,
          "Megatron-LM's shorthand for --recompute-granularity selective.", const="selective"),
    _impl("--ddp-bucket-size", "parallel.zero.bucket_numel", int,
          "Elements per data-parallel all-reduce bucket at --zero-stage 0, plain data "
          "parallelism (stages 1 and 3 reduce layer by layer)."),
    # Batch, optimizer and schedule.
    _impl("--micro-batch-size", "train.schedule.micro_batch_size", int,
          "Samples per forward (default 1)."),
    _impl("--global-batch-size", "train.schedule.global_batch_size", int,
          "Samples per step; default micro x DP. Must be a multiple of micro x DP."),
    _impl("--train-iters", "train.schedule.train_iters", int,
          "Run length in steps (or --train-samples)."),
    _impl("--train-samples", "train.schedule.train_samples", int, "Run length in samples."),
    _impl("--optimizer", "train.optimizer.optimizer", str,
          "Optimizer: adam (AdamW, as Megatron-LM's adam) or sgd (with --sgd-momentum).",
          choices=("adam", "sgd", "muon", "dist_muon"), supported=("adam", "sgd"),
          unsupported="Muon is not implemented: use adam or sgd"),
    _impl("--sgd-momentum", "train.optimizer.sgd_momentum", float,
          "SGD momentum (default 0.9, Megatron-LM's), with --optimizer sgd."),
    _impl("--lr", "train.schedule.lr", float, "Peak learning rate (default 1e-4)."),
    _impl("--min-lr", "train.schedule.min_lr", float, "Learning rate at the end of decay."),
    _impl("--lr-decay-style", "train.schedule.lr_decay_style", str,
          "Decay shape (default linear, as in Megatron-LM).",
          choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
          supported=("constant", "linear", "cosine", "WSD"),
          unsupported="inverse-square-root decay is not implemented"),
    _impl("--lr-decay-iters", "train.schedule.lr_decay_iters", int,
          "Decay length; default the whole run."),
    _impl("--lr-warmup-iters", "train.schedule.lr_warmup_iters", int, "Linear warmup steps."),
    _impl("--lr-warmup-fraction", "train.schedule.lr_warmup_fraction", float,
          "Warmup as a fraction of the decay steps."),
    _impl("--lr-decay-samples", "train.schedule.lr_decay_samples", int,
          "With --train-samples: decay length in samples; default the whole run."),
    _impl("--lr-warmup-samples", "train.schedule.lr_warmup_samples", int,
          "With --train-samples: linear warmup in samples."),
    _impl("--lr-wsd-decay-style", "train.schedule.lr_wsd_decay_style", str,
          "--lr-decay-style WSD: the annealing shape (default exponential, as Megatron-LM's).",
          choices=("linear", "cosine", "exponential", "minus_sqrt")),
    _impl("--lr-wsd-decay-iters", "train.schedule.lr_wsd_decay_iters", int,
          "--lr-decay-style WSD with --train-iters: the annealing steps at the end of the decay."),
    _impl("--lr-wsd-decay-samples", "train.schedule.lr_wsd_decay_samples", int,
          "--lr-decay-style WSD with --train-samples: the annealing samples at the end of the "
          "decay."),
    _impl("--decoupled-lr", "train.schedule.decoupled_lr", float,
          "Peak LR of the word embedding and output layer, which follow the schedule in their "
          "own optimizer groups (Megatron-LM's decoupled param groups); default --lr."),
    _impl("--decoupled-min-lr", "train.schedule.decoupled_min_lr", float,
          "With --decoupled-lr: their LR at the end of decay; default --min-lr."),
    _impl("--rampup-batch-size", "train.schedule.rampup_batch_size", int,
          "START INCREMENT SAMPLES, with --train-samples: the global batch grows from START by "
          "INCREMENT in equal steps over SAMPLES consumed samples, then stays "
          "--global-batch-size (Megatron-LM's ramp-up; the LR schedule counts samples).",
          nargs="+"),
    _impl("--step-batch-size-schedule", "train.schedule.step_batch_size_schedule", str,
          "'THRESHOLD:BATCH ...', e.g. '0:16 2.4B:320 12B:1536': from each threshold of "
          "consumed tokens (K/M/B/T suffixes; divided by --seq-length into samples) the global "
          "batch is BATCH; the first threshold is 0 and the last BATCH is the global batch "
          "(--global-batch-size may repeat it; Megatron-LM refuses the pair). Every batch must "
          "tile into micro-batch x DP; the log line shows the current one."),
    _impl("--calculate-per-token-loss", "train.schedule.calculate_per_token_loss", None,
          "The loss of a global batch is the sum of its token losses over its non-masked tokens, "
          "across micro-batches and data-parallel ranks (not the mean of micro-batch means); "
          "validation weighs tokens alike."),
    _impl("--weight-decay", "train.optimizer.weight_decay", float, "AdamW weight decay."),
    _impl("--adam-beta1", "train.optimizer.adam_beta1", float, "Adam beta1."),
    _impl("--adam-beta2", "train.optimizer.adam_beta2", float, "Adam beta2."),
    _impl("--adam-eps", "train.optimizer.adam_eps", float, "Adam epsilon."),
    _impl("--clip-grad", "train.optimizer.clip_grad", float,
          "Global gradient-norm clip (0 = off)."),
    # Precision.
    _impl("--bf16", "train.precision.bf16", None,
          "bf16 parameters, fp32 main grads and master weights."),
    _impl("--fp16", "train.precision.fp16", None, "fp16 parameters with dynamic loss scaling."),
    _impl("--initial-loss-scale", "train.precision.initial_loss_scale", float,
          "fp16: first loss scale."),
    _impl("--min-loss-scale", "train.precision.min_loss_scale", float, "fp16: loss-scale floor."),
    _impl("--loss-scale-window", "train.precision.loss_scale_window", int,
          "fp16: clean steps before the scale grows."),
    _impl("--hysteresis", "train.precision.hysteresis", int,
          "fp16: overflows tolerated before shrinking."),
    # FP8 GEMMs in the transformer layers' linears (megadomino/tp/fp8.py).
    _impl("--fp8-format", "train.precision.fp8.format", str,
          "FP8 GEMMs (torch._scaled_mm, per-tensor scales) in the layers' column- and "
          "row-parallel linears: hybrid casts activations and weights to e4m3 and gradients to "
          "e5m2, e4m3 casts all three to e4m3. Master weights stay fp32; embeddings and the "
          "output layer stay in high precision. Without it the other --fp8-* settings are not "
          "read (a notice says so), as in Megatron-LM.", choices=("e4m3", "hybrid")),
    _impl("--fp8-recipe", "train.precision.fp8.recipe", str,
          "Scaling (with --fp8-format): delayed (default; scales from an amax history, updated "
          "between steps) or tensorwise (each tensor scaled by its own amax).",
          choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
          supported=("delayed", "tensorwise"),
          unsupported="only per-tensor scaling is implemented: mxfp8 needs the block-scaled "
                      "MMA of Blackwell GPUs, blockwise (1x128 / 128x128 scales) and custom "
                      "recipes are not written here"),
    _impl("--fp8-amax-history-len", "train.precision.fp8.amax_history_len", int,
          "delayed: steps of amax history (default 1)."),
    _impl("--fp8-amax-compute-algo", "train.precision.fp8.amax_compute_algo", str,
          "delayed: the amax a scale is computed from, the history's max or its newest entry "
          "(default most_recent).", choices=("max", "most_recent")),
    _impl("--fp8-margin", "train.precision.fp8.margin", int,
          "delayed: scales are divided by 2^margin (default 0)."),
    _impl("--fp8-interval", "train.precision.fp8.interval", int,
          "delayed: steps between scale updates (default 1)."),
    _impl("--fp8-param-gather", "parallel.zero.fp8_param_gather", None,
          "With --fp8-format and --use-distributed-optimizer (or --zero-stage 3): the FP8 "
          "linears' weights are all-gathered as e4m3 codes, one scale a weight from its amax "
          "(max-reduced over DP), about half the bytes of a bf16 gather; the weight is rounded "
          "to FP8 once, as without it, and checkpoints gather the exact weights."),
    _ours("--fp8-linears", "train.precision.fp8.linears", _roles_or_auto,
          "With --fp8-format: which of each transformer layer's linears run FP8: all (default), "
          "a comma list of qkv, proj, fc1, fc2 (the attention's QKV and output projections, the "
          "MLP's two; the others run in the model's dtype, bf16 with --bf16), or auto: at "
          "start-up each role's GEMMs, forward and backward at the run's shapes, are timed in "
          "bf16 and in FP8 (casts and scaling included; median of 3 interleaved passes, slowest "
          "rank; as CUDA-graph replays with --enable-cuda-graph), and a role runs FP8 where FP8 "
          "takes at most 0.98x bf16's time; one start-up line gives every time and the choice. "
          "The start-up summary names the linears and layers that run FP8."),
    _impl("--first-last-layers-bf16", "train.precision.fp8.first_last_layers_bf16", None,
          "With --fp8-format: every linear of the first --num-layers-at-start-in-bf16 and the "
          "last --num-layers-at-end-in-bf16 transformer layers runs in the model's dtype, bf16 "
          "with --bf16 (global layer indices, whatever the pipeline split). Megatron-LM refuses "
          "it with delayed scaling (Transformer Engine's recipe is global); here each FP8 "
          "linear keeps its own scaling state, so both recipes take it."),
    _impl("--num-layers-at-start-in-bf16", "train.precision.fp8.num_layers_at_start_in_bf16",
          int, "With --first-last-layers-bf16: the layers at the start kept in bf16 (default "
          "1)."),
    _impl("--num-layers-at-end-in-bf16", "train.precision.fp8.num_layers_at_end_in_bf16", int,
          "With --first-last-layers-bf16: the layers at the end kept in bf16 (default 1)."),
    # Seed, logging, evaluation, data.
    _impl("--seed", "train.runtime.seed", int, "Random seed."),
    _impl("--log-interval", "train.logging.log_interval", int, "Steps between log lines."),
    _impl("--eval-interval", "train.schedule.eval_interval", int, "Steps between evaluations."),
    _impl("--eval-iters", "train.schedule.eval_iters", int,
          "Batches per evaluation; 0 or -1: no evaluation (Megatron-LM evaluates only when it is "
          "positive; launch scripts pass -1)."),
    _impl("--mock-data", "train.data.mock_data", None,
          "Learnable synthetic data instead of --data-path."),
    _impl("--data-path", "train.data.data_path", str,
          "Indexed dataset prefix(es) (PREFIX.bin / PREFIX.idx): one, several (blended by size) "
          "or weighted pairs `0.3 A 0.7 B`. finetune_llama.py: JSONL files of "
          "{\"prompt\", \"response\"}.", nargs="+"),
    _impl("--split", "train.data.split", str,
          "Train,valid,test weights of every dataset's documents (default 969,30,1)."),
    _impl("--dataloader-type", "train.data.dataloader_type", str,
          "The order samples are read in: single (default; consecutive) or cyclic (Megatron-LM's "
          "cyclic loader: each epoch of the dataset permuted by torch.randperm seeded with the "
          "epoch, epochs repeating for as long as the run reads; resumable mid-epoch). The "
          "datasets are sized to the run, as Megatron-LM sizes them: epochs wrap only for a "
          "dataset shorter than the run.",
          choices=("single", "cyclic", "external"), supported=("single", "cyclic"),
          unsupported="an external loader is the caller's own iterator: hand train() a "
                      "dataset instead"),
    _impl("--no-data-sharding", "train.data.data_sharding", None,
          "cyclic: one permutation of the whole dataset dealt out to the DP ranks, instead of "
          "each rank permuting its own bucket (Megatron-LM's default); read by nothing else.",
          const=False),
    _impl("--tokenizer-type", "train.data.tokenizer_type", str,
          "Tokenizer (required with --data-path); its vocabulary sets the model's.",
          choices=_TOKENIZER_TYPES,
          supported=("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                     "HuggingFaceTokenizer", "Llama2Tokenizer", "NullTokenizer"),
          unsupported="that tokenizer type is not implemented"),
    _impl("--tokenizer-model", "train.data.tokenizer_model", str,
          "sentencepiece model file, or a local Hugging Face tokenizer directory."),
    _impl("--vocab-file", "train.data.vocab_file", str, "GPT2BPETokenizer: vocab.json."),
    _impl("--merge-file", "train.data.merge_file", str, "GPT2BPETokenizer: merges.txt."),
    _impl("--eod-mask-loss", "train.data.eod_mask_loss", None,
          "Leave end-of-document tokens out of the loss."),
    _impl("--data-cache-path", "train.data.data_cache_path", str,
          "Where dataset index files are cached (default: index-cache beside the data)."),
    # Checkpoints.
    _impl("--save", "train.checkpoint.save", str,
          "Checkpoint directory (Megatron-LM's layout: iter_NNNNNNN/mp_rank_XX/"
          "model_optim_rng.pt, latest_checkpointed_iteration.txt written last); saved every "
          "--save-interval, at the end and when an --exit-* condition stops the run."),
    _impl("--save-interval", "train.checkpoint.save_interval", int,
          "Iterations between checkpoints."),
    _impl("--load", "train.checkpoint.load", str,
          "Resume from the checkpoint this directory's iteration file names: model, optimizer, "
          "LR schedule, loss scaler, counters, RNG states. At another TP degree the model and "
          "optimizer are re-sharded (the RNG streams restart from --seed). No checkpoint there: "
          "a fresh start."),
    _impl("--finetune", "train.checkpoint.finetune", None,
          "With --load: weights only; the iteration, optimizer and RNG start fresh."),
    _impl("--no-load-optim", "train.checkpoint.no_load_optim", None,
          "With --load: keep a fresh optimizer and loss scaler."),
    _impl("--no-load-rng", "train.checkpoint.no_load_rng", None,
          "With --load: keep the RNG streams seeded from --seed."),
    _impl("--no-save-optim", "train.checkpoint.no_save_optim", None,
          "Leave the optimizer out of checkpoints (they then load with --no-load-optim)."),
    _impl("--no-save-rng", "train.checkpoint.no_save_rng", None,
          "Leave the RNG states out of checkpoints."),
    _impl("--exit-on-missing-checkpoint", "train.checkpoint.exit_on_missing_checkpoint", None,
          "With --load: an error, not a fresh start, when the directory holds no checkpoint."),
    _impl("--ckpt-format", "train.checkpoint.ckpt_format", str,
          "Checkpoint format written by --save: torch (ours, one file per tensor-parallel "
          "rank), or torch_dist (ours plus Megatron-LM's torch_dist files of the weights, which "
          "Megatron-LM loads with --no-load-optim --no-load-rng). --load reads ours and "
          "Megatron-LM's torch_dist and torch checkpoints at any TP (weights and counters).",
          choices=("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"),
          supported=("torch", "torch_dist"),
          unsupported="only the torch and torch_dist formats are implemented"),
    _impl("--use-dist-ckpt", "train.checkpoint.ckpt_format", None,
          "Megatron-LM's deprecated spelling of --ckpt-format torch_dist.", const="torch_dist"),
    # Stopping early.
    _impl("--exit-signal-handler", "train.runtime.exit_signal_handler", None,
          "On SIGTERM (SLURM pre-emption): finish the iteration, save (with --save) and exit 0."),
    _impl("--exit-duration-in-mins", "train.runtime.exit_duration_in_mins", int,
          "Save (with --save) and exit 0 once the run has trained this long."),
    _impl("--distributed-timeout-minutes", "train.runtime.distributed_timeout_minutes", float,
          "How long a collective waits for a rank that stopped answering (default 10): each "
          "rank's heartbeat (gloo and NCCL) ends every live rank with one line naming the "
          "silent ranks once their heartbeat has been silent for half of this, before NCCL's "
          "watchdog would; exit 1."),
    _impl("--exit-interval", "train.runtime.exit_interval", int,
          "Save (with --save) and exit 0 at the first iteration that is a multiple of this."),
    # Logging.
    _impl("--tensorboard-dir", "train.logging.tensorboard_dir", str,
          "TensorBoard scalars (rank 0): loss, lr, grad norm, loss scale, throughput, peak "
          "memory, per-phase times, validation loss and perplexity. Needs the tensorboard "
          "package."),
    # Our own flags.
    _ours("--model-preset", None, str,
          "Start from a named architecture (megadomino.config.PRESETS); explicit shape flags "
          "override its fields.", group="model"),
    _ours("--peak-tflops", "train.logging.peak_tflops", float,
          "Per-GPU peak TFLOP/s that MFU is measured against (default: the GPU's dense bf16 "
          "peak, 989 on H100 SXM and H200, 312 on A100; on other GPUs no MFU is logged)."),
    _ours("--gpus-per-node", "parallel.gpus_per_node", int,
          "GPUs per node for node-aware groups (hpZ's partition, qgZ's two all-to-alls, the "
          "intra/inter-node byte counts); default LOCAL_WORLD_SIZE. Smaller lets one host stand "
          "in for several nodes."),
    _ours("--domino", "parallel.domino.batch_slices", None,
          "Domino, the plan measured best at start-up: plain TP, Domino's unsliced explicit "
          "backward and a few (batch x hidden) slicings are timed on the real shapes, rank 0 "
          "picks the fastest, broadcasts and prints it (same as --domino-batch-slices auto). "
          "Measured: slicing the batch costs more than it hides; the fastest TP path is "
          "--sequence-parallel --tp-comm-overlap --enable-cuda-graph (BENCHMARKS.md).",
          const="auto"),
    _ours("--domino-batch-slices", "parallel.domino.batch_slices", _slices_or_auto,
          "Domino: slices of each layer's batch whose TP all-reduces overlap compute (1 = off). "
          "'auto': as --domino."),
    _ours("--domino-hidden-slices", "parallel.domino.hidden_slices", int,
          "Domino: chunks of the MLP's hidden dim (1 = off)."),
    _ours("--domino-explicit-backward", "parallel.domino.explicit_backward", None,
          "Domino's schedule without slicing: each linear's weight-gradient GEMM runs behind its "
          "input-gradient all-reduce (the Domino plan that measured fastest)."),
    _ours("--compile-layer-pieces", "parallel.compile_layer_pieces", None,
          "Compile each element-wise piece of the layers (bias + dropout + residual add, norms, "
          "GELU / SwiGLU with fc1's bias, rotary) and of the loss with torch.compile, one region "
          "per piece: fused kernels where eager runs several; on CUDA GELU's backward sums fc1's "
          "bias gradient in one Triton kernel, and with --fp8-format each operand's cast, "
          "transpose and amax are one Triton kernel. Composes with every execution path; "
          "compile time is printed at start-up (megadomino/models/elementwise.py)."),
    _impl("--tp-comm-overlap", "parallel.tp_comm_overlap", None,
          "With --sequence-parallel: the all-gather / reduce-scatter fused into the GEMMs (torch "
          "symmetric-memory kernels, NVLink copy engines). Host-bound in eager mode: use it with "
          "--enable-cuda-graph, where it is the fastest TP path measured (BENCHMARKS.md)."),
    _impl("--enable-cuda-graph", "parallel.enable_cuda_graph", None,
          "Capture the transformer layers' forward + backward of a micro-batch in CUDA graphs at "
          "start-up and replay them (megadomino/overlap/cuda_graph.py): host launch time drops "
          "out of the step; dropout is captured too (the RNG streams are registered with the "
          "graphs), and with a Domino plan its sliced schedule is what is captured (with its "
          "collectives at TP >= 2: run on NCCL at TP 2 and 4); FP8 linears are captured with "
          "their casts and scaling (each replay casts the weights): FP8's host time drops out "
          "with the rest. The graphs are freed at the end of the run, before the process group. "
          "Needs CUDA, no recompute, no ZeRO stage 3, no --domino-batch-slices auto, no "
          "--fp8-param-gather. With "
          "--sequence-parallel --tp-comm-overlap it is the fastest TP path measured "
          "(BENCHMARKS.md)."),
    # ZeRO and ZeRO++ (megadomino.zero).
    _impl("--use-distributed-optimizer", None, None,
          "Shard the optimizer states and fp32 master weights over the data-parallel ranks "
          "(ZeRO stage 1: gradients reduce-scattered, parameters all-gathered after the step); "
          "the same as --zero-stage 1.", group="parallel.zero"),
    _ours("--zero-stage", "parallel.zero.stage", int,
          "ZeRO over the data-parallel group (Megatron-DeepSpeed's name): 0 is plain data "
          "parallelism (the default), 1 shards optimizer states and fp32 masters, 3 "
          "parameters and gradients too (each layer gathered just before use, the next one "
          "prefetched). Not with Domino at 3. Checkpoints add one optim_dp_rank_YYY.pt per "
          "data-parallel rank.", choices=(0, 1, 2, 3), supported=(0, 1, 3),
          unsupported="ZeRO stage 2 (sharded gradients, replicated parameters) is not "
                      "implemented: stage 1 shards the optimizer, stage 3 the parameters and "
                      "gradients too; use 1 or 3"),
    _ours("--zeropp-quantized-weights", "parallel.zero.quantized_weights", None,
          "ZeRO++ qwZ (--zero-stage 3): the forward all-gather sends int8 block-quantized "
          "weights."),
    _ours("--zeropp-hpz-partition-size", "parallel.zero.hpz_partition_size", int,
          "ZeRO++ hpZ (--zero-stage 3): 1 (off) or the data-parallel ranks per node "
          "(--gpus-per-node / tensor-parallel size), which then keep a secondary copy of each "
          "gathered layer so that backward gathers inside the node."),
    _ours("--zeropp-quantized-gradients", "parallel.zero.quantized_gradients", None,
          "ZeRO++ qgZ (--zero-stage 1 or 3): the gradient reduce-scatter becomes a quantized "
          "all-to-all inside the node, then across nodes."),
    _ours("--zeropp-gradient-bits", "parallel.zero.gradient_bits", int,
          "qgZ's gradient precision (default 4); needs --zeropp-quantized-gradients.",
          choices=(4, 8)),
    _ours("--zeropp-block-size", "parallel.zero.block_size", int,
          "Elements per quantization block, one fp32 scale each, for qwZ and qgZ (default "
          "2048, even); needs one of them."),
    _ours("--zeropp-quantize-full-range", "parallel.zero.quantize_full_range", None,
          "qwZ and qgZ quantize as DeepSpeed's quantizer does, with every two's-complement "
          "level (scale absmax / 2^(bits-1), q in [-2^(bits-1), 2^(bits-1) - 1]) instead of the "
          "default symmetric +-(2^(bits-1) - 1): int4's error about 12% lower (BENCHMARKS.md); "
          "needs one of them."),
    _ours("--zero-layers-per-unit", "parallel.zero.layers_per_unit", int,
          "Consecutive layers the ZeRO engine gathers and reduces as one unit (default: as many "
          "as hold --zero-unit-params parameters). More: fewer, larger collectives and kernel "
          "launches, so less host time a step (what a small micro-batch waits on; "
          "BENCHMARKS.md), for more memory (stage 3 holds about two units' gathered weights). "
          "Needs --zero-stage."),
    _ours("--zero-unit-params", "parallel.zero.unit_params", _count,
          "Without --zero-layers-per-unit: a ZeRO unit takes consecutive layers until it holds "
          "this many parameters per GPU (default 2e8, like DeepSpeed's bucket sizes) or a sixth "
          "of the layers, so that at least six units pipeline (four layers of GPT-3 1.3B, one "
          "from 6.7B up). Needs --zero-stage."),
    # DiLoCo across slow links (megadomino.zero.diloco).
    _ours("--diloco-inner-steps", "parallel.diloco.inner_steps", int,
          "DiLoCo: the data-parallel ranks are cut into sites (--diloco-sites; default one a "
          "node, as --gpus-per-node cuts them); inside a site the engine trains as always "
          "(ZeRO over the site's ranks, nothing crosses the sites), and after every H inner "
          "steps one outer Nesterov step on the sites' averaged pseudo-gradients (the last "
          "global weights minus a site's) makes them alike again, each pipeline stage syncing "
          "its own parameters; the replicas' checksums are then compared (a difference stops "
          "the run). Checkpoints add one diloco_dp_rank_YYY.pt per data-parallel rank "
          "(megadomino/zero/diloco.py)."),
    _ours("--diloco-sites", "parallel.diloco.sites", int,
          "DiLoCo: sites, each a run of consecutive data-parallel ranks (default: one a node); "
          "must divide the data-parallel size. Needs --diloco-inner-steps."),
    _ours("--diloco-outer-lr", "parallel.diloco.outer_lr", float,
          "DiLoCo's outer learning rate (default 0.7, DiLoCo's). With --diloco-outer-momentum 0, "
          "1.0 sets the weights to the sites' mean every H steps: from scratch over tens of outer "
          "steps that kept the loss within 2% of plain DP's where the defaults lost 11% "
          "(BENCHMARKS.md). Needs --diloco-inner-steps."),
    _ours("--diloco-outer-momentum", "parallel.diloco.outer_momentum", float,
          "DiLoCo's outer Nesterov momentum (default 0.9, DiLoCo's; 0: SGD on the averaged "
          "pseudo-gradients). Needs --diloco-inner-steps."),
    _ours("--diloco-pseudo-grad-dtype", "parallel.diloco.pseudo_grad_dtype", str,
          "What crosses the sites: fp32, bf16 (the default, half fp32's bytes) or int8 "
          "(block-quantized with one fp32 scale per 2048 elements, about a quarter). Needs "
          "--diloco-inner-steps.", choices=PSEUDO_GRAD_DTYPES),
    # Accepted with a notice.
    _notice("--use-flash-attn", _SDPA),
    _notice("--attention-backend", _SDPA, str),
    _notice("--no-masked-softmax-fusion", "no masked-softmax kernel: SDPA applies the causal mask"),
    _notice("--attention-softmax-in-fp32", "SDPA picks the softmax precision (fp32 accumulation)"),
    _notice("--no-bias-gelu-fusion", _NO_KERNEL),
    _notice("--no-bias-swiglu-fusion", _NO_KERNEL),
    _notice("--no-bias-dropout-fusion", _NO_KERNEL),
    _notice("--no-rope-fusion", _NO_KERNEL),
    _notice("--no-persist-layer-norm", _NO_KERNEL),
    _impl("--no-gradient-accumulation-fusion", "parallel.gradient_accumulation_fusion", None,
          "Weight gradients as separate bf16 GEMMs added into the fp32 gradient buffers, not "
          "accumulated there by the GEMM (the default, as in Megatron-LM: ZeRO stages 0 and 1; "
          "Domino, FP8 and --tp-comm-overlap linears always return theirs).", const=False),
    _notice("--cross-entropy-loss-fusion", "the vocab-parallel cross-entropy is always used"),
    _impl("--overlap-param-gather", "parallel.zero.overlap_param_gather", None,
          "With --use-distributed-optimizer (--zero-stage 1): the all-gather of the new weights "
          "runs behind the next forward, each unit waited on just before its first use."),
    _notice("--overlap-grad-reduce",
            "the data-parallel all-reduce always overlaps the backward, bucket by bucket"),
    _notice("--accumulate-allreduce-grads-in-fp32",
            "gradients always accumulate and all-reduce in fp32 buffers"),
    _notice("--use-mcore-models", "megadomino has one model implementation"),
    _notice("--use-legacy-models", "megadomino has one model implementation"),
    _notice("--transformer-impl", "megadomino has one model implementation (no Transformer Engine)",
            str, choices=("local", "transformer_engine")),
    _notice("--distributed-backend", "the backend is chosen for you: nccl with CUDA, gloo without",
            str, choices=("nccl", "gloo")),
    _notice("--no-async-tensor-model-parallel-allreduce",
            "deprecated in Megatron-LM; TP communication overlap here is Domino's (--domino)"),
    _notice("--no-create-attention-mask-in-dataloader", "no attention mask is ever materialized"),
    _notice("--num-workers", "samples are read in-process from memory-mapped files (mock data is "
            "computed): there are no loader workers", int),
    _notice("--log-throughput", "throughput (tokens/s, TFLOP/s/GPU, MFU) is on every log line"),
    _notice("--timing-log-level", "the data, forward, backward and optimizer times are on every "
            "log line", int),
    _notice("--log-timers-to-tensorboard", _TENSORBOARD),
    _notice("--log-validation-ppl-to-tensorboard", _TENSORBOARD),
    _notice("--log-memory-to-tensorboard", _TENSORBOARD),
    _notice("--tensorboard-log-interval", _TENSORBOARD, int),
    _notice("--local-rank", "the local rank is read from LOCAL_RANK (the deepspeed launcher's "
            "--local_rank=N is read as this flag)", int),
    _notice("--empty-unused-memory-level", "the CUDA caching allocator's cache is not emptied "
            "between steps (a memory knob only)", int),
    _notice("--no-mmap-bin-files", ".bin files are always memory-mapped"),
    _notice("--data-impl", "indexed datasets are always read memory-mapped (Megatron-LM's mmap "
            "format; the flag was removed from Megatron-LM)", str),
    _notice("--no-query-key-layer-scaling", "query-key layer scaling is never applied (as in "
            "Megatron-LM, which removed the flag)"),
    _impl("--grad-reduce-in-bf16", "parallel.zero.reduce_dtype", None,
          "With --use-distributed-optimizer or --zero-stage 1/3: the gradient reduce-scatter "
          "sends bf16 (accumulated and kept in fp32 either way). At --zero-stage 0 gradients "
          "are reduced in fp32 (a notice says so).", const="bfloat16"),
    _notice("--log-num-zeros-in-grad", "the count of zero gradients is not logged; the "
            "gradient norm is, on every log line"),
    _notice("--log-params-norm", "the parameter norm is not logged; the gradient norm is, on "
            "every log line"),
    _notice("--tiktoken-pattern", "read only by the tiktoken tokenizer, which is not implemented",
            _value),
    _impl("--profile", "train.logging.profile", None,
          "Profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks: "
          "with --use-pytorch-profiler a torch.profiler Chrome trace in --tensorboard-dir (or "
          "./profile), else cudaProfilerStart/Stop for nsys (megadomino/train/profiling.py)."),
    _impl("--profile-step-start", "train.logging.profile_step_start", int,
          "First profiled iteration (default 10)."),
    _impl("--profile-step-end", "train.logging.profile_step_end", int,
          "Iteration the profile stops before (default 12)."),
    _impl("--profile-ranks", "train.logging.profile_ranks", int, "Ranks that profile (default 0).",
          nargs="+"),
    _impl("--use-pytorch-profiler", "train.logging.use_pytorch_profiler", None,
          "With --profile: torch.profiler's trace instead of the CUDA profiler API."),
    # Refused, with the reason.
    Flag("--context-parallel-size", REFUSED, "context parallelism is not implemented", type=int,
         supported=(1,)),
    Flag("--expert-model-parallel-size", REFUSED, MOE, type=int, supported=(1,)),
    Flag("--rotary-percent", REFUSED, "partial rotary embeddings are not implemented", type=float,
         supported=(1.0,)),
    *_refuse(("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-grouped-gemm",
              "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
              "--moe-token-dispatcher-type", "--expert-tensor-parallel-size"), MOE),
    *_refuse(("--num-virtual-stages-per-pipeline-rank",),
             "use --virtual-pipeline-model-parallel-size (model chunks per pipeline stage)"),
    *_refuse(("--pretrained-checkpoint",), "use --load DIR --finetune"),
    *_refuse(("--use-checkpoint-args",),
             "the architecture comes from the flags; a checkpoint that disagrees is an error "
             "naming the field"),
    _impl("--async-save", "train.checkpoint.async_save", None,
          "With --save: a background thread writes each checkpoint from a CPU snapshot while "
          "training goes on; the same atomic files and manifest, the latest only once its "
          "weights gave a finite loss, one save in flight, finished before exit."),
    *_refuse(("--train-data-path", "--valid-data-path", "--test-data-path"),
             "separate per-split datasets are not implemented: use --data-path with --split"),
    *_refuse(("--use-torch-fsdp2", "--use-megatron-fsdp"),
             "FSDP is not implemented; --zero-stage 3 shards parameters, gradients and optimizer "
             "states over the data-parallel ranks"),

    *_refuse(("--loss-scale",), "a static loss scale is not implemented (--fp16 is dynamic)"),
    *_refuse(("--qk-layernorm",), "QK normalization is not implemented"),
    *_refuse(("--apply-residual-connection-post-layernorm",),
             "post-norm residuals are not implemented (blocks are pre-norm)"),
    *_refuse(("--add-qkv-bias",), "a QKV-only bias is not implemented (see --disable-bias-linear)"),
    *_refuse(("--squared-relu", "--openai-gelu", "--quick-geglu"),
             "only GELU and SwiGLU MLPs are implemented"),
    *_refuse(("--rotary-interleaved", "--use-rope-scaling",
              "--rotary-seq-len-interpolation-factor"), "only plain, unscaled RoPE is implemented"),
    *_refuse(("--multi-latent-attention",), "multi-latent attention is not implemented"),
    *_refuse(("--init-method-xavier-uniform", "--embedding-init-method-std"),
             "only normal init with --init-method-std is implemented"),
    *_refuse(("--distribute-saved-activations",), "distributed activation recompute is not "
             "implemented"),
    *MEGATRON_ROWS,
    *MEGATRON_CONFIG_ROWS,
)

FINETUNE_FLAGS: tuple[Flag, ...] = (
    _ours("--hf-checkpoint", "train.checkpoint.hf_checkpoint", str,
          "Start from this Hugging Face Llama directory (config.json + safetensors); it also "
          "gives the architecture, which explicit shape flags may only repeat."),
    _ours("--prompt-template", "train.data.prompt_template", str,
          "How a prompt is laid out before its response, with {prompt} where it goes, e.g. "
          "'[INST] {prompt} [/INST]' (default '{prompt}')."),
)
"""finetune_llama.py's flags, beside FLAGS."""


_POSITIVE_COUNT = Range(1)
_NON_NEGATIVE = Range(0)
_POSITIVE = Range(0, low_inclusive=False)
_PROBABILITY = Range(0, 1, high_inclusive=False)
_FP32_FINITE = Range(0, 3.0e38, high_inclusive=False)  # beyond, fp32 state overflows

RANGES: dict[str, Range] = {
    **dict.fromkeys(("--num-layers", "--hidden-size", "--ffn-hidden-size",
                     "--num-attention-heads", "--num-query-groups", "--num-key-value-heads",
                     "--kv-channels", "--seq-length", "--max-position-embeddings", "--vocab-size",
                     "--make-vocab-size-divisible-by", "--tensor-model-parallel-size",
                     "--pipeline-model-parallel-size", "--recompute-num-layers",
                     "--virtual-pipeline-model-parallel-size",
                     "--num-layers-per-virtual-pipeline-stage",
                     "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                     "--ddp-bucket-size", "--micro-batch-size", "--global-batch-size",
                     "--train-iters", "--train-samples", "--lr-decay-iters",
                     "--loss-scale-window", "--hysteresis", "--log-interval", "--eval-interval",
                     "--save-interval", "--exit-interval", "--gpus-per-node", "--nics-per-node",
                     "--domino-hidden-slices", "--zeropp-hpz-partition-size",
                     "--zeropp-block-size", "--zero-layers-per-unit", "--zero-unit-params",
                     "--tensorboard-log-interval", "--fp8-amax-history-len", "--fp8-interval",
                     "--lr-decay-samples", "--lr-wsd-decay-iters", "--lr-wsd-decay-samples",
                     "--rampup-batch-size"),
                    _POSITIVE_COUNT),
    "--eval-iters": Range(-1),
    "--diloco-inner-steps": _POSITIVE_COUNT,
    "--diloco-sites": Range(2),
    "--pipeline-codec-density": Range(0, 1, low_inclusive=False),
    "--pipeline-codec-interval": Range(0),
    "--diloco-outer-lr": _POSITIVE,
    "--diloco-outer-momentum": _PROBABILITY,
    **dict.fromkeys(("--lr-warmup-iters", "--seed", "--num-workers",
                     "--exit-duration-in-mins", "--local-rank", "--clip-grad", "--fp8-margin",
                     "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16",
                     "--lr-warmup-samples", "--pipeline-link-delay"),
                    _NON_NEGATIVE),
    **dict.fromkeys(("--rotary-base", "--norm-epsilon", "--init-method-std", "--adam-eps",
                     "--initial-loss-scale", "--min-loss-scale", "--peak-tflops",
                     "--distributed-timeout-minutes"), _POSITIVE),
    **dict.fromkeys(("--hidden-dropout", "--attention-dropout", "--adam-beta1", "--adam-beta2",
                     "--sgd-momentum"), _PROBABILITY),
    **dict.fromkeys(("--lr", "--min-lr", "--weight-decay", "--decoupled-lr",
                     "--decoupled-min-lr"), _FP32_FINITE),
    "--lr-warmup-fraction": Range(0, 1),
    "--layernorm-epsilon": _POSITIVE,
    **dict.fromkeys(("--manual-gc-interval", "--profile-step-start", "--profile-step-end",
                     "--profile-ranks"), _NON_NEGATIVE),
    "--empty-unused-memory-level": Range(0, 2),
    "--timing-log-level": Range(0, 2),
}
"""The range of every numeric flag that is not refused and has no list of choices
(tests/test_arguments.py checks each has one and that a value outside it is refused naming
the flag)."""
