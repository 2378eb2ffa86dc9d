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
                               directory (no download); eod = eos
    NullTokenizer              --vocab-size V               text is space-separated ids; eod = V
"""

from __future__ import annotations

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

        self.model = sentencepiece.SentencePieceProcessor(model_file=model_file)
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

        self.tokenizer = _Tokenizer(models.BPE.from_file(vocab_file, merge_file))
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
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
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


def _id_or_none(piece_id: int) -> int | None:
    return piece_id if piece_id >= 0 else None
