"""Regenerate the flag tables of docs/flags.md from the policy table (megadomino/cli/flags.py):
the text between each `<!-- NAME:begin -->` / `<!-- NAME:end -->` marker pair is replaced by
render_flag_table's output. tests/test_arguments.py fails until this has been run after a change
to a flag row. Usage: python scripts/gen_flags_doc.py
"""

from __future__ import annotations

from pathlib import Path

from megadomino.cli.arguments import render_flag_table
from megadomino.cli.flags import FINETUNE_FLAGS, FLAGS

DOC = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def main() -> int:
    text = DOC.read_text()
    for marker, flags in (("flag-table", FLAGS), ("finetune-flag-table", FINETUNE_FLAGS)):
        begin, end = f"<!-- {marker}:begin -->\n", f"<!-- {marker}:end -->"
        head, rest = text.split(begin)
        tail = rest.split(end)[1]
        text = head + begin + render_flag_table(flags) + end + tail
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
