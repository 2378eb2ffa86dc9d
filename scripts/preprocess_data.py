"""Tokenize a JSONL or plain-text corpus into Megatron's indexed dataset format (`.bin` + `.idx`).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod \\
        --workers 8
    # -> data/corpus_text_document.bin / .idx; train with --data-path data/corpus_text_document

    python scripts/preprocess_data.py --input corpus.txt --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8

A `.jsonl` / `.json` input holds one JSON object a line; each `--json-keys` key (default `text`)
gives one output `PREFIX_KEY_document`, one document per line (a list of strings gives one
sequence per string). Any other input is plain text, one document per line (as
scripts/train_tokenizer.py reads it; an empty line is an empty document), written to
`PREFIX_text_document`. `--append-eod` ends every non-empty document with the tokenizer's
end-of-document id. Output files are the ones Megatron-LM's `tools/preprocess_data.py` writes, in
the same format and token dtype (uint16 below 65500 ids, else int32); they appear only once
complete (IndexedDatasetBuilder: temporary names, synced, renamed), so a run that fails leaves
none. The last lines say how many documents and tokens each output holds.

Bad input (a missing or non-UTF-8 input, a JSONL line that is not an object or lacks a key, a
tokenizer file that does not load) ends in one line `error: ...` naming the file (and line),
exit status 2.
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
JSON_SUFFIXES = (".jsonl", ".json")


class Encoder:
    """Tokenizes one input line into {key: (ids, sequence lengths)}; one per worker process."""

    tokenizer: Tokenizer

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def start(self) -> None:
        # On the class: a pool pickles a fresh Encoder with every task, the worker keeps the class.
        type(self).tokenizer = _tokenizer(self.args)

    def encode(self, line: str) -> tuple[Encoded | str, int]:
        """The line's documents, or why it cannot be read (returned, not raised: a worker's
        exception would surface at its chunk's first line, not at this one)."""
        if not is_jsonl(self.args.input):
            return {"text": self._document(line.rstrip("\n"))}, len(line)
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
            if not (isinstance(text, str) or isinstance(text, list)
                    and all(isinstance(part, str) for part in text)):
                return (f"its {key!r} is a JSON {type(text).__name__}, not a string or a list of "
                        "strings"), len(line)
            encoded[key] = self._document(text)
        return encoded, len(line)

    def _document(self, text: str | list[str]) -> tuple[list[int], list[int]]:
        """(ids, sequence lengths) of one document: a string, or a list of sequences."""
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
        return ids, lengths


def is_jsonl(path: str) -> bool:
    return path.endswith(JSON_SUFFIXES)


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
    """Write one indexed dataset per JSON key (plain text: one, `text`); returns their
    prefixes. All of them appear once every document is written, or none (ConfigError)."""
    if not os.path.isfile(args.input):
        raise ConfigError(f"--input={args.input}: " + ("a directory: give a JSONL or text file"
                                                        if os.path.isdir(args.input)
                                                        else "no such file"))
    keys = args.json_keys if is_jsonl(args.input) else ["text"]
    if not is_jsonl(args.input) and args.json_keys != ["text"]:
        raise ConfigError(f"--json-keys reads JSONL; --input={args.input} is read as plain text, "
                          f"one document per line (name it {JSON_SUFFIXES[0]} if it is JSONL)")
    dtype = optimal_dtype(_tokenizer(args).vocab_size)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in keys}
    builders: dict[str, IndexedDatasetBuilder] = {}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
        for key, prefix in prefixes.items():
            builders[key] = IndexedDatasetBuilder(bin_path(prefix), dtype)
        _write_documents(args, builders)
        for key, prefix in prefixes.items():
            builders[key].finalize(idx_path(prefix))
    except OSError as err:  # the output's side: a read-only directory, a full disk
        raise ConfigError(f"--output-prefix={args.output_prefix}: cannot write "
                          f"{err.filename or 'there'} ({err.strerror})") from None
    finally:
        for builder in builders.values():
            builder.discard()  # nothing once finalized
    for key, prefix in prefixes.items():
        print(f"wrote {bin_path(prefix)} and {idx_path(prefix)}: "
              f"{len(builders[key].document_indices) - 1} documents, "
              f"{builders[key].num_tokens} tokens")
    return list(prefixes.values())


def _write_documents(args: argparse.Namespace, builders: dict[str, IndexedDatasetBuilder]
                     ) -> None:
    """Tokenize every line of --input into `builders`, with a progress line every
    --log-interval documents."""
    start, total_bytes = time.time(), 0
    try:
        lines = open(args.input, encoding="utf-8")  # closed by the `with` below
    except OSError as err:
        raise ConfigError(f"--input={args.input}: cannot read it ({err.strerror})") from None
    try:
        with lines:
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
    except UnicodeDecodeError:
        raise ConfigError(f"--input={args.input}:{_first_undecodable_line(args.input)} is not "
                          "UTF-8 text: give a UTF-8 JSONL or text file") from None


def _first_undecodable_line(path: str) -> int:
    """The number of the first line of `path` that is not UTF-8 (a read decodes whole chunks,
    so the error itself does not say which line)."""
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True,
                        help="JSONL file (.jsonl / .json), or plain text: one document per line")
    parser.add_argument("--output-prefix", required=True,
                        help="writes OUTPUT_PREFIX_KEY_document.bin / .idx")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="JSONL keys to tokenize, one output dataset each")
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


def main(argv: list[str] | None = None) -> int:
    try:
        preprocess(parse_args(argv))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
