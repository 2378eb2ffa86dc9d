"""Seventeen mistakes a Megatron-LM user makes on a first run, each refused as one `error:` line
that names the flag (or variable) and what works, exit status 2, no traceback; a command with
three bad flags gets all three lines at once. Bad files are tests/test_bad_files.py's table; this
is the rest: typos, values argparse rejects, values out of range, contradictions, refused
features, a plan file, the launch environment.

Each row runs launch.main in-process as one rank (test_bad_files.run), as a launched run reads
its flags; one test loops over the table and reports every row that fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from test_bad_files import GPT, MOCK, run


@dataclass(frozen=True)
class Mistake:
    name: str
    argv: tuple[str, ...]
    said: tuple[str, ...]
    """What the `error:` lines say, one entry a line, in order."""
    env: tuple[tuple[str, str | None], ...] = ()
    """Launch variables changed from a single rank's (None: unset)."""


def _mistakes(plan_file: str) -> list[Mistake]:
    return [
        Mistake("a flag misspelled", (*MOCK, "--micro-batch-szie", "2"),
                ("unknown flag --micro-batch-szie", "did you mean --micro-batch-size?")),
        Mistake("a letter dropped", (*MOCK, "--tensor-model-paralel-size", "2"),
                ("did you mean --tensor-model-parallel-size?",)),
        Mistake("not an integer", (*MOCK, "--num-layers", "x"),
                ("argument --num-layers: invalid int value: 'x'",)),
        Mistake("not one of the choices", (*MOCK, "--normalization", "batchnorm"),
                ("--normalization: invalid choice: 'batchnorm'", "'RMSNorm'")),
        Mistake("a value missing", (*MOCK, "--lr"), ("argument --lr: expected one argument",)),
        Mistake("out of range", (*MOCK, "--micro-batch-size", "0"),
                ("--micro-batch-size=0 is invalid: it must be an integer >= 1",)),
        Mistake("a batch that does not divide", (*MOCK, "--micro-batch-size", "2",
                                                 "--global-batch-size", "3"),
                ("--global-batch-size=3 is invalid", "multiple of --micro-batch-size (2)"),),
        Mistake("heads that do not divide the width", (*MOCK, "--hidden-size", "18",
                                                       "--num-attention-heads", "4"),
                ("--hidden-size=18 is invalid: it must be a multiple of --num-attention-heads",)),
        Mistake("sequences longer than the positions", (*MOCK, "--seq-length", "16"),
                ("--seq-length=16 is invalid: it must be at most --max-position-embeddings",)),
        Mistake("no length of training", tuple(_without(MOCK, "--train-iters", 1)),
                ("give exactly one of --train-iters and --train-samples",)),
        Mistake("two precisions", (*MOCK, "--fp16", "--bf16"),
                ("--bf16 and --fp16 are exclusive",)),
        Mistake("the distributed optimizer and ZeRO 3", (*MOCK, "--use-distributed-optimizer",
                                                        "--zero-stage", "3"),
                ("--use-distributed-optimizer is ZeRO stage 1 and contradicts --zero-stage 3",)),
        Mistake("virtual stages without a pipeline", (*MOCK, "--virtual-pipeline-model-parallel-"
                                                      "size", "2"),
                ("--virtual-pipeline-model-parallel-size=2 is invalid",
                 "--pipeline-model-parallel-size > 1")),
        Mistake("more GPUs asked than launched", (*MOCK, "--tensor-model-parallel-size", "2"),
                ("world size 1 is not divisible into --tensor-model-parallel-size=2",
                 "launch a multiple of 2 processes")),
        Mistake("a feature not implemented", (*MOCK, "--num-experts", "8"),
                ("--num-experts is refused: Mixture-of-Experts is not implemented",)),
        Mistake("a plan with a misspelt key", (*MOCK, "--pipeline-plan", plan_file),
                (f"--pipeline-plan {plan_file}: stage 0: unknown key 'colour'",)),
        Mistake("RANK without WORLD_SIZE", MOCK,
                ("the environment sets RANK but not WORLD_SIZE", "launch with torchrun"),
                env=(("RANK", "0"), ("WORLD_SIZE", None))),
    ]


def _without(argv: tuple[str, ...], flag: str, values: int) -> list[str]:
    index = argv.index(flag)
    return [*argv[:index], *argv[index + 1 + values:]]


THREE = (*GPT, "--mock-data", "--vocab-size", "64", "--micro-batch-szie", "2", "--num-layers",
         "x", "--micro-batch-size", "0")


def _problems(mistake: Mistake) -> list[str]:
    code, errors = run(list(mistake.argv), env=dict(mistake.env))
    problems = []
    if code != 2:
        problems.append(f"exit status {code}, not 2")
    if len(errors) != 1:
        problems.append(f"{len(errors)} error lines, not 1: {errors}")
    missing = [said for said in mistake.said if not any(said in line for line in errors)]
    if missing:
        problems.append(f"the error does not say {missing}: {errors}")
    return problems


def test_each_mistake_is_one_line_and_exit_2(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"stages": [{"layers": 1, "tp": 1, "colour": "red"}]}))
    mistakes = _mistakes(str(plan))
    assert len(mistakes) == 17
    failing = {mistake.name: problems for mistake in mistakes
               if (problems := _problems(mistake))}
    assert not failing, "\n".join(f"{name}: {'; '.join(p)}" for name, p in failing.items())


def test_three_bad_flags_in_one_command_are_three_lines():
    code, errors = run(list(THREE))
    assert code == 2, code
    assert len(errors) == 3, errors
    for said in ("argument --num-layers: invalid int value: 'x'",
                 "unknown flag --micro-batch-szie", "--micro-batch-size=0 is invalid"):
        assert any(said in line for line in errors), (said, errors)
