"""Input data that would train silently wrong is refused up front, naming the file: token ids at
or above the (unpadded) vocabulary in indexed, blended and SFT data; .idx files that contradict
themselves or their .bin; and index caches are keyed by what the data is, so re-tokenizing into
the same prefix, or a damaged cache file, never serves stale indices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megadomino.config import ConfigError
from megadomino.data import IndexedDataset, IndexedDatasetBuilder
from megadomino.data.builder import build_train_valid_test_datasets
from megadomino.data.gpt_dataset import GPTDataset
from megadomino.data.indexed import MAGIC
from megadomino.data.sft import build_sft_datasets
from megadomino.data.tokenizer import NullTokenizer

ROOT = Path(__file__).parent.parent
EOD = 0


def write_corpus(prefix: Path, documents: list[list[int]], dtype=np.int32) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for tokens in documents:
        builder.add_document(tokens, [len(tokens)] if tokens else [])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def documents(count: int, largest: int, seed: int = 0) -> list[list[int]]:
    """`count` documents of 5-12 ids below 50, ending in EOD; the last holds `largest`."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 50, size=rng.integers(5, 12)).tolist() + [EOD] for _ in range(count)]
    docs[-1][0] = largest
    return docs


def build(prefixes: list[str], vocab_size: int | None, cache_dir: str | None, **kwargs):
    return build_train_valid_test_datasets(prefixes, "1", 8, 1, (20, 0, 0), EOD, False,
                                           cache_dir, vocab_size=vocab_size, **kwargs)


# ---- token ids against the vocabulary ------------------------------------------------------


@pytest.mark.parametrize("largest", [320, 383, 60000])  # padding band of 320 at TP 4 / beyond
def test_indexed_ids_at_or_above_the_vocabulary_are_refused(tmp_path, largest):
    prefix = write_corpus(tmp_path / "corpus", documents(30, largest))
    with pytest.raises(ConfigError, match=rf"corpus\.bin holds token id {largest}, but the "
                                          r"vocabulary has 320 ids .*--vocab-size"):
        build([prefix], 320, str(tmp_path / "cache"))
    build([prefix], largest + 1, str(tmp_path / "cache"))  # the same data with a larger vocab


def test_blend_names_the_member_with_bad_ids(tmp_path):
    good = write_corpus(tmp_path / "good", documents(30, 49))
    bad = write_corpus(tmp_path / "bad", documents(30, 400, seed=1))
    with pytest.raises(ConfigError, match=r"bad\.bin holds token id 400.*--tokenizer-type X"):
        build(["0.5", good, "0.5", bad], 320, str(tmp_path / "cache"),
              vocab_source="--tokenizer-type X")


def test_largest_id_is_computed_once_and_cached(tmp_path, monkeypatch, capsys):
    prefix = write_corpus(tmp_path / "corpus", documents(30, 300))
    build([prefix], 320, str(tmp_path / "cache"))
    assert "largest token id of" in capsys.readouterr().out
    assert list((tmp_path / "cache").glob("*-IndexedDataset-max_token_id.npy"))

    def scan_again(self, *args, **kwargs):
        raise AssertionError("the largest id was scanned again instead of read from the cache")

    monkeypatch.setattr(IndexedDataset, "max_token_id", scan_again)
    build([prefix], 320, str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="token id 300"):
        build([prefix], 300, str(tmp_path / "cache"))


