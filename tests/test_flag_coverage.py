"""Megatron-LM's whole command line has a row: the vendored names (tests/megatron_flags/), hints,
and the flags launch scripts from Megatron-LM, DeepSpeed-Domino and Megatron-DeepSpeed pass."""

from __future__ import annotations

import functools
import gc
import re
import sys
from pathlib import Path

import pytest

from megadomino.cli.arguments import build_parser, parse_args
from megadomino.cli.flags import ALIAS, FLAGS, NOTICE, REFUSED
from megadomino.cli.misspelling import closest_flag
from megadomino.config import ConfigError
from megadomino.train.manual_gc import ManualGC

VENDORED = Path(__file__).resolve().parent / "megatron_flags"
sys.path.insert(0, str(VENDORED))
import extract  # noqa: E402  (tests/megatron_flags/extract.py)

BASE = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10"]
ROWS = {flag.name: flag for flag in FLAGS}


def names(file: str) -> list[str]:
    lines = (VENDORED / file).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if not line.startswith("#")]


MEGATRON = names("megatron_lm_flags.txt")
OLD_AND_FORKS = names("renamed_and_forks.txt")


def parse(*argv: str, family: str = "gpt"):
    return parse_args([*BASE, *argv], family)


def test_vendored_lists_name_their_source():
    lines = (VENDORED / "megatron_lm_flags.txt").read_text().splitlines()
    header = [line for line in lines if line.startswith("#")]
    assert lines[:len(header)] == header
    assert "github.com/NVIDIA/Megatron-LM" in header[0]
    assert "megatron/training/arguments.py" in header[0]
    assert re.search(r"commit [0-9a-f]{40}\b", header[0])
    assert all(any(path in line for line in header) for path in extract.CONFIG_PATHS)
    assert len(MEGATRON) > 850 and MEGATRON == sorted(set(MEGATRON))
    for line in (VENDORED / "renamed_and_forks.txt").read_text().splitlines():
        assert line.startswith("#") or re.fullmatch(r"--[\w-]+  # \S.*", line), line
    assert not set(OLD_AND_FORKS) & set(MEGATRON)


def test_extract_reads_option_strings_not_help():
    source = ("def add(parser):\n"
              "    group = parser.add_argument_group('g')\n"
              "    group.add_argument('--a-flag', '--a_flag', type=int, help='--not-a-flag')\n"
              "    group.add_argument(\n        \"--switch\", action='store_true')\n"
              "    parser.add_argument('positional')\n")
    assert extract.flag_names(source) == ["--a-flag", "--a_flag", "--switch"]


def test_extract_adds_the_no_spelling_of_boolean_optional_actions():
    source = ("group.add_argument('--overlap', action=argparse.BooleanOptionalAction)\n"
              "group.add_argument('--plain', action='store_true')\n")
    assert extract.flag_names(source) == ["--no-overlap", "--overlap", "--plain"]


ARGUMENTS_PY = """
def _add_model_args(parser):
    exclude = ["hidden_fn", "skipped"]
    ArgumentGroupFactory(ModelConfig, exclude=exclude).build_group(parser, "model")

def _add_log_args(parser):
    ArgumentGroupFactory(LogConfig, exclude=["quiet"]).build_group(parser, "logging")
"""
CONFIG_PY = '''
@dataclass
class BaseConfig:
    tensor_size: int = 1
    fused: bool = True
    """A docstring is no field."""

@dataclass(kw_only=True)
class ModelConfig(BaseConfig):
    num_layers: int = field(default=0, metadata={"argparse_meta": {"default": None}})
    fused: bool = False
    hidden_fn: Callable = gelu
    skipped: int = 3
    cpu_init: Optional[bool] = None
    bias: bool = field(default=True, metadata={"argparse_meta": {"arg_names": ["--no-bias"]}})
    derived: int | None = field(init=False, default=None)
    recipe: Literal["a", "b"] | None = None
    modules: list[str] = field(default_factory=list)
    names: ClassVar[tuple] = ()

@dataclass
class LogConfig:
    quiet: bool = False
    log_everything: bool = field(default_factory=lambda: True)
'''


