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
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator


def sentences(path: str, json_keys: list[str]) -> Iterator[str]:
    """The training text: each JSON line's keys (strings or lists of strings), or each line."""
    is_json = path.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if not is_json:
                yield line.rstrip("\n")
                continue
            if not line.strip():
                continue
            record = json.loads(line)
            for key in json_keys:
                value = record[key]
                yield from (value if isinstance(value, list) else [value])


def train(args: argparse.Namespace) -> str:
    """Train and save `MODEL_PREFIX.model`; returns its path."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sentences(args.input, args.json_keys), model_prefix=args.model_prefix,
        vocab_size=args.vocab_size, model_type=args.model_type, byte_fallback=True,
        character_coverage=args.character_coverage, input_sentence_size=args.max_sentences,
        shuffle_input_sentence=True, minloglevel=2)
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


if __name__ == "__main__":
    print(f"wrote {train(parse_args())}")
