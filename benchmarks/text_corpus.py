"""A corpus of real English text that needs no download: the docstrings of this Python's
standard library (every module, class and function, in sorted file order) and pydoc's topic
help, one JSON line per docstring, for benchmarks that must train on real text (the FP8 loss
check) on machines that reach no network.

    python3 benchmarks/text_corpus.py --out DIR
    # -> DIR/corpus.jsonl, DIR/tok.model (sentencepiece BPE, --vocab-size), and
    #    DIR/corpus_text_document.bin/.idx: train with --data-path DIR/corpus_text_document
    #    --tokenizer-type SentencePieceTokenizer --tokenizer-model DIR/tok.model

The text depends on the Python version that makes it; the tokenized files are what travel.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def docstrings(source: str) -> list[str]:
    """Every docstring of a module's source (module, classes, functions), in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))]
    found = [ast.get_docstring(node) for node in nodes]
    return [text for text in found if text and len(text) > 40]


def corpus_lines(stdlib: Path) -> list[str]:
    lines = []
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        lines += docstrings(path.read_text(errors="replace"))
    from pydoc_data.topics import topics

    lines += [topics[key] for key in sorted(topics)]
    return lines


def run(*args: str) -> None:
    subprocess.run([sys.executable, *args], check=True, cwd=ROOT, timeout=1800,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = corpus_lines(Path(sysconfig.get_paths()["stdlib"]))
    corpus = out / "corpus.jsonl"
    with open(corpus, "w") as f:
        for text in lines:
            f.write(json.dumps({"text": text}) + "\n")
    print(f"{corpus}: {len(lines)} documents, {corpus.stat().st_size / 2**20:.1f} MiB")
    run("scripts/train_tokenizer.py", "--input", str(corpus), "--model-prefix",
        str(out / "tok"), "--vocab-size", str(args.vocab_size))
    run("scripts/preprocess_data.py", "--input", str(corpus), "--output-prefix",
        str(out / "corpus"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
        str(out / "tok.model"), "--append-eod", "--workers", "2")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