def test_extract_names_dataclass_fields_as_argument_group_factory_does():
    """Every field not excluded and not init=False; a bool is --name if its default is False,
    else (None and default_factory included) --no-name and --disable-name; argparse_meta's
    arg_names win; a subclass's field replaces its base's; a callable must be excluded."""
    assert extract.factory_flag_names(ARGUMENTS_PY, [CONFIG_PY]) == [
        "--disable-cpu-init", "--disable-log-everything", "--fused", "--modules", "--no-bias",
        "--no-cpu-init", "--no-log-everything", "--num-layers", "--recipe", "--tensor-size"]
    with pytest.raises(extract.TypeInferenceError, match="Callable"):
        extract.factory_flag_names(ARGUMENTS_PY.replace('"hidden_fn", ', ""), [CONFIG_PY])


@pytest.mark.parametrize("source", ["megatron", "renamed_and_forks"])
def test_every_vendored_name_has_a_row(source):
    vendored = MEGATRON if source == "megatron" else OLD_AND_FORKS
    assert [name for name in vendored if name not in ROWS] == []


def test_aliases_name_a_row_that_is_no_alias():
    for flag in FLAGS:
        if flag.policy == ALIAS:
            assert ROWS[flag.alias_of].policy != ALIAS, flag.name


def test_hint_for_every_vendored_name_is_its_own_row_or_none():
    """Were a name's row missing, no other flag would be offered in its place: at most the
    same row under another spelling (--local_rank for --local-rank)."""
    def spelling(name: str) -> str:
        return name.replace("_", "-").lower()

    vendored = MEGATRON + OLD_AND_FORKS
    failing = []
    for name in vendored:
        hint = closest_flag(name, [flag.name for flag in FLAGS if flag.name != name])
        if hint is not None and spelling(hint) != spelling(name):
            failing.append(f"{name}: did you mean {hint}?")
    assert not failing, (f"{len(failing)} of {len(vendored)} vendored names would be offered "
                         "another flag:\n" + "\n".join(failing))


@pytest.mark.parametrize("typed, hint", [
    ("--num_layers", "--num-layers"), ("--Hidden-Size", "--hidden-size"),
    ("--num-layer", "--num-layers"), ("--adam-beta3", None), ("--hidden", None),
    ("--fp8", None), ("--micro-batch-szie", "--micro-batch-size"),
    ("--tensor-model-paralel-size", "--tensor-model-parallel-size"),
    ("--seq-lenght", "--seq-length"), ("--hiden-size", "--hidden-size"),
    ("--save-xgrads-interval", None), ("--num-layres", "--num-layers"),
])
def test_hints_only_where_likely_right(typed, hint):
    with pytest.raises(ConfigError) as error:
        parse(typed, "2")
    message = str(error.value)
    assert message.startswith(f"unknown flag {typed}:")
    assert message.endswith(f"did you mean {hint}?") if hint else "did you mean" not in message


def test_local_rank_spellings_are_one_flag():
    _, notices = parse("--local_rank=3", "--local-rank", "4")
    assert notices == [f"--local-rank: {ROWS['--local-rank'].text}"]


def test_second_spellings_of_dataclass_made_flags_are_their_rows():
    assert parse("--persistent-save-interval", "7")[0].train.checkpoint.save_interval == 7
    _, notices = parse("--override-opt_param-scheduler", "--disable-tp-comm-overlap-ag",
                          "--no-tp-comm-bulk-wgrad")
    overlap = ROWS["--no-tp-comm-bulk-wgrad"].text
    assert sorted(notices) == sorted([
        f"--override-opt-param-scheduler: {ROWS['--override-opt-param-scheduler'].text}",
        f"--no-tp-comm-bulk-wgrad, --no-tp-comm-overlap-ag: {overlap}"])
    with pytest.raises(ConfigError, match="^--no-fp8-wgrad is refused: under --fp8-format"):
        parse("--disable-fp8-wgrad")


def test_zero_stage_0_contradicts_the_distributed_optimizer():
    config, _ = parse("--zero-stage", "0")
    assert config.parallel.zero.stage == 0
    with pytest.raises(ConfigError, match="--use-distributed-optimizer is ZeRO stage 1"):
        parse("--zero-stage", "0", "--use-distributed-optimizer")


def test_notices_are_grouped_by_reason_once():
    _, notices = parse("--lion-beta1", "0.9", "--no-bias-gelu-fusion", "--lion-beta2",
                          "0.99", "--no-rope-fusion", "--ddp-num-buckets", "4")
    assert sorted(notices) == sorted([
        f"--lion-beta1, --lion-beta2: {ROWS['--lion-beta2'].text}",
        f"--no-bias-gelu-fusion, --no-rope-fusion: {ROWS['--no-rope-fusion'].text}",
        f"--ddp-num-buckets: {ROWS['--ddp-num-buckets'].text}"])


