"""--deepspeed_config: every mapped key gives the config its flag gives; notice and error rows;
bad files are one `error:` line and exit 2; the disagreement rules; and a 2-rank run through the
JSON trains with the same losses as through the equivalent flags."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import DistSuite, free_port
from megadomino.cli.arguments import parse_args
from megadomino.cli.deepspeed_keys import KEYS
from megadomino.cli.launch import main
from megadomino.config import ConfigError
from megadomino.config.validate import batch_plan, validate
from megadomino.distributed import ParallelDims

BASE = ["--model-preset", "gpt-tiny", "--mock-data", "--train-iters", "10"]
ADAM = ["--optimizer", "adam", "--lr", "0.001", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
        "--adam-eps", "1e-8", "--weight-decay", "0", "--lr-decay-style", "constant"]
"""What a JSON naming Adam with no parameters and no scheduler means: FusedAdam's defaults at a
constant LR."""


def nest(path: str, value) -> dict:
    """{"a": {"b": value}} for "a.b"; an optimizer's key comes with the optimizer's type."""
    for name in reversed(path.split(".")):
        value = {name: value}
    if path.startswith("optimizer."):
        sgd = path.split(".")[-1] in ("momentum", "dampening", "nesterov")
        value["optimizer"]["type"] = "SGD" if sgd else "AdamW"
    return value


def with_json(tmp_path, content, *argv: str, deepspeed: bool = True):
    """parse_args of BASE + argv with `content` written as the --deepspeed_config file."""
    path = tmp_path / "ds.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return parse_args([*BASE, *(["--deepspeed"] if deepspeed else []), "--deepspeed_config",
                       str(path), *argv], "gpt")


def with_flags(*argv: str):
    return parse_args([*BASE, *argv], "gpt")


MAPPED = [  # (JSON, the flags it stands for)
    ({"train_micro_batch_size_per_gpu": 4}, ["--micro-batch-size", "4"]),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2},
     ["--global-batch-size", "16", "--micro-batch-size", "2"]),
    ({"gradient_clipping": 0.5}, ["--clip-grad", "0.5"]),
    ({"gradient_clipping": 0}, ["--clip-grad", "0"]),
    ({"bf16": {"enabled": True}}, ["--bf16"]),
    ({"bfloat16": {"enabled": True}}, ["--bf16"]),
    ({"fp16": {"enabled": True}}, ["--fp16"]),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, ["--fp16"]),
    ({"fp16": {"enabled": True, "initial_scale_power": 12}},
     ["--fp16", "--initial-loss-scale", "4096"]),
    ({"fp16": {"enabled": True, "loss_scale_window": 200}},
     ["--fp16", "--loss-scale-window", "200"]),
    ({"fp16": {"enabled": True, "hysteresis": 4}}, ["--fp16", "--hysteresis", "4"]),
    ({"fp16": {"enabled": True, "min_loss_scale": 0.5}}, ["--fp16", "--min-loss-scale", "0.5"]),
    ({"zero_optimization": {"stage": 1}}, ["--zero-stage", "1"]),
    ({"zero_optimization": {"stage": 3}}, ["--zero-stage", "3"]),
    ({"zero_optimization": True}, ["--zero-stage", "1"]),  # DeepSpeed's old form
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     ["--zero-stage", "3", "--zeropp-quantized-weights"]),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": False}}, ["--zero-stage", "3"]),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
     ["--zero-stage", "3", "--zeropp-hpz-partition-size", "2"]),
    ({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
     ["--zero-stage", "1", "--zeropp-quantized-gradients"]),
    ({"optimizer": {"type": "Adam"}}, ADAM),
    ({"optimizer": {"type": "adamw"}}, ADAM),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, [*ADAM, "--lr", "3e-4"]),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.95]}}},
     [*ADAM, "--adam-beta1", "0.8", "--adam-beta2", "0.95"]),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}, [*ADAM, "--adam-eps", "1e-6"]),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}},
     [*ADAM, "--weight-decay", "0.1"]),
    ({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}},
     [*ADAM, "--weight-decay", "0.01"]),  # torch's AdamW: weight decay 0.01
    ({"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}},
     ["--optimizer", "sgd", "--lr", "0.001", "--sgd-momentum", "0.5", "--weight-decay", "0",
      "--lr-decay-style", "constant"]),
]


@pytest.mark.parametrize("content, flags", MAPPED, ids=[json.dumps(c) for c, _ in MAPPED])
def test_a_key_gives_the_config_its_flag_gives(tmp_path, content, flags):
    assert with_json(tmp_path, content)[0] == with_flags(*flags)[0]


def test_every_mapped_key_is_in_the_table():
    def paths(content: dict, prefix: str = "") -> set[str]:
        out = set()
        for name, value in content.items():
            out |= paths(value, f"{prefix}{name}.") if isinstance(value, dict) else {
                prefix + name}
        return out

    covered = set().union(*(paths(content) for content, _ in MAPPED))
    mapped = {path for path, key in KEYS.items() if key.flags} | {
        "bf16.enabled", "bfloat16.enabled", "fp16.enabled"}
    assert mapped - covered - {"optimizer.type"} == set()  # type: in every optimizer row


@pytest.mark.parametrize("world, micro, steps, batch", [(1, 2, 4, 8), (2, 2, 4, 16),
                                                        (4, 1, 3, 12)])
def test_accumulation_steps_make_the_batch_with_the_worlds_dp(tmp_path, world, micro, steps,
                                                              batch):
    """DeepSpeed's triple: train_batch_size = micro x steps x DP, DP known with the world; the
    same as --global-batch-size there, and a train_batch_size that breaks it is refused then."""
    config, _ = with_json(tmp_path, {"train_micro_batch_size_per_gpu": micro,
                                     "gradient_accumulation_steps": steps})
    validate(config, world)
    flags, _ = with_flags("--micro-batch-size", str(micro), "--global-batch-size", str(batch))
    assert batch_plan(config.train.schedule, world) == batch_plan(flags.train.schedule, world)
    wrong, _ = with_json(tmp_path, {"train_micro_batch_size_per_gpu": micro, "train_batch_size":
                                    batch, "gradient_accumulation_steps": steps})
    validate(wrong, world)
    with pytest.raises(ConfigError, match=f"gradient_accumulation_steps={steps} makes the global "
                                          f"batch .* = {batch * 2}, not {batch}"):
        validate(wrong, world * 2)


NOTICE_VALUES = {"steps_per_print": 1, "zero_optimization.offload_optimizer": {"device": "cpu"},
                 "zero_optimization.overlap_comm": True, "bf16.immediate_grad_update": True,
                 "optimizer.params.torch_adam": False}


@pytest.mark.parametrize("path", sorted(path for path, key in KEYS.items() if key.notice))
def test_a_notice_row_changes_nothing_and_says_so(tmp_path, path):
    config, notices = with_json(tmp_path, nest(path, NOTICE_VALUES.get(path, 1)))
    assert config == with_flags(*(ADAM if path.startswith("optimizer.") else ()))[0]
    assert [line for line in notices if path in line and KEYS[path].notice in line], notices


ASKING = {"amp": {"enabled": True}, "sparse_attention": {"mode": "fixed"},
          "compression_training": {}, "curriculum_learning": {"enabled": True},
          "data_efficiency": {"enabled": True}, "progressive_layer_drop": {"enabled": True},
          "eigenvalue": {"enabled": True}, "elasticity": {"enabled": True},
          "hybrid_engine": {"enabled": True}, "fp16.consecutive_hysteresis": True,
          "fp16.auto_cast": True, "fp16.fp16_master_weights_and_grads": True,
          "zero_optimization.mics_shard_size": 4, "zero_optimization.zeropp_loco_param": {},
          "checkpoint.load_universal": True, "data_types.grad_accum_dtype": "bf16",
          "optimizer.params.adam_w_mode": False, "optimizer.params.bias_correction": False,
          "optimizer.params.amsgrad": True, "optimizer.params.max_grad_norm": 1.0,
          "optimizer.params.dampening": 0.1, "optimizer.params.nesterov": True}
"""A value asking for what each error row refuses."""
ASKING_NOTHING = {"amp": {"enabled": False}, "fp16.consecutive_hysteresis": False,
                  "zero_optimization.mics_shard_size": -1, "data_types.grad_accum_dtype": "fp32",
                  "optimizer.params.adam_w_mode": True, "optimizer.params.nesterov": False,
                  "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen"}}


@pytest.mark.parametrize("path", sorted(path for path, key in KEYS.items() if key.error))
def test_an_error_row_refuses_what_it_lacks(tmp_path, path):
    with pytest.raises(ConfigError) as err:
        with_json(tmp_path, nest(path, ASKING[path]))
    assert len(err.value.messages) == 1
    message = err.value.messages[0]
    assert message.startswith(f"--deepspeed_config={tmp_path / 'ds.json'}: {path}=")
    assert message.endswith(f"is refused: {KEYS[path].error}"), message
    if path in ASKING_NOTHING:
        with_json(tmp_path, nest(path, ASKING_NOTHING[path]))


@pytest.mark.parametrize("content, message", [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage=2 (--zero-stage): "
                                          "--zero-stage=2 is refused: ZeRO stage 2"),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale=128 (--loss-scale): "
                                                     "--loss-scale is refused: a static"),
    ({"train_micro_batch_size_per_gpu": 0}, "(--micro-batch-size): --micro-batch-size=0 is "
                                            "invalid"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type=\"Lamb\": the Lamb optimizer is not "
                                      "implemented"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}, "optimizer.params.betas "
                                                                      "is not a parameter of SGD"),
    ({"optimizer": {"params": {"lr": 1.0}}}, "optimizer has no type"),
    ({"scheduler": {"type": "WarmupDecayLR"}}, "scheduler \"WarmupDecayLR\" is refused: "
                                               "DeepSpeed's LR schedulers are not implemented"),
    ({"train_batch_size": 8}, "without train_micro_batch_size_per_gpu, DeepSpeed derives"),
    ({"gradient_accumulation_steps": 0, "train_micro_batch_size_per_gpu": 1},
     "gradient_accumulation_steps=0 is invalid"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16 and fp16 are both enabled"),
    ({"train_batch_sise": 8}, "train_batch_sise is not a DeepSpeed setting megadomino knows "
                              r"\(docs/deepspeed_config.md lists them\); did you mean "
                              "train_batch_size?"),
    ({"zero_optimization": {"stag": 1}}, "did you mean zero_optimization.stage?"),
])
def test_values_megadomino_cannot_run_are_one_line(tmp_path, content, message):
    with pytest.raises(ConfigError) as err:
        with_json(tmp_path, content)
    assert len(err.value.messages) == 1
    assert err.value.messages[0].startswith(f"--deepspeed_config={tmp_path / 'ds.json'}: ")
    assert re.search(message if "\\" in message else re.escape(message), err.value.messages[0])


BAD_FILES = [  # (what the file holds, or None: no file, "/": a directory; what the line says)
    (None, "cannot read the file: No such file or directory"),
    ("/", "cannot read the file: Is a directory"),
    ('{"train_batch_size": 8,}', "not valid JSON: Expecting property name"),
    ("[1, 2]", "the file holds a list, not an object of settings"),
    ('{"gradient_clipping": "1.0"}', 'gradient_clipping is a string ("1.0"): it must be a number'),
    ('{"train_batch_size": 8.5}', "train_batch_size is a number (8.5): it must be an integer"),
    ('{"bf16": {"enabled": "true"}}', 'bf16.enabled is a string ("true"): it must be true or '
                                      'false'),
    ('{"fp16": []}', "fp16 is a list ([]): it must be an object"),
    ('{"steps_per_print": 1, "steps_per_print": 2}', "steps_per_print appears twice"),
]


@pytest.mark.parametrize("content, says", BAD_FILES)
def test_a_bad_file_is_one_error_line_and_exit_2(tmp_path, monkeypatch, capsys, content, says):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    path = tmp_path / "ds.json"
    if content == "/":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    assert main("gpt", [*BASE, "--deepspeed", "--deepspeed-config", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --deepspeed_config={path}: {says}"), \
        lines
    assert not dist.is_initialized()


def notice_with(notices: list[str], *parts: str) -> str:
    lines = [line for line in notices if all(part in line for part in parts)]
    assert len(lines) == 1, notices
    return lines[0]


def test_the_json_wins_what_deepspeeds_engine_reads(tmp_path):
    """ZeRO, precision, loss scaling, clipping: DeepSpeed's engine reads the JSON's."""
    content = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5,
               "fp16": {"enabled": True, "hysteresis": 5}}
    config, notices = with_json(tmp_path, content, "--zero-stage", "1", "--clip-grad", "1",
                                "--bf16", "--hysteresis", "2")
    assert config == with_flags("--zero-stage", "3", "--clip-grad", "0.5", "--fp16",
                                "--hysteresis", "5")[0]
    for flag, key in (("--zero-stage=1", "zero_optimization.stage=3"),
                      ("--clip-grad=1.0", "gradient_clipping=0.5"),
                      ("--bf16", "fp16.enabled=true"), ("--hysteresis=2", "fp16.hysteresis=5")):
        notice_with(notices, f"{flag} and ", f"'s {key} differ: the JSON wins, as DeepSpeed's "
                    "engine reads it only from the JSON")


def test_a_flag_the_engine_reads_from_the_json_alone_is_used_and_named(tmp_path):
    config, notices = with_json(tmp_path, {"steps_per_print": 1}, "--clip-grad", "0.3",
                                "--zero-stage", "1", "--bf16")
    assert config == with_flags("--clip-grad", "0.3", "--zero-stage", "1", "--bf16")[0]
    notice_with(notices, "--clip-grad, --zero-stage, --bf16: given on the command line only, "
                "and used; DeepSpeed's engine reads them only from --deepspeed_config=")


def test_json_turning_off_the_flags_precision_is_refused(tmp_path):
    for name in ("bf16", "fp16"):
        with pytest.raises(ConfigError, match=f"^--{name} contradicts .*'s {name}.enabled=false: "
                                              "DeepSpeed would train"):
            with_json(tmp_path, {name: {"enabled": False}}, f"--{name}")


def test_fp16_keys_are_read_only_when_the_json_enables_fp16(tmp_path):
    config, notices = with_json(tmp_path, {"fp16": {"loss_scale_window": 10}}, "--fp16")
    assert config == with_flags("--fp16")[0]
    notice_with(notices, "fp16.loss_scale_window: not read, the JSON does not enable fp16")


def test_the_global_batch_flag_wins_and_the_micro_batch_must_agree(tmp_path):
    content = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
               "gradient_accumulation_steps": 4}
    config, notices = with_json(tmp_path, content, "--global-batch-size", "16")
    assert config == with_flags("--global-batch-size", "16", "--micro-batch-size", "2")[0]
    notice_with(notices, "--global-batch-size=16 and ", "train_batch_size=8 differ: the flag "
                "wins, as Megatron-DeepSpeed resets DeepSpeed's batch")
    notice_with(notices, "gradient_accumulation_steps=4: not used")
    assert with_json(tmp_path, content, "--global-batch-size", "8")[0].train.schedule \
        .gradient_accumulation_steps == 4  # the JSON's batch: its steps still checked at launch
    with pytest.raises(ConfigError, match=r"^--micro-batch-size=4 contradicts --deepspeed_config="
                                          r".*'s train_micro_batch_size_per_gpu=2: give one"):
        with_json(tmp_path, content, "--micro-batch-size", "4")


def test_megatron_deepspeeds_optimizer_and_scheduler_replace_the_jsons(tmp_path):
    content = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.5}},
               "scheduler": {"type": "WarmupLR"}}
    config, notices = with_json(tmp_path, content, "--lr", "3e-4", "--lr-decay-style", "cosine")
    assert config == with_flags("--lr", "3e-4", "--lr-decay-style", "cosine")[0]
    notice_with(notices, "optimizer and scheduler: not used, as Megatron-DeepSpeed hands "
                "DeepSpeed its own, made from --lr, --lr-decay-style")


def test_without_deepspeed_the_file_is_not_read(tmp_path):
    config, notices = with_json(tmp_path, {"zero_optimization": {"stage": 2}}, deepspeed=False)
    assert config == with_flags()[0]
    notice_with(notices, "not read without --deepspeed")


JSON_RUN = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.5, "bf16": {"enabled": True}, "steps_per_print": 1,
            "zero_optimization": {"stage": 1, "overlap_comm": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                                      "weight_decay": 0.1}}}
FLAGS_RUN = ["--micro-batch-size", "2", "--global-batch-size", "8", "--clip-grad", "0.5",
             "--bf16", "--zero-stage", "1", "--optimizer", "adam", "--lr", "3e-3",
             "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
             "--weight-decay", "0.1", "--lr-decay-style", "constant"]
"""The same run: on 2 data-parallel ranks, 2 micro-batches of 2 make the batch of 8."""


def _case_json_and_flags_train_alike() -> None:
    from megadomino.train.loop import train

    run = ["--model-preset", "gpt-tiny", "--mock-data", "--seq-length", "32", "--train-iters",
           "3", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
           "--attention-dropout", "0"]
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "ds.json")
        with open(path, "w") as file:
            json.dump(JSON_RUN, file)
        through_json, _ = parse_args([*run, "--deepspeed", "--deepspeed_config", path], "gpt")
    through_flags, _ = parse_args([*run, *FLAGS_RUN], "gpt")
    assert through_json.train.schedule.gradient_accumulation_steps == 2
    losses = [train(config, ParallelDims(tp=1, dp=2), "gpt", log=lambda line: None)["losses"]
              for config in (through_json, through_flags)]
    assert len(losses[0]) == 3 and torch.equal(torch.tensor(losses[0]), torch.tensor(losses[1]))


SUITE = DistSuite()
SUITE.case("json_and_flags_train_alike", _case_json_and_flags_train_alike, worlds=(2,))
test_json_and_flags_train_alike = SUITE.test()


def test_the_doc_names_every_key():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "deepspeed_config.md").read_text()
    missing = [path for path in KEYS if f"`{path.split('.')[-1]}`" not in doc
               and f"`{path}`" not in doc and f".{path.split('.')[-1]}`" not in doc]
    assert missing == []
