"""Megatron-LM's command line, mapped onto ModelConfig and TrainConfig by one explicit flag policy.

Every flag megadomino knows is a row of `FLAGS`, under one of four policies:

    implemented  a Megatron-LM flag that works as in Megatron-LM (a few values may be refused)
    ours         one of megadomino's own flags
    notice       a Megatron-LM flag for something we always do, or that means nothing here:
                 accepted, and reported in a one-line notice
    refused      a Megatron-LM flag for a feature we lack: an error that says why (where a value
                 asks for nothing, such as a parallel size of 1, it is accepted)

Anything else is an error naming the flag. `docs/flags.md` holds the same table, rendered by
`render_flag_table()`; a test keeps the two equal. Every check here is pure arithmetic on the
flags, so every rank refuses alike before any process group exists.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from megadomino.config import ConfigError, ModelConfig, TrainConfig
from megadomino.parallel.dims import check_degrees, check_gpus_per_node

IMPLEMENTED, OURS, NOTICE, REFUSED = "implemented", "ours", "notice", "refused"


@dataclass(frozen=True)
class Flag:
    """One row of the flag policy."""

    name: str
    policy: str
    text: str
    """What the flag does (implemented, ours), the notice (notice) or the reason (refused)."""
    field: str | None = None
    """'model.<ModelConfig field>' or 'train.<TrainConfig field>'; None: parse_args handles it."""
    type: Callable[[str], Any] | None = None
    """Parses the value; None for a switch, which stores `const` (refused switches swallow
    whatever values follow them)."""
    const: Any = True
    choices: tuple | None = None
    supported: tuple | None = None
    """Values that work; any other is refused, with `text` (refused) or `unsupported`."""
    unsupported: str = ""

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def metavar(self) -> str:
        if self.choices is not None:
            return "{" + ",".join(str(c) for c in self.choices) + "}"
        if self.type is None:
            return "..." if self.policy == REFUSED else ""
        return {int: "N", float: "X"}.get(self.type, "NAME")

    def refusal(self, value: Any) -> str | None:
        """Why the flag given with `value` is refused, or None when it works."""
        if self.supported is not None and value in self.supported:
            return None
        if self.policy == REFUSED:
            return self.text
        return self.unsupported if self.supported is not None else None


def _impl(name: str, field: str | None, type_: Callable | None, text: str, **kw) -> Flag:
    return Flag(name, IMPLEMENTED, text, field, type_, **kw)


def _ours(name: str, field: str | None, type_: Callable | None, text: str, **kw) -> Flag:
    return Flag(name, OURS, text, field, type_, **kw)


def _notice(name: str, text: str, type_: Callable | None = None, **kw) -> Flag:
    return Flag(name, NOTICE, text, None, type_, **kw)


def _refuse(names: tuple[str, ...], text: str) -> list[Flag]:
    return [Flag(name, REFUSED, text) for name in names]


_NO_KERNEL = "there is no such fused kernel here, so nothing to disable"
_SDPA = "attention always runs through torch SDPA, which picks flash attention where it can"
_CKPT = "checkpointing is not implemented yet"
_DATA = "real datasets arrive with the training-system issue; use --mock-data"
_TOKENIZER = ("tokenizers arrive with the training-system issue; with --mock-data set the "
              "vocabulary with --vocab-size")
_MOE = "Mixture-of-Experts is not implemented"

FLAGS: tuple[Flag, ...] = (
    # Model shape. Later rows win over earlier ones they overlap, as in Megatron-LM.
    _impl("--num-layers", "model.num_layers", int, "Transformer layers."),
    _impl("--hidden-size", "model.hidden_size", int, "Hidden size."),
    _impl("--ffn-hidden-size", "model.ffn_hidden_size", int,
          "MLP hidden size; default 4 x hidden, or int(8 x hidden / 3 / 64) x 64 with --swiglu."),
    _impl("--num-attention-heads", "model.num_attention_heads", int, "Attention heads."),
    _impl("--group-query-attention", None, None,
          "Grouped-query attention with --num-query-groups groups; alone it means 1 group "
          "(multi-query), as in Megatron-LM."),
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
          "Vocabulary before padding; default the preset's, else the family tokenizer's "
          "(GPT-2 50257, Llama-2 32000)."),
    _impl("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by", int,
          "Pad the vocabulary to a multiple of this times TP."),
    # Parallelism and memory.
    _impl("--tensor-model-parallel-size", "train.tensor_model_parallel_size", int,
          "Tensor-parallel degree."),
    _impl("--pipeline-model-parallel-size", "train.pipeline_model_parallel_size", int,
          "Pipeline-parallel degree.", supported=(1,),
          unsupported="pipeline parallelism is not implemented yet"),
    _impl("--sequence-parallel", "model.sequence_parallel", None,
          "Shard norm and dropout activations over TP ranks; dropped with a notice at TP 1, as in "
          "Megatron-LM."),
    _impl("--recompute-granularity", "model.recompute_granularity", str,
          "Recompute whole layers (full) or the attention core (selective).",
          choices=("full", "selective")),
    _impl("--recompute-method", "model.recompute_method", str,
          "Which layers full recompute covers.", choices=("uniform", "block")),
    _impl("--recompute-num-layers", "model.recompute_num_layers", int,
          "Layers per recompute chunk (uniform) or recomputed layers (block)."),
    _impl("--recompute-activations", "model.recompute_granularity", None,
          "Megatron-LM's shorthand for --recompute-granularity selective.", const="selective"),
    _impl("--ddp-bucket-size", "train.ddp_bucket_size", int,
          "Elements per data-parallel all-reduce bucket."),
    # Batch, optimizer and schedule.
    _impl("--micro-batch-size", "train.micro_batch_size", int, "Samples per forward (default 1)."),
    _impl("--global-batch-size", "train.global_batch_size", int,
          "Samples per step; default micro x DP. Must be a multiple of micro x DP."),
    _impl("--train-iters", "train.train_iters", int, "Run length in steps (or --train-samples)."),
    _impl("--train-samples", "train.train_samples", int, "Run length in samples."),
    _impl("--optimizer", None, str, "Optimizer.", choices=("adam", "sgd", "muon", "dist_muon"),
          supported=("adam",),
          unsupported="only Adam (AdamW, like Megatron-LM's adam) is implemented"),
    _impl("--lr", "train.lr", float, "Peak learning rate (default 1e-4)."),
    _impl("--min-lr", "train.min_lr", float, "Learning rate at the end of decay."),
    _impl("--lr-decay-style", "train.lr_decay_style", str,
          "Decay shape (default linear, as in Megatron-LM).",
          choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
          supported=("constant", "linear", "cosine"),
          unsupported="only constant, linear and cosine decay are implemented"),
    _impl("--lr-decay-iters", "train.lr_decay_iters", int, "Decay length; default the whole run."),
    _impl("--lr-warmup-iters", "train.lr_warmup_iters", int, "Linear warmup steps."),
    _impl("--lr-warmup-fraction", "train.lr_warmup_fraction", float,
          "Warmup as a fraction of the decay steps."),
    _impl("--weight-decay", "train.weight_decay", float, "AdamW weight decay."),
    _impl("--adam-beta1", "train.adam_beta1", float, "Adam beta1."),
    _impl("--adam-beta2", "train.adam_beta2", float, "Adam beta2."),
    _impl("--adam-eps", "train.adam_eps", float, "Adam epsilon."),
    _impl("--clip-grad", "train.clip_grad", float, "Global gradient-norm clip (0 = off)."),
    # Precision.
    _impl("--bf16", "train.bf16", None, "bf16 parameters, fp32 main grads and master weights."),
    _impl("--fp16", "train.fp16", None, "fp16 parameters with dynamic loss scaling."),
    _impl("--initial-loss-scale", "train.initial_loss_scale", float, "fp16: first loss scale."),
    _impl("--min-loss-scale", "train.min_loss_scale", float, "fp16: loss-scale floor."),
    _impl("--loss-scale-window", "train.loss_scale_window", int,
          "fp16: clean steps before the scale grows."),
    _impl("--hysteresis", "train.hysteresis", int, "fp16: overflows tolerated before shrinking."),
    # Seed, logging, evaluation, data.
    _impl("--seed", "train.seed", int, "Random seed."),
    _impl("--log-interval", "train.log_interval", int, "Steps between log lines."),
    _impl("--eval-interval", "train.eval_interval", int, "Steps between evaluations."),
    _impl("--eval-iters", "train.eval_iters", int, "Batches per evaluation."),
    _impl("--mock-data", "train.mock_data", None,
          "Learnable synthetic data (required until real datasets arrive)."),
    # Our own flags.
    _ours("--model-preset", None, str,
          "Start from a named architecture (megadomino.config.PRESETS); explicit shape flags "
          "override its fields."),
    _ours("--peak-tflops", "train.peak_tflops", float,
          "Per-GPU peak TFLOP/s that MFU is measured against (default 989, H100/H200 bf16)."),
    _ours("--gpus-per-node", "train.gpus_per_node", int,
          "GPUs per node for node-aware groups; default LOCAL_WORLD_SIZE. Smaller lets one host "
          "stand in for several nodes."),
    _ours("--domino", "model.domino_batch_slices", None,
          "Domino overlap with 2 batch slices (same as --domino-batch-slices 2).", const=2),
    _ours("--domino-batch-slices", "model.domino_batch_slices", int,
          "Domino: slices of each layer's batch whose TP all-reduces overlap compute (1 = off)."),
    _ours("--domino-hidden-slices", "model.domino_hidden_slices", int,
          "Domino: chunks of the MLP's hidden dim (1 = off)."),
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
    _notice("--no-gradient-accumulation-fusion", _NO_KERNEL),
    _notice("--cross-entropy-loss-fusion", "the vocab-parallel cross-entropy is always used"),
    _notice("--overlap-grad-reduce",
            "the data-parallel all-reduce always overlaps the backward, bucket by bucket"),
    _notice("--accumulate-allreduce-grads-in-fp32",
            "gradients always accumulate and all-reduce in fp32 main_grad buffers"),
    _notice("--use-distributed-optimizer",
            "accepted, but optimizer state is not sharded yet: every DP rank holds all of it "
            "(ZeRO arrives with a later issue)"),
    _notice("--use-mcore-models", "megadomino has one model implementation"),
    _notice("--use-legacy-models", "megadomino has one model implementation"),
    _notice("--transformer-impl", "megadomino has one model implementation (no Transformer Engine)",
            str, choices=("local", "transformer_engine")),
    _notice("--distributed-backend", "the backend is chosen for you: nccl with CUDA, gloo without",
            str, choices=("nccl", "gloo")),
    _notice("--no-async-tensor-model-parallel-allreduce",
            "deprecated in Megatron-LM; TP communication overlap here is Domino's (--domino)"),
    _notice("--no-create-attention-mask-in-dataloader", "no attention mask is ever materialized"),
    _notice("--num-workers", "mock data is generated in-process: there are no loader workers", int),
    _notice("--local-rank", "the local rank is read from LOCAL_RANK", int),
    # Refused, with the reason.
    Flag("--context-parallel-size", REFUSED, "context parallelism is not implemented", type=int,
         supported=(1,)),
    Flag("--expert-model-parallel-size", REFUSED, _MOE, type=int, supported=(1,)),
    Flag("--rotary-percent", REFUSED, "partial rotary embeddings are not implemented", type=float,
         supported=(1.0,)),
    *_refuse(("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-grouped-gemm",
              "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
              "--moe-token-dispatcher-type", "--expert-tensor-parallel-size"), _MOE),
    *_refuse(("--virtual-pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
              "--num-virtual-stages-per-pipeline-rank"),
             "pipeline parallelism (interleaved or not) is not implemented yet"),
    *_refuse(("--fp8-format", "--fp8-recipe", "--fp8-param-gather"),
             "FP8 training is not implemented"),
    *_refuse(("--save", "--load", "--save-interval", "--finetune", "--pretrained-checkpoint",
              "--ckpt-format", "--no-load-optim", "--no-load-rng", "--no-save-optim",
              "--no-save-rng", "--use-checkpoint-args", "--exit-on-missing-checkpoint"), _CKPT),
    *_refuse(("--data-path", "--split", "--train-data-path", "--valid-data-path",
              "--test-data-path", "--data-cache-path"), _DATA),
    *_refuse(("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file"),
             _TOKENIZER),
    *_refuse(("--tensorboard-dir",), "TensorBoard logging arrives with the training-system issue"),
    *_refuse(("--wandb-project",), "Weights & Biases logging is not implemented"),
    *_refuse(("--zero-stage",), "ZeRO arrives with the ZeRO++ issue (a megadomino flag, reserved)"),
    *_refuse(("--use-torch-fsdp2", "--use-megatron-fsdp"),
             "FSDP is not implemented; ZeRO arrives with the ZeRO++ issue"),
    *_refuse(("--tp-comm-overlap",),
             "Transformer Engine's GEMM overlap is not used: TP overlap here is --domino"),
    *_refuse(("--rampup-batch-size",), "batch-size ramp-up is not implemented"),
    *_refuse(("--lr-decay-samples", "--lr-warmup-samples"),
             "sample-based LR schedules are not implemented: use --lr-decay-iters and "
             "--lr-warmup-iters with --train-iters"),
    *_refuse(("--loss-scale",), "a static loss scale is not implemented (--fp16 is dynamic)"),
    *_refuse(("--qk-layernorm",), "QK normalization is not implemented"),
    *_refuse(("--apply-layernorm-1p",), "zero-centred norm weights are not implemented"),
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
)

FAMILY_DEFAULTS: dict[str, dict] = {
    "gpt": dict(normalization="LayerNorm", swiglu=False, position_embedding_type="learned_absolute",
                add_bias_linear=True, untie_embeddings_and_output_weights=False,
                hidden_dropout=0.1, attention_dropout=0.1, vocab_size=50257),
    "llama": dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                  add_bias_linear=False, untie_embeddings_and_output_weights=True,
                  hidden_dropout=0.0, attention_dropout=0.0, vocab_size=32000),
}
"""What each entry script builds when no --model-preset says otherwise."""

_REQUIRED_WITHOUT_PRESET = ("--num-layers", "--hidden-size", "--num-attention-heads",
                            "--seq-length")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so callers choose how to fail."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser(family: str) -> argparse.ArgumentParser:
    """The argparse parser for FLAGS (no abbreviations: a prefix is an unknown flag)."""
    parser = _Parser(prog=f"pretrain_{family}.py", allow_abbrev=False,
                     description=f"Pretrain a {family} model with Megatron-LM's flags; the flag "
                                 "policy is in docs/flags.md.")
    for flag in FLAGS:
        kwargs: dict[str, Any] = dict(dest=flag.dest, default=None,
                                      help=f"[{flag.policy}] {flag.text}".replace("%", "%%"))
        if flag.type is not None:
            kwargs.update(type=flag.type, choices=flag.choices, metavar=flag.metavar)
        elif flag.policy == REFUSED:
            kwargs.update(nargs="*", metavar="VALUE")
        else:
            kwargs.update(action="store_const", const=flag.const)
        parser.add_argument(flag.name, **kwargs)
    return parser


def parse_args(argv: list[str] | None, family: str) -> tuple[ModelConfig, TrainConfig, list[str]]:
    """Parse Megatron-LM flags (argv None: sys.argv[1:]) for a 'gpt' or 'llama' model.

    Returns the configs and the notices to print once (rank 0). Raises ConfigError naming the flag
    for an unknown flag, a refused one, or a combination that cannot run at its TP size.
    """
    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"family must be one of {sorted(FAMILY_DEFAULTS)}, not {family!r}")
    args, extras = build_parser(family).parse_known_args(argv)
    _refuse_unknown(extras)
    given = {flag: getattr(args, flag.dest) for flag in FLAGS
             if getattr(args, flag.dest) is not None}
    for flag, value in given.items():
        reason = flag.refusal(value)
        if reason is not None:
            shown = flag.name if flag.type is None else f"{flag.name}={value}"
            raise ConfigError(f"{shown} is refused: {reason}")
    notices = [f"{flag.name}: {flag.text}" for flag in given if flag.policy == NOTICE]
    fields: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for flag, value in given.items():  # in FLAGS order: later rows win
        if flag.field is not None:
            target, name = flag.field.split(".")
            fields[target][name] = value
    train_fields = {"lr_decay_style": "linear", **fields["train"]}  # Megatron-LM's default
    train_config = TrainConfig(**train_fields)
    _check_train(train_config)
    tp = train_config.tensor_model_parallel_size
    notices += _apply_model_rules(args.group_query_attention, fields["model"], tp)
    if args.model_preset is not None:
        model_config = ModelConfig.preset(args.model_preset, **fields["model"])
    else:
        missing = [f.name for f in FLAGS if f.name in _REQUIRED_WITHOUT_PRESET and f not in given]
        if missing:
            raise ConfigError(f"{', '.join(missing)} required (or give --model-preset NAME)")
        model_config = ModelConfig(**{**FAMILY_DEFAULTS[family], **fields["model"]})
    model_config.validate(tp=tp)
    return model_config, train_config, notices


def validate_world(model_config: ModelConfig, train_config: TrainConfig, world_size: int) -> None:
    """Raise ConfigError naming the flag if the configs cannot run on `world_size` ranks.

    Pure arithmetic, for every rank before the process group is initialised: the world must tile
    into TP x PP x DP, a TP group must fit in --gpus-per-node, the model must shard at this TP,
    and the global batch must be a multiple of micro batch x DP.
    """
    tp = train_config.tensor_model_parallel_size
    pp = train_config.pipeline_model_parallel_size
    dp = world_size // (tp * pp) if tp >= 1 and pp >= 1 and world_size % (tp * pp) == 0 else -1
    check_degrees(world_size, tp, pp, dp)
    if train_config.gpus_per_node is not None:
        check_gpus_per_node(world_size, tp, train_config.gpus_per_node)
    model_config.validate(tp=tp)
    micro = train_config.micro_batch_size
    if micro < 1:
        raise ConfigError(f"--micro-batch-size={micro} is invalid: it must be >= 1")
    global_batch = train_config.global_batch_size
    if global_batch is not None and (global_batch < 1 or global_batch % (micro * dp) != 0):
        raise ConfigError(
            f"--global-batch-size={global_batch} is invalid: it must be a positive multiple of "
            f"--micro-batch-size ({micro}) x data-parallel size ({dp}) = {micro * dp}")


def render_flag_table() -> str:
    """FLAGS as the markdown table docs/flags.md carries."""
    rows = ["| Flag | Policy | Sets | Notes |", "| --- | --- | --- | --- |"]
    for flag in FLAGS:
        usage = f"`{flag.name} {flag.metavar}`" if flag.metavar else f"`{flag.name}`"
        sets = ""
        if flag.field is not None:
            config, name = flag.field.split(".")
            sets = f"`{'ModelConfig' if config == 'model' else 'TrainConfig'}.{name}`"
            if flag.type is None:
                sets += f" = `{flag.const!r}`"
        notes = flag.text
        if flag.supported is not None:
            values = ", ".join(str(v) for v in flag.supported)
            notes += (f" (accepted at {values})" if flag.policy == REFUSED
                      else f" Values other than {values} are refused: {flag.unsupported}.")
        rows.append(f"| {usage} | {flag.policy} | {sets} | {notes} |")
    return "\n".join(rows) + "\n"


def _refuse_unknown(extras: list[str]) -> None:
    if not extras:
        return
    flags = [arg for arg in extras if arg.startswith("-")]
    if not flags:
        raise ConfigError(f"unexpected argument {extras[0]!r}: values follow the flag they set")
    name = flags[0].split("=", 1)[0]
    close = difflib.get_close_matches(name, [flag.name for flag in FLAGS], n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ConfigError(f"unknown flag {name}: megadomino neither implements, accepts nor refuses "
                      f"it (see docs/flags.md){hint}")


def _apply_model_rules(group_query_attention: bool, model_fields: dict[str, Any],
                       tp: int) -> list[str]:
    """Megatron-LM's cross-flag rules for the architecture; edits `model_fields`, returns
    notices."""
    if group_query_attention:
        model_fields.setdefault("num_query_groups", 1)  # Megatron-LM's --num-query-groups default
    elif "num_query_groups" in model_fields:
        raise ConfigError("--num-query-groups is read only with --group-query-attention "
                          "(Megatron-LM would ignore it): add --group-query-attention")
    if model_fields.get("recompute_granularity") == "selective" and model_fields.get(
            "recompute_method"):
        raise ConfigError("--recompute-method applies to --recompute-granularity full only")
    if tp == 1 and model_fields.get("sequence_parallel"):
        model_fields["sequence_parallel"] = False
        return ["--sequence-parallel: dropped, it has no effect with "
                "--tensor-model-parallel-size 1"]
    return []


def _check_train(config: TrainConfig) -> None:
    """Megatron-LM's cross-flag rules for the run length, schedule and precision."""
    if config.bf16 and config.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive: choose one")
    if (config.train_iters is None) == (config.train_samples is None):
        raise ConfigError("give exactly one of --train-iters and --train-samples")
    for name in ("train_iters", "train_samples"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} is invalid: it must be >= 1")
    if config.train_samples is not None and (config.lr_decay_iters is not None
                                             or config.lr_warmup_iters != 0):
        raise ConfigError("--lr-decay-iters and --lr-warmup-iters count steps: with "
                          "--train-samples use --lr-warmup-fraction, or use --train-iters")
    if config.lr_warmup_fraction is not None and config.lr_warmup_iters != 0:
        raise ConfigError("give one of --lr-warmup-fraction and --lr-warmup-iters, not both")
    if not 0.0 <= config.min_lr <= config.lr:
        raise ConfigError(f"--min-lr={config.min_lr} is invalid: it must be in [0, --lr "
                          f"({config.lr})]")
    if not config.mock_data:
        raise ConfigError(f"no data source: {_DATA}")