def test_notices_take_the_values_megatron_gives_them():
    _, notices = parse("--empty-unused-memory-level", "2", "--cuda-graph-scope", "attn",
                          "mlp")
    assert sorted(line.split(":")[0] for line in notices) == [
        "--cuda-graph-scope", "--empty-unused-memory-level"]
    with pytest.raises(ConfigError, match="unexpected argument '2'"):
        parse("--log-params-norm", "2")


@pytest.mark.parametrize("choice, spelled", [("rmsnorm", "RMSNorm"), ("layernorm", "LayerNorm"),
                                              ("RMSNorm", "RMSNorm")])
def test_choices_in_any_case(choice, spelled):
    assert parse("--normalization", choice)[0].model.normalization == spelled


def test_other_choices_stay_errors():
    with pytest.raises(ConfigError, match="argument --normalization: invalid choice"):
        parse("--normalization", "batchnorm")


def test_num_key_value_heads_is_grouped_query_attention():
    config, _ = parse("--num-key-value-heads", "2")
    assert config.model.num_query_groups == 2


def test_llama_model_belongs_to_pretrain_llama():
    assert parse_args(["--llama-model", "--num-layers", "2", "--hidden-size", "64",
                       "--num-attention-heads", "4", "--seq-length", "32", "--mock-data",
                       "--train-iters", "1"], "llama")[0].model.swiglu
    with pytest.raises(ConfigError, match="--llama-model asks for a Llama model: use "
                                          "pretrain_llama.py"):
        parse("--llama-model")


def test_no_position_embedding_is_accepted_only_with_rope():
    """As in Megatron-LM: rope adds no position embedding, so there is nothing to disable; a
    learned_absolute model without one is refused (Megatron-LM refuses it too)."""
    for rope in (("--position-embedding-type", "rope"), ("--use-rotary-position-embeddings",)):
        assert parse(*rope, "--no-position-embedding")[0].model.position_embedding_type == "rope"
    assert parse_args(["--no-position-embedding", "--num-layers", "2", "--hidden-size", "64",
                       "--num-attention-heads", "4", "--seq-length", "32", "--mock-data",
                       "--train-iters", "1"], "llama")[0].model.position_embedding_type == "rope"
    for argv in ((), ("--position-embedding-type", "learned_absolute")):
        with pytest.raises(ConfigError, match="^--no-position-embedding is refused: models "
                                              "without position embeddings"):
            parse(*argv, "--no-position-embedding")


@pytest.mark.parametrize("argv, reason", [
    (("--optimizer", "muon"), "Muon is not implemented: use adam or sgd"),
    (("--main-grads-dtype", "bf16"), "always fp32"),
    (("--dataloader-type", "external"), "an external loader is the caller's own"),
    (("--reset-position-ids",), "documents packed in one sample attend across"),
    (("--checkpoint-activations",), "use --recompute-activations"),
    (("--moe-router-score-function", "sigmoid"), "Mixture-of-Experts is not implemented"),
    (("--fp32-residual-connection",), "the residual stream has the parameters' dtype"),
    (("--softmax-type", "learnable"), "softmax offsets are not implemented"),
    (("--no-rl-partial-rollouts",), "reinforcement learning"),
    (("--padded-vocab-size", "50304"), "always padded to a multiple"),
])
def test_refusals_fit_their_flag(argv, reason):
    with pytest.raises(ConfigError, match="is refused: .*" + re.escape(reason)):
        parse(*argv)


def test_counts_by_policy_cover_the_table():
    policies = {flag.policy for flag in FLAGS}
    assert policies == {"implemented", ALIAS, "ours", NOTICE, REFUSED}


@pytest.mark.parametrize("argv, collected_at", [
    ((), []),
    (("--manual-gc",), ["start", "eval", "eval"]),
    (("--manual-gc", "--manual-gc-interval", "2"), ["start", 2, "eval", "eval", 4]),
    (("--manual-gc", "--manual-gc-interval", "2", "--no-manual-gc-eval"), ["start", 2, 4]),
])
def test_manual_gc_collects_on_its_schedule(argv, collected_at, monkeypatch):
    runtime = parse(*argv)[0].train.runtime
    collections, moment = [], ["start"]
    monkeypatch.setattr(gc, "collect", lambda: collections.append(moment[0]))
    assert gc.isenabled()
    with ManualGC(runtime) as manual_gc:
        assert gc.isenabled() != runtime.manual_gc
        for iteration in range(1, 5):
            moment[0] = iteration
            manual_gc.after_iteration(iteration)
            if iteration == 3:
                moment[0] = "eval"
                with manual_gc.evaluation():
                    pass
    assert gc.isenabled()
    assert collections == collected_at


