"""Write megatron_lm_flags.txt: the flag names of Megatron-LM's megatron/training/arguments.py.

    git --git-dir=DIR show HEAD:megatron/training/arguments.py > arguments.py
    python3 tests/megatron_flags/extract.py arguments.py COMMIT

Only the names are taken (the option strings of every `add_argument` call, read with `ast`), not
the help texts. Flags Megatron-LM generates from its config dataclasses (`ArgumentGroupFactory`)
are not `add_argument` calls and so are not in the list.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPOSITORY = "https://github.com/NVIDIA/Megatron-LM"
SOURCE_PATH = "megatron/training/arguments.py"
OUTPUT = Path(__file__).with_name("megatron_lm_flags.txt")


def flag_names(source: str) -> list[str]:
    """The sorted, distinct option strings (`--x`) of every `*.add_argument(...)` in `source`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            names.update(arg.value for arg in node.args if isinstance(arg, ast.Constant)
                         and isinstance(arg.value, str) and arg.value.startswith("--"))
    return sorted(names)


def main(arguments_py: str, commit: str) -> None:
    names = flag_names(Path(arguments_py).read_text())
    header = [f"# Flag names of {REPOSITORY}, {SOURCE_PATH} at commit {commit}: the option",
              "# strings of its add_argument calls (names only), written by extract.py."]
    OUTPUT.write_text("\n".join(header + names) + "\n")
    print(f"{len(names)} names -> {OUTPUT}")


if __name__ == "__main__":
    main(*sys.argv[1:])
