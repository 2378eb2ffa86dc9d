"""Tokenizers under Megatron-LM's `--tokenizer-type` names, with Megatron's ids and special tokens.

`build_tokenizer(tokenizer_type, ...)` returns a `Tokenizer`: `tokenize(text) -> list[int]`,
`detokenize(ids) -> str`, `vocab_size` (the unpadded vocabulary, what `--vocab-size` would be),
`eod` (the end-of-document id that `--append-eod` appends and `--eod-mask-loss` masks), and `bos`
/ `pad` where the vocabulary has one (else None). The ids match Megatron's, so data preprocessed
by either tool trains alike:

    SentencePieceTokenizer     --tokenizer-model M.model   sentencepiece, plus Megatron's specials
                               <CLS> <SEP> <EOD> <MASK> (and <PAD> / <BOS> / <EOS> where the model
                               lacks one) appended after the model's pieces; eod = <EOD>
    GPTSentencePieceTokenizer  --tokenizer-model M.model   plain sentencepiece; eod = eos
    Llama2Tokenizer            --tokenizer-model M.model   plain sentencepiece, BOS prepended to
                               every text; eod = eos
    GPT2BPETokenizer           --vocab-file vocab.json --merge-file merges.txt
                               byte-level BPE through `tokenizers`; eod = <|endoftext|>
    HuggingFaceTokenizer       --tokenizer-model DIR       transformers.AutoTokenizer from a local
                               directory (no download; pip install megadomino[hf]); eod = eos
    NullTokenizer              --vocab-size V               text is space-separated ids; eod = V

Each file is checked as it is read, on every rank before any process group: a missing, empty,
truncated or corrupt file, a directory where a file goes (or the reverse), or a file of another
kind is a ConfigError naming the flag and the file (docs/tokenizers.md: getting the files).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

from megadomino.config import ConfigError


class Tokenizer:
    """What every tokenizer offers; see the module docstring for each type's ids."""

    vocab_size: int
    eod: int
    bos: int | None = None
    pad: int | None = None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError


