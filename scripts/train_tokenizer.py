"""Train a small sentencepiece tokenizer from plain text or JSONL.

    python scripts/train_tokenizer.py --input corpus.jsonl --model-prefix data/tok \\
        --vocab-size 8000
    # -> data/tok.model (and data/tok.vocab); then
    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tok.model --append-eod

A `.jsonl` / `.json` input contributes the `--json-keys` fields of each line (default `text`);
any other file is read as plain text, one sentence per line. The model is BPE by default
(`--model-type unigram` for sentencepiece's default), with byte fallback so that no text is
unknown, and the usual <unk>=0, <s>=1, </s>=2 ids.

Bad input (a missing file, a line that is not JSON or lacks a key, a vocabulary larger than the
text allows) ends in one line `error: ...` naming the file (and line), exit status 2. How much
text a vocabulary needs: sentencepiece refuses a --vocab-size larger than the text supports, and
says the largest it allows; 32000 trains on about 1 MB of English text at the least (300 KB
allows about 15000), and a useful vocabulary comes from far more, up to the 1M lines sampled
(--max-sentences).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator

from megadomino.config import ConfigError


def sentences(path: str, json_keys: list[str]) -> Iterator[str]:
    """The training text: each JSON line's keys (strings or lists of strings), or each line."""
    is_json = path.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not is_json:
                yield line.rstrip("\n")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{number}: not a JSON line ({err})") from None
            for key in json_keys:
                if not isinstance(record, dict) or key not in record:
                    raise ConfigError(f"{path}:{number}: no {key!r} field (--json-keys "
                                      f"{' '.join(json_keys)})")
                value = record[key]
                yield from (value if isinstance(value, list) else [value])


class _Text:
    """The sentences, remembering the ConfigError that ended them: sentencepiece turns an
    exception raised by its iterator into a RuntimeError of its own."""

    def __init__(self, path: str, json_keys: list[str]):
        self.path, self.json_keys, self.error = path, json_keys, None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from sentences(self.path, self.json_keys)
        except ConfigError as err:
            self.error = err
            raise


def train(args: argparse.Namespace) -> str:
    """Train and save `MODEL_PREFIX.model`; returns its path."""
    import sentencepiece

    if not os.path.isfile(args.input):
        raise ConfigError(f"--input={args.input}: no such file")
    text = _Text(args.input, args.json_keys)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(text), model_prefix=args.model_prefix,
            vocab_size=args.vocab_size, model_type=args.model_type, byte_fallback=True,
            character_coverage=args.character_coverage, input_sentence_size=args.max_sentences,
            shuffle_input_sentence=True, minloglevel=2)
    except RuntimeError as err:  # sentencepiece's own refusals come as RuntimeError
        if text.error is not None:
            raise text.error from None
        most = re.search(r"value <= (\d+)", str(err))
        if most is not None:
            raise ConfigError(f"--vocab-size {args.vocab_size} is more than the text of --input "
                              f"{args.input} supports (at most {most.group(1)}): give a smaller "
                              "--vocab-size, or more text (32000 needs about 1 MB of English "
                              "at the least)") from None
        raise ConfigError(f"sentencepiece cannot train on --input {args.input} with these "
                          f"settings (e.g. a smaller --vocab-size): {err}") from None
    return f"{args.model_prefix}.model"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="text file, or JSONL")
    parser.add_argument("--model-prefix", required=True, help="writes MODEL_PREFIX.model/.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--model-type", choices=("bpe", "unigram", "char", "word"),
                        default="bpe")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="JSONL fields to train on")
    parser.add_argument("--character-coverage", type=float, default=0.9995)
    parser.add_argument("--max-sentences", type=int, default=1_000_000,
                        help="sample at most this many sentences (0: all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(f"wrote {train(args)}")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
