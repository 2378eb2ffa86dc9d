"""Compare the losses two training logs report, iteration by iteration.

    python scripts/compare_losses.py two_nodes.log one_node.log --rel 1e-5

Reads the ` iteration N/ M | loss X` and ` validation at iteration N | loss X` lines that
pretrain_gpt.py / pretrain_llama.py print on rank 0, prints both columns, and exits 1 when the logs
report different iterations, report none, or differ by more than `--rel` relative anywhere.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

LOSS_LINE = re.compile(
    r"(?P<kind>validation at iteration|iteration)\s+(?P<iteration>\d+)\b.*?\| loss "
    r"(?P<loss>[-+0-9.eE]+|nan|inf)")


def read_losses(text: str) -> dict[str, float]:
    """{'train 10' or 'valid 10': loss} from a log's rank-0 lines."""
    losses = {}
    for match in LOSS_LINE.finditer(text):
        kind = "valid" if match["kind"].startswith("validation") else "train"
        losses[f"{kind} {int(match['iteration'])}"] = float(match["loss"])
    return losses


def compare(first: dict[str, float], second: dict[str, float], rel: float) -> list[str]:
    """The problems found: keys present in one log only, and losses further apart than rel."""
    problems = []
    if not first or not second:
        problems.append("a log reports no losses")
    if set(first) != set(second):
        problems.append(f"different iterations: {sorted(set(first) ^ set(second))}")
    for key in sorted(set(first) & set(second)):
        a, b = first[key], second[key]
        if not abs(a - b) <= rel * max(abs(a), abs(b)):
            problems.append(f"{key}: {a!r} vs {b!r} differ by more than {rel:g} relative")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first_log")
    parser.add_argument("second_log")
    parser.add_argument("--rel", type=float, default=1e-5, help="relative tolerance")
    args = parser.parse_args(argv)
    logs = []
    for path in (args.first_log, args.second_log):
        with open(path, errors="replace") as f:
            logs.append(read_losses(f.read()))
    first, second = logs
    names = [os.path.basename(path) for path in (args.first_log, args.second_log)]
    print(f"{'':>10} {names[0]:>24} {names[1]:>24}")
    for key in sorted(set(first) | set(second), key=lambda k: (int(k.split()[1]), k)):
        row = [f"{log[key]:.6E}" if key in log else "-" for log in logs]
        print(f"{key:>10} {row[0]:>24} {row[1]:>24}")
    problems = compare(first, second, args.rel)
    for problem in problems:
        print(f"MISMATCH: {problem}")
    if not problems:
        print(f"OK: {len(first)} losses equal within {args.rel:g} relative")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
