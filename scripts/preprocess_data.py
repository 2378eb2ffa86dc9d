"""Tokenize a JSONL corpus into Megatron's indexed dataset format (`.bin` + `.idx`).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod \\
        --workers 8
    # -> data/corpus_text_document.bin / .idx; train with --data-path data/corpus_text_document

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8

Each line is a JSON object; each `--json-keys` key (default `text`) gives one output
`PREFIX_KEY_document`, one document per line (a list of strings gives one sequence per string).
`--append-eod` ends every non-empty document with the tokenizer's end-of-document id. Output
files are the ones Megatron-LM's `tools/preprocess_data.py` writes, in the same format and token
dtype (uint16 below 65500 ids, else int32).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator

from megadomino.config import ConfigError
from megadomino.data.indexed import (
    IndexedDatasetBuilder,
    bin_path,
    idx_path,
    optimal_dtype,
)
from megadomino.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer

Encoded = dict[str, tuple[list[int], list[int]]]  # key -> (token ids, sequence lengths)


class Encoder:
    """Tokenizes one JSON line into {key: (ids, sequence lengths)}; one per worker process."""

    tokenizer: Tokenizer

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def start(self) -> None:
        # On the class: a pool pickles a fresh Encoder with every task, the worker keeps the class.
        type(self).tokenizer = _tokenizer(self.args)

    def encode(self, line: str) -> tuple[Encoded | str, int]:
        """The line's documents, or why it cannot be read (returned, not raised: a worker's
        exception would surface at its chunk's first line, not at this one)."""
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return f"not a JSON object ({err.msg} at column {err.colno})", len(line)
        encoded: Encoded = {}
        for key in self.args.json_keys:
            if not isinstance(record, dict) or key not in record:
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                return f"no {key!r} key (--json-keys); the line has {found}", len(line)
            text = record[key]
            ids: list[int] = []
            lengths: list[int] = []
            for sequence in text if isinstance(text, list) else [text]:
                sequence_ids = self.tokenizer.tokenize(sequence)
                if sequence_ids:
                    ids += sequence_ids
                    lengths.append(len(sequence_ids))
            if ids and self.args.append_eod:
                ids.append(self.tokenizer.eod)
                lengths[-1] += 1
            encoded[key] = (ids, lengths)
        return encoded, len(line)


def _tokenizer(args: argparse.Namespace) -> Tokenizer:
    return build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                           args.merge_file, args.vocab_size)


def _encoded(args: argparse.Namespace, lines) -> Iterator[tuple[Encoded | str, int]]:
    encoder = Encoder(args)
    if args.workers == 1:
        encoder.start()
        yield from map(encoder.encode, lines)
        return
    with multiprocessing.Pool(args.workers, initializer=encoder.start) as pool:
        yield from pool.imap(encoder.encode, lines, chunksize=32)


def preprocess(args: argparse.Namespace) -> list[str]:
    """Write one indexed dataset per JSON key; returns their prefixes."""
    dtype = optimal_dtype(_tokenizer(args).vocab_size)
    prefixes = [f"{args.output_prefix}_{key}_document" for key in args.json_keys]
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    builders = {key: IndexedDatasetBuilder(bin_path(prefix), dtype)
                for key, prefix in zip(args.json_keys, prefixes)}
    start, total_bytes = time.time(), 0
    if not os.path.isfile(args.input):
        raise ConfigError(f"--input={args.input}: no such file")
    with open(args.input, encoding="utf-8") as lines:
        for count, (encoded, size) in enumerate(_encoded(args, lines), start=1):
            if isinstance(encoded, str):
                raise ConfigError(f"{args.input}:{count}: {encoded}")
            for key, (ids, lengths) in encoded.items():
                builders[key].add_document(ids, lengths)
            total_bytes += size
            if count % args.log_interval == 0:
                elapsed = time.time() - start
                print(f"processed {count} documents ({count / elapsed:.1f} docs/s, "
                      f"{total_bytes / elapsed / 2**20:.2f} MB/s)", file=sys.stderr)
    for key, prefix in zip(args.json_keys, prefixes):
        builders[key].finalize(idx_path(prefix))
    return prefixes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="JSONL file, one document per line")
    parser.add_argument("--output-prefix", required=True,
                        help="writes OUTPUT_PREFIX_KEY_document.bin / .idx")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys to tokenize, one output dataset each")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", help="sentencepiece model, or Hugging Face directory")
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every non-empty document with the end-of-document token")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--log-interval", type=int, default=10000,
                        help="documents between progress lines")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    return args


if __name__ == "__main__":
    try:
        for written in preprocess(parse_args()):
            print(f"wrote {bin_path(written)} and {idx_path(written)}")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