class GPTSentencePieceTokenizer(Tokenizer):
    """A sentencepiece model as is: ids are the model's pieces, eod is its eos."""

    def __init__(self, model_file: str):
        import sentencepiece

        _check_file(model_file, "--tokenizer-model", "a SentencePiece .model file")
        try:
            self.model = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as err:  # sentencepiece's parse errors are RuntimeErrors
            raise ConfigError(
                f"--tokenizer-model={model_file} is not a SentencePiece model ({err}): give the "
                "tokenizer's .model file (a tokenizer.json or a Hugging Face tokenizer directory "
                "goes with --tokenizer-type HuggingFaceTokenizer)") from None
        self.vocab_size = self.model.get_piece_size()
        self.eod = self.model.eos_id()
        self.bos = _id_or_none(self.model.bos_id())
        self.pad = _id_or_none(self.model.pad_id())

    def tokenize(self, text: str) -> list[int]:
        return self.model.encode_as_ids(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.model.decode_ids(list(ids))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama-2's convention: every tokenized text starts with BOS."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self.bos is None:
            raise ConfigError(f"--tokenizer-type Llama2Tokenizer: {model_file} has no BOS piece")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self.model.encode_as_ids(text)]


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron's `SentencePieceTokenizer`: the model's pieces, then special tokens appended
    (those the model lacks), in Megatron's order; their strings in a text map to their ids."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        vocab = {self.model.id_to_piece(i): i for i in range(self.vocab_size)}
        self.special_tokens: dict[str, int] = {}

        def add(piece: str) -> int:
            vocab.setdefault(piece, len(vocab))
            self.special_tokens[piece] = vocab[piece]
            return vocab[piece]

        for piece in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(piece)
        self.eod = self.special_tokens["<EOD>"]
        pad, bos, eos = (self._piece(i, default) for i, default in
                         ((self.model.pad_id(), "<PAD>"), (self.model.bos_id(), "<BOS>"),
                          (self.model.eos_id(), "<EOS>")))
        self.pad, self.bos = add(pad), add(bos)
        add(eos)
        self.vocab_size = len(vocab)
        self._names = {i: piece for piece, i in self.special_tokens.items()}
        # Alternatives in insertion order: at one position the earlier-added token wins, as in
        # Megatron's scan for the nearest special token.
        self._split = re.compile("(" + "|".join(map(re.escape, self.special_tokens)) + ")")

    def _piece(self, piece_id: int, default: str) -> str:
        return self.model.id_to_piece(piece_id) if 0 <= piece_id < self.model.get_piece_size() \
            else default

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # the captured separators: special tokens
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(self.model.encode_as_ids(part))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        text, start = "", 0
        ids = list(ids)
        for i, token in enumerate(ids):
            if token in self._names:
                text += self.model.decode_ids(ids[start:i]) + " " + self._names[token] + " "
                start = i + 1
        return text + self.model.decode_ids(ids[start:])


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (the `tokenizers` library).
    <|endoftext|> in a text is ordinary text, as in Megatron; it is only ever added as `eod`."""

    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer as _Tokenizer
        from tokenizers import decoders, models, pre_tokenizers

        _check_gpt2_vocab(vocab_file)
        _check_gpt2_merges(merge_file)
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as err:  # `tokenizers` raises plain Exceptions
            raise ConfigError(f"--vocab-file={vocab_file} and --merge-file={merge_file} do not "
                              f"make a BPE tokenizer ({err}): give GPT-2's vocab.json and "
                              "merges.txt of one tokenizer") from None
        self.tokenizer = _Tokenizer(bpe)
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tokenizer.decoder = decoders.ByteLevel()
        vocab = self.tokenizer.get_vocab()
        if "<|endoftext|>" not in vocab:
            raise ConfigError(f"--vocab-file {vocab_file} has no <|endoftext|> token")
        self.vocab_size = len(vocab)
        self.eod = vocab["<|endoftext|>"]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


class HuggingFaceTokenizer(Tokenizer):
    """`transformers.AutoTokenizer` from a local directory; `tokenize` adds the tokenizer's own
    special tokens (e.g. Llama's BOS), as Megatron's HuggingFaceTokenizer does."""

    def __init__(self, path: str):
        where = f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model={path}"
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ConfigError(f"{where} needs the transformers package, which is not installed "
                              f"({err}): pip install megadomino[hf]") from None
        wanted = ("give the directory holding tokenizer.json or tokenizer_config.json (what "
                  "save_pretrained writes)")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{where} is a file, not a directory: {wanted}; a SentencePiece "
                              ".model goes with --tokenizer-type SentencePieceTokenizer")
        if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, name))
                                           for name in HF_TOKENIZER_FILES):
            raise ConfigError(f"{where} holds neither {' nor '.join(HF_TOKENIZER_FILES)}: "
                              f"{wanted}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:  # transformers and tokenizers raise any kind for a bad file
            found = "cannot load its tokenizer" if os.path.isdir(path) else (
                "no such directory, nor a model name in the local Hugging Face cache")
            reason = " ".join(str(err).split())[:200]
            raise ConfigError(f"{where}: {found} ({type(err).__name__}: {reason}): "
                              f"{wanted}") from None
        if self.tokenizer.eos_token_id is None:
            raise ConfigError(f"--tokenizer-model {path}: the tokenizer has no eos token to use "
                              f"as end of document")
        self.vocab_size = len(self.tokenizer)
        self.eod = self.tokenizer.eos_token_id
        self.bos = self.tokenizer.bos_token_id
        self.pad = self.tokenizer.pad_token_id

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


class NullTokenizer(Tokenizer):
    """Text is already ids, space-separated; ids are < vocab_size and eod is vocab_size."""

    def __init__(self, vocab_size: int):
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1

    def tokenize(self, text: str) -> list[int]:
        return [int(token) for token in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(token)) for token in ids)


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A Hugging Face tokenizer directory holds at least one of these."""

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer `--tokenizer-type` names, from the files its flags name; ConfigError naming
    the missing flag otherwise."""

    def need(value, flag: str):
        if value is None:
            raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag}")
        local = flag != "--tokenizer-model" or tokenizer_type != "HuggingFaceTokenizer"
        if local and flag != "--vocab-size" and not os.path.exists(value):
            raise ConfigError(f"{flag}={value}: no such file (--tokenizer-type {tokenizer_type})")
        return value

    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(need(tokenizer_model, "--tokenizer-model"))
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(need(tokenizer_model, "--tokenizer-model"))
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(need(tokenizer_model, "--tokenizer-model"))
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(need(vocab_file, "--vocab-file"), need(merge_file, "--merge-file"))
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(need(tokenizer_model, "--tokenizer-model"))
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(need(vocab_size, "--vocab-size"))
    raise ConfigError(f"--tokenizer-type {tokenizer_type} is not supported: use one of "
                      f"{', '.join(TOKENIZER_TYPES)}")


def _check_file(path: str, flag: str, kind: str) -> None:
    """ConfigError naming `flag` unless `path` is a non-empty regular file (`kind` says what it
    should be): a directory or a 0-byte file (an interrupted download) is never a tokenizer."""
    if not os.path.exists(path):
        raise ConfigError(f"{flag}={path}: no such file: give {kind}")
    if os.path.isdir(path):
        raise ConfigError(f"{flag}={path} is a directory: give {kind}")
    if os.path.getsize(path) == 0:
        raise ConfigError(f"{flag}={path} is empty (0 bytes): give {kind}")


def _read_text(path: str, flag: str, kind: str) -> str:
    _check_file(path, flag, kind)
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{flag}={path} is not UTF-8 text (byte {err.start}): give "
                          f"{kind}") from None
    except OSError as err:
        raise ConfigError(f"{flag}={path}: cannot read it ({err.strerror})") from None


def _check_gpt2_vocab(path: str) -> None:
    """ConfigError naming --vocab-file unless `path` is a JSON object of token -> id."""
    kind = "GPT-2's vocab.json, a JSON object of token -> id"
    try:
        vocab = json.loads(_read_text(path, "--vocab-file", kind))
    except json.JSONDecodeError as err:
        raise ConfigError(f"--vocab-file={path} is not JSON ({err.msg} at line {err.lineno}, "
                          f"column {err.colno}; truncated?): give {kind}") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ConfigError(f"--vocab-file={path} holds a JSON {type(vocab).__name__} that does "
                          f"not map tokens to ids: give {kind}")


def _check_gpt2_merges(path: str) -> None:
    """ConfigError naming --merge-file and the line unless `path` is GPT-2's merges.txt:
    `#version` lines, and one merge `a b` (one space) per other line."""
    kind = "GPT-2's merges.txt, one merge 'a b' per line"
    lines = _read_text(path, "--merge-file", kind).splitlines()
    for number, line in enumerate(lines, start=1):  # `tokenizers`' rule, and no empty token
        parts = line.split(" ")
        if not line.startswith("#version") and (len(parts) != 2 or not all(parts)):
            raise ConfigError(f"--merge-file={path}:{number} is not a merge ({line[:40]!r}; "
                              f"truncated?): give {kind}")


def _id_or_none(piece_id: int) -> int | None:
    return piece_id if piece_id >= 0 else None