@pytest.mark.parametrize("argv", [("--manual-gc-interval", "5"), ("--no-manual-gc-eval",)])
def test_manual_gc_options_need_manual_gc(argv):
    with pytest.raises(ConfigError, match="apply to --manual-gc: add --manual-gc"):
        parse(*argv)


VALUED = [flag for flag in FLAGS if flag.policy != ALIAS
          and (flag.choices is not None or flag.supported is not None)]
COMPANIONS = {"--recompute-granularity=full": ("--recompute-method", "uniform",
                                              "--recompute-num-layers", "1"),
              "--fp8-recipe": ("--fp8-format", "hybrid"),
              "--pipeline-planner": ("--pipeline-plan", "auto"),
              "--pipeline-reshard": ("--num-layers", "3", "--untie-embeddings-and-output-weights",
                                     "--pipeline-plan", str(Path(__file__).parent / "fixtures"
                                                            / "pipeline_plan_tp2_tp1.json")),
              "--fp8-amax-compute-algo": ("--fp8-format", "hybrid"),
              "--zeropp-gradient-bits": ("--zero-stage", "3", "--zeropp-quantized-gradients"),
              "--diloco-pseudo-grad-dtype": ("--diloco-inner-steps", "10"),
              "--pipeline-codec": ("--pipeline-model-parallel-size", "2"),
              "--pipeline-codec-values": ("--pipeline-model-parallel-size", "2",
                                          "--pipeline-codec", "adatopk"),
              "--lr-decay-style=WSD": ("--lr-wsd-decay-iters", "2"),
              "--lr-wsd-decay-style": ("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"),
              "--pipeline-schedule=interleaved": ("--num-layers", "4",
                                                  "--pipeline-model-parallel-size", "2",
                                                  "--virtual-pipeline-model-parallel-size", "2")}
"""Flags (or a flag=value) that parse only beside these."""


def _values(flag) -> list:
    """Every choice; without choices, the accepted values and one other."""
    if flag.choices is not None:
        return list(flag.choices)
    first = flag.supported[0]
    other = first + 1 if flag.type is int else first / 2 if flag.type is float else "other"
    return [*flag.supported, other]


def test_some_flags_have_choices_partly_refused():
    partly = {flag.name for flag in VALUED if flag.choices is not None
              and flag.supported is not None and set(flag.choices) - set(flag.supported)}
    assert {"--optimizer", "--ckpt-format", "--zero-stage"} <= partly


@pytest.mark.parametrize("flag", VALUED, ids=lambda flag: flag.name)
def test_help_says_what_parse_args_accepts_and_refuses(flag):
    """Each value of a flag with choices or with refused values: --help shows it in the usage
    (metavar) when parse_args takes it (and the config has it in the row's field, or, for a row
    without one, is the command's without it), and names it refused, with the reason, when
    parse_args ends in a line refusing it."""
    action = next(a for a in build_parser("gpt", show_all=True)._actions
                  if flag.name in a.option_strings)
    shown = action.metavar.strip("{}").split(",") if flag.choices is not None else None
    for value in _values(flag):
        refused = flag.refusal(value) is not None
        if refused:
            with pytest.raises(ConfigError, match=f"^{re.escape(flag.name)}="
                                                  f"{re.escape(str(value))} is refused: "):
                parse(flag.name, str(value))
        else:
            companions = COMPANIONS.get(f"{flag.name}={value}", COMPANIONS.get(flag.name, ()))
            config = parse(*companions, flag.name, str(value))[0]
            if flag.field is None:
                assert config == parse(*companions)[0], value
            else:
                assert functools.reduce(getattr, flag.field.split("."), config) == value, value
        if shown is not None:
            assert (str(value) in shown) != refused, (value, action.metavar)
        if flag.supported is None:
            assert "refused" not in action.help, action.help
        elif flag.policy == REFUSED:
            assert action.help.endswith(f"(accepted at "
                                        f"{', '.join(map(str, flag.supported))})"), action.help
        elif refused and flag.choices is not None:
            names = [str(c) for c in flag.choices if flag.refusal(c) is not None]
            assert f"; refused: {', '.join(names)} ({flag.unsupported})." in action.help
            assert str(value) in names
        elif refused:
            assert f"Values other than {', '.join(map(str, flag.supported))} are refused: " \
                f"{flag.unsupported}." in action.help, action.help