def test_sft_ids_outside_the_vocabulary_name_the_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    lines = [{"prompt": "1 2 3", "response": "4 5"}, {"prompt": "6", "response": "7 150 8"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    tokenizer = NullTokenizer(99)  # ids 0..98, eod 99: a vocabulary of 100
    with pytest.raises(ConfigError, match=r"sft\.jsonl:2: token id 150 is outside the "
                                          r"vocabulary of 100 ids .*--vocab-size"):
        build_sft_datasets([str(path)], "1,0,0", tokenizer, 8, "{prompt}", 1, (4, 0),
                           vocab_size=tokenizer.vocab_size)
    lines[1]["response"] = "7 98 8"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    build_sft_datasets([str(path)], "1,0,0", tokenizer, 8, "{prompt}", 1, (4, 0),
                       vocab_size=tokenizer.vocab_size)


def test_pretrain_refuses_bad_ids_in_one_line_with_status_2(tmp_path):
    """pretrain_gpt.py with --vocab-size 320 on data holding id 383 (in the padding band)."""
    prefix = write_corpus(tmp_path / "corpus", documents(40, 383))
    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--model-preset", "gpt-tiny", "--seq-length", "8",
         "--max-position-embeddings", "8", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "320", "--data-path", prefix, "--split", "1,0,0",
         "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "corpus.bin holds token id 383" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


# ---- .idx validation -----------------------------------------------------------------------


def _arrays(prefix: str) -> tuple[bytes, int, int]:
    raw = Path(f"{prefix}.idx").read_bytes()
    sequences = int.from_bytes(raw[18:26], "little")
    return raw, sequences, len(MAGIC) + 8 + 1 + 16


def _corrupt(tmp_path: Path, name: str, edit) -> str:
    """A copy of a 4-document corpus whose .idx bytes went through `edit`."""
    prefix = write_corpus(tmp_path / "good", [[1, 2, 3], [4, 5], [], [6, 7, 8, 9]])
    raw, sequences, header = _arrays(prefix)
    target = tmp_path / name
    Path(f"{target}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes())
    Path(f"{target}.idx").write_bytes(edit(bytearray(raw), sequences, header))
    return str(target)


def _set(raw: bytearray, offset: int, value: int, size: int) -> bytearray:
    raw[offset:offset + size] = value.to_bytes(size, "little", signed=True)
    return raw


CORRUPTIONS = {
    "negative-length": (lambda raw, n, h: _set(raw, h + 4, -2, 4), "sequence 1 has length -2"),
    "pointer": (lambda raw, n, h: _set(raw, h + 4 * n + 8 * 2, 4, 8),
                "sequence 2 starts at byte 4, the lengths before it put it at 20"),
    "documents-decrease": (lambda raw, n, h: _set(raw, h + 12 * n + 8 * 2, 0, 8),
                           "document 2 starts at sequence 0, before document 1"),
    "documents-start": (lambda raw, n, h: _set(raw, h + 12 * n, 1, 8),
                        "document indices must run from 0"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_contradictory_index_is_refused_naming_the_file(tmp_path, name):
    edit, message = CORRUPTIONS[name]
    prefix = _corrupt(tmp_path, name, edit)
    with pytest.raises(ConfigError, match=rf"{name}\.idx is corrupt: {message}"):
        IndexedDataset(prefix)


def test_index_of_another_dtype_than_its_bin_is_refused(tmp_path):
    """A uint16 run's .idx beside an int32 run's .bin of the same documents."""
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    narrow = write_corpus(tmp_path / "narrow", docs, np.uint16)
    wide = write_corpus(tmp_path / "wide", docs, np.int32)
    os.replace(f"{narrow}.idx", f"{wide}.idx")
    with pytest.raises(ConfigError, match=r"wide\.bin holds 36 bytes, but .*wide\.idx implies "
                                          r"18 \(9 tokens of uint16\).* do not belong together"):
        IndexedDataset(wide)


def test_bin_longer_than_its_index_is_refused(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", [[1, 2, 3]])
    with open(f"{prefix}.bin", "ab") as file:
        file.write(b"\0" * 8)
    with pytest.raises(ConfigError, match=r"corpus\.bin holds 20 bytes, but .*implies 12"):
        IndexedDataset(prefix)


# ---- the index cache -----------------------------------------------------------------------


def _indices(ds: GPTDataset) -> list[np.ndarray]:
    return [np.asarray(ds.document_index), np.asarray(ds.sample_index),
            np.asarray(ds.shuffle_index)]


def test_retokenized_prefix_of_the_same_idx_size_is_not_served_stale_indices(tmp_path):
    """Same sequence and document counts (so the same .idx size, the old cache key), other
    lengths: the cache misses and the indices are those of the new data."""
    cache = str(tmp_path / "cache")
    prefix = write_corpus(tmp_path / "corpus", [[1] * 5, [2] * 9, [3] * 7, [4] * 11])
    size = os.path.getsize(f"{prefix}.idx")
    first = build([prefix], None, cache)[0]
    assert not first.from_cache and build([prefix], None, cache)[0].from_cache
    write_corpus(tmp_path / "corpus", [[1] * 12, [2] * 3, [3] * 8, [4] * 6])
    assert os.path.getsize(f"{prefix}.idx") == size
    second = build([prefix], None, cache)[0]
    fresh = build([prefix], None, None)[0]
    assert not second.from_cache
    for cached, built in zip(_indices(second), _indices(fresh)):
        np.testing.assert_array_equal(cached, built)


def test_damaged_cache_file_is_rebuilt_with_a_notice(tmp_path, capsys):
    cache = tmp_path / "cache"
    prefix = write_corpus(tmp_path / "corpus", documents(30, 49))
    expected = _indices(build([prefix], None, str(cache))[0])
    damaged = next(cache.glob("*-GPTDataset-train-sample_index.npy"))
    damaged.write_bytes(damaged.read_bytes()[:40])
    rebuilt = build([prefix], None, str(cache))[0]
    assert not rebuilt.from_cache
    assert f"index cache file {damaged} does not load" in capsys.readouterr().out
    for got, want in zip(_indices(rebuilt), expected):
        np.testing.assert_array_equal(got, want)
    assert build([prefix], None, str(cache))[0].from_cache


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("lines, named", [
    (['{"text": "1 2"}', '{"text": "3"}', '{"txt": "4"}'],
     ":3: no 'text' key (--json-keys); the line has ['txt']"),
    (['{"text": "5"}', "not json"], ":2: not a JSON object (Expecting value at column 1)"),
])
def test_preprocess_names_the_bad_jsonl_line(tmp_path, lines, named, workers):
    """One `error:` line with file:line and exit 2, with one worker or a pool (whose chunks would
    otherwise report their first line)."""
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "preprocess_data.py"),
                           "--input", str(source), "--output-prefix", str(tmp_path / "out"),
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
                           "--workers", str(workers)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {source}{named}"], done.stderr
