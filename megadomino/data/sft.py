"""Supervised fine-tuning data: JSONL `{"prompt": ..., "response": ...}` pairs, loss on responses.

A sample is one example, laid out as

    tokens    = tokenize(template with {prompt} filled in) + tokenize(response) + [eod]
    loss_mask = 0 on the labels that are prompt tokens, 1 on the response's tokens and its eod

cut to seq_length + 1 tokens and padded with the tokenizer's pad id (its eod when it has none),
padding masked out. The response is tokenized on its own, and a BOS the tokenizer puts in front
of every text (Llama-2's) is dropped from it, so the model sees one BOS, at the start. Examples
are not packed: without per-document attention masks they would attend to each other.

A split of n examples serves any number of samples: sample i is example perm_e[i mod n] of epoch
e = i div n, perm_e a permutation drawn from (seed, split, e) alone, so every rank, and a resumed
run, sees the same sample i.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megadomino.config import ConfigError
from megadomino.data.builder import SPLITS, parse_split
from megadomino.data.tokenizer import Tokenizer


def read_examples(paths: Sequence[str]) -> list[tuple[str, str]]:
    """(prompt, response) of every line of the JSONL files, in order; ConfigError naming the file
    and line of a line that is not a JSON object with string "prompt" and "response"."""
    return [(prompt, response) for _, _, prompt, response in _read_lines(paths)]


def _read_lines(paths: Sequence[str]) -> list[tuple[str, int, str, str]]:
    """(file, line number, prompt, response) of every example (see read_examples)."""
    examples = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as file:
                lines = file.readlines()
        except UnicodeDecodeError as err:
            raise ConfigError(f"--data-path {path} is not UTF-8 text (byte {err.start}): give "
                              "JSONL files of {\"prompt\", \"response\"}") from None
        except OSError as err:
            raise ConfigError(f"--data-path {path}: {err.strerror}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"--data-path {path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not all(
                    isinstance(record.get(key), str) for key in ("prompt", "response")):
                raise ConfigError(f"--data-path {path}:{number}: expected an object with string "
                                  "\"prompt\" and \"response\"")
            examples.append((path, number, record["prompt"], record["response"]))
    if not examples:
        raise ConfigError(f"--data-path {' '.join(paths)}: no examples")
    return examples


class SFTDataset:
    """`dataset[i]` is {"tokens": LongTensor [seq_length + 1], "loss_mask": FloatTensor
    [seq_length]}, for i < num_samples."""

    def __init__(self, examples: list[tuple[str, str]], tokenizer: Tokenizer, seq_length: int,
                 prompt_template: str, seed: int, split: str, num_samples: int):
        self.examples, self.tokenizer = examples, tokenizer
        self.seq_length, self.prompt_template = seq_length, prompt_template
        self.seed, self.split_index = seed, SPLITS.index(split)
        self.num_samples = num_samples
        self.pad = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod
        self._permutations: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"SFT sample {index} is outside [0, {self.num_samples})")
        epoch, position = divmod(index, len(self.examples))
        if epoch not in self._permutations:
            rng = np.random.default_rng([self.seed, self.split_index, epoch])
            self._permutations = {epoch: rng.permutation(len(self.examples))}
        prompt, response = self.examples[self._permutations[epoch][position]]
        return self.encode(prompt, response)

    def encode(self, prompt: str, response: str) -> dict[str, torch.Tensor]:
        """The sample of one example (see the module docstring)."""
        tokenizer = self.tokenizer
        prompt_ids = tokenizer.tokenize(self.prompt_template.replace("{prompt}", prompt))
        response_ids = tokenizer.tokenize(response)
        if tokenizer.bos is not None and response_ids[:1] == [tokenizer.bos]:
            response_ids = response_ids[1:]
        ids = (prompt_ids + response_ids + [tokenizer.eod])[:self.seq_length + 1]
        tokens = torch.full((self.seq_length + 1,), self.pad, dtype=torch.long)
        tokens[:len(ids)] = torch.tensor(ids, dtype=torch.long)
        # Label t is tokens[t + 1]: a response token when t + 1 >= len(prompt_ids).
        labels = torch.arange(1, self.seq_length + 1)
        loss_mask = ((labels >= len(prompt_ids)) & (labels < len(ids))).float()
        return {"tokens": tokens, "loss_mask": loss_mask}


def check_token_ids(lines: list[tuple[str, int, str, str]], tokenizer: Tokenizer,
                    prompt_template: str, vocab_size: int, vocab_source: str,
                    log: Callable[[str], None] = print) -> None:
    """ConfigError naming the file and line of the first example whose tokens (template, prompt,
    response, eod, pad) reach `vocab_size`, or that the tokenizer cannot tokenize (words given
    to NullTokenizer); a progress line every 10 seconds."""
    began = shown = time.monotonic()
    extra = [tokenizer.eod] + ([tokenizer.pad] if tokenizer.pad is not None else [])
    for position, (path, number, prompt, response) in enumerate(lines):
        try:
            ids = tokenizer.tokenize(prompt_template.replace("{prompt}", prompt))
            ids += tokenizer.tokenize(response) + extra
        except ValueError as err:  # NullTokenizer's text is ids: "What" is not one
            raise ConfigError(f"--data-path {path}:{number}: {type(tokenizer).__name__} cannot "
                              f"tokenize this example ({err}); NullTokenizer reads "
                              "space-separated token ids, text needs a real --tokenizer-type"
                              ) from None
        largest = max(ids)
        if largest >= vocab_size or min(ids) < 0:
            bad = largest if largest >= vocab_size else min(ids)
            raise ConfigError(f"{path}:{number}: token id {bad} is outside the vocabulary of "
                              f"{vocab_size} ids (ids 0 to {vocab_size - 1}, set by "
                              f"{vocab_source})")
        if time.monotonic() - shown > 10:
            shown = time.monotonic()
            log(f" checking the token ids of --data-path: {position + 1} of {len(lines)} "
                f"examples ({shown - began:.0f} s)")


def build_sft_datasets(paths: Sequence[str], split: str, tokenizer: Tokenizer, seq_length: int,
                       prompt_template: str, seed: int, num_samples: tuple[int, int], *,
                       vocab_size: int | None = None, vocab_source: str = "--vocab-size"
                       ) -> tuple[SFTDataset, SFTDataset | None]:
    """(train, valid) over the examples of `paths`, divided into consecutive train / valid
    ranges by `split` (a test part is left unused); valid is None when its part or its sample
    count is 0. With `vocab_size`, every example is tokenized once up front and must give ids
    below it (ConfigError naming its file and line, and `vocab_source`)."""
    lines = _read_lines(paths)
    if vocab_size is not None:
        check_token_ids(lines, tokenizer, prompt_template, vocab_size, vocab_source)
    examples = [(prompt, response) for _, _, prompt, response in lines]
    datasets = []
    for index, (name, count) in enumerate(zip(SPLITS, num_samples)):
        bounds = parse_split(split)[index]
        part = [] if bounds is None else examples[round(bounds[0] * len(examples)):
                                                  round(bounds[1] * len(examples))]
        if not part or count == 0:
            if name == "train":
                raise ConfigError(f"--split {split!r} leaves no training examples of the "
                                  f"{len(examples)} in --data-path")
            datasets.append(None)
            continue
        datasets.append(SFTDataset(part, tokenizer, seq_length, prompt_template, seed, name,
                                   count))
    return datasets[0], datasets[1]
