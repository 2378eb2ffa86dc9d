"""The validator's rules for the pipeline boundary codecs (--pipeline-codec and its flags,
pipeline/codec.py), checked before any process group, one line naming the flag:

- --pipeline-codec one of PIPELINE_CODECS, --pipeline-codec-values one of CODEC_VALUES,
  0 < --pipeline-codec-density <= 1, --pipeline-codec-interval >= 0 (auto: > 0: it adapts);
- the codec's flags need a codec, and adatopk's (density, values, grad-topk) adatopk or auto;
- a pipeline of Megatron's plan (--pipeline-model-parallel-size > 1): the codec rides the P2P
  transport, whose every message has one size both ends know; --pipeline-plan's resharding
  transport cuts messages into tiles and is refused;
- a hidden size of at most codec.MAX_HIDDEN (one quantization block a token row, int16 row
  indices), and an even one for int4 and auto (two values a byte; adatopk's int4 values pad
  an odd k instead).
Checkpoints hold the codecs' state (train/checkpoint/pipeline_codec.py), so --save and --load
take every codec.
"""

from __future__ import annotations

from megadomino.config.check import ConfigError, check

PIPELINE_CODECS = ("none", "int8", "int4", "adatopk", "auto")
CODEC_VALUES = ("native", "int8", "int4")
MAX_HIDDEN = 16384
DEFAULT_DENSITY = 0.1
DEFAULT_INTERVAL = 10


def check_codec(parallel, model) -> None:
    """The module docstring's rules on a ParallelConfig and its ModelConfig."""
    codec = parallel.pipeline_codec
    check(codec in PIPELINE_CODECS, "--pipeline-codec", codec,
          "one of " + ", ".join(PIPELINE_CODECS))
    check(parallel.pipeline_codec_values in CODEC_VALUES, "--pipeline-codec-values",
          parallel.pipeline_codec_values, "one of " + ", ".join(CODEC_VALUES))
    density = parallel.pipeline_codec_density
    check(0 < density <= 1, "--pipeline-codec-density", density,
          "a share of each row's entries in (0, 1]")
    interval = parallel.pipeline_codec_interval
    check(interval >= 0, "--pipeline-codec-interval", interval,
          "steps >= 0 (0: a fixed codec on every link)")
    check(codec != "auto" or interval > 0, "--pipeline-codec-interval", interval,
          "> 0 with --pipeline-codec auto, which adapts each link's codec")
    topk_flags = (("--pipeline-codec-density", density != DEFAULT_DENSITY),
                  ("--pipeline-codec-values", parallel.pipeline_codec_values != "native"),
                  ("--pipeline-codec-grad-topk", parallel.pipeline_codec_grad_topk))
    any_flags = (("--pipeline-codec-interval", interval != DEFAULT_INTERVAL),
                 ("--pipeline-codec-error-feedback", parallel.pipeline_codec_error_feedback))
    for flag, given in topk_flags + any_flags if codec == "none" else topk_flags:
        if given and codec not in ("adatopk", "auto"):
            needs = "a codec" if (flag, given) in any_flags else "adatopk or auto"
            raise ConfigError(f"{flag} needs --pipeline-codec {needs}: it sets how pipeline "
                              "boundaries are encoded")
    if codec == "none":
        return
    if parallel.pipeline_plan is not None:
        raise ConfigError(f"--pipeline-codec {codec} runs on Megatron's pipeline "
                          "(--pipeline-model-parallel-size): --pipeline-plan's resharding "
                          "transport does not carry encoded messages")
    if parallel.pipeline_model_parallel_size < 2:
        raise ConfigError(f"--pipeline-codec {codec} encodes pipeline boundaries: it needs "
                          "--pipeline-model-parallel-size > 1")
    hidden = model.hidden_size
    check(hidden <= MAX_HIDDEN, "--pipeline-codec", codec,
          f"none with --hidden-size {hidden}: the codecs encode rows of at most {MAX_HIDDEN}")
    check(hidden % 2 == 0 or codec not in ("int4", "auto"), "--pipeline-codec", codec,
          f"none of int4 and auto with the odd --hidden-size {hidden} (int4 packs two values "
          "a byte)")
