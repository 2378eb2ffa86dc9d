"""Data: Megatron's .bin/.idx format, tokenizers, preprocessing, GPT samples, splits, blends,
caching, and a tiny GPT trained at DP=2 on a preprocessed corpus (loss falls, no sample is read by
two DP ranks in a step). Synthetic token ids encode (document, position) so that every sample
can be checked against the concatenated documents."""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from configs import make_config
from dist_utils import C, DistSuite, check_result
from megadomino.config import ConfigError, ModelConfig
from megadomino.data import (
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_tokenizer,
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
)
from megadomino.data.blend import blending_indices, normalize_weights
from megadomino.data.gpt_dataset import build_indices
from megadomino.distributed import ParallelDims
from megadomino.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
EOD = 7  # synthetic documents end with it; their other tokens are 1000 * (doc + 1) + position


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _synthetic(prefix: Path, lengths: list[int], base: int = 1000) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for d, length in enumerate(lengths):
        tokens = base * (d + 1) + np.arange(length)
        if length:
            tokens[-1] = EOD
        builder.add_document(tokens, [length] if length else [])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _lengths(count: int, seed: int, low: int = 0, high: int = 40) -> list[int]:
    return np.random.default_rng(seed).integers(low, high, size=count).tolist()


# ---- the .bin/.idx format --------------------------------------------------------------------


@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4)])
def test_reference_layout_loads_and_our_writer_matches_it(tmp_path, dtype, code):
    # Three documents: two sequences, none (an empty document), one sequence.
    sequences = [[5, 6, 7], [8], [9, 10, 11, 12]]
    document_indices = [0, 2, 2, 3]
    lengths = np.array([len(s) for s in sequences], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * np.dtype(dtype).itemsize])
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
           + struct.pack("<Q", len(sequences)) + struct.pack("<Q", len(document_indices))
           + lengths.tobytes() + pointers.astype("<i8").tobytes()
           + np.array(document_indices, "<i8").tobytes())
    data = np.concatenate(sequences).astype(dtype).tobytes()
    (tmp_path / "ref.idx").write_bytes(idx)
    (tmp_path / "ref.bin").write_bytes(data)

    ds = IndexedDataset(str(tmp_path / "ref"))
    assert (len(ds), ds.num_documents, ds.dtype) == (3, 3, np.dtype(dtype))
    assert [ds[i].tolist() for i in range(3)] == sequences
    assert ds.get(2, offset=1, length=2).tolist() == [10, 11]
    assert ds.get(2, offset=3).tolist() == [12]
    assert ds.document_indices.tolist() == document_indices
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)

    builder = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype)
    builder.add_document([5, 6, 7, 8], [3, 1])
    builder.add_document([], [])
    builder.add_document([9, 10, 11, 12], [4])
    builder.finalize(str(tmp_path / "ours.idx"))
    assert (tmp_path / "ours.idx").read_bytes() == idx
    assert (tmp_path / "ours.bin").read_bytes() == data


def test_bad_index_files_are_refused(tmp_path):
    prefix = _synthetic(tmp_path / "good", [4, 5])
    raw = Path(f"{prefix}.idx").read_bytes()
    for name, idx in (("magic", b"XXIDIDX\x00\x00" + raw[9:]), ("short", raw[:-8])):
        (tmp_path / f"{name}.idx").write_bytes(idx)
        (tmp_path / f"{name}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes())
        with pytest.raises(ValueError, match="MMIDIDX" if name == "magic" else "truncated"):
            IndexedDataset(str(tmp_path / name))
    with pytest.raises(ConfigError, match="missing"):
        IndexedDataset(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="do not fit"):
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16).add_document([70000], [1])


# ---- tokenizers ----------------------------------------------------------------------------------


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in its vocabulary order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    merges = [("\u0120", "t"), ("t", "h"), ("\u0120t", "h"), ("th", "e"), ("\u0120th", "e")]
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    folder = tmp_path_factory.mktemp("gpt2")
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def test_gpt2_bpe_merges_bytes_and_eod(gpt2_files):
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    vocab = json.loads(Path(gpt2_files[0]).read_text())
    assert (tok.vocab_size, tok.eod) == (262, vocab["<|endoftext|>"])
    assert tok.tokenize("the the") == [vocab["the"], vocab["\u0120the"]]
    text = "théé ✓\n<|endoftext|>"  # multi-byte characters; the eod string is plain text
    assert tok.eod not in tok.tokenize(text)
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.detokenize([vocab["the"], tok.eod]) == "the<|endoftext|>"


def test_huggingface_tokenizer_from_local_directory(gpt2_files, tmp_path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(gpt2.tokenizer.to_str()),
                                   eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (tok.vocab_size, tok.eod, tok.bos) == (262, gpt2.eod, None)
    assert tok.tokenize("the the") == gpt2.tokenize("the the")
    assert tok.detokenize(tok.tokenize("the thé")) == "the thé"


def test_sentencepiece_ids_follow_megatron(corpus):
    model = corpus["model"]
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    plain = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    pieces = plain.vocab_size
    # <CLS> <SEP> <EOD> <MASK> and <PAD> (the model has none) follow the pieces; <s> and </s>
    # are the model's own.
    assert tok.special_tokens == {"<CLS>": pieces, "<SEP>": pieces + 1, "<EOD>": pieces + 2,
                                  "<MASK>": pieces + 3, "<PAD>": pieces + 4, "<s>": 1, "</s>": 2}
    assert (tok.vocab_size, tok.eod, tok.pad, tok.bos) == (pieces + 5, pieces + 2, pieces + 4, 1)
    assert (plain.eod, plain.bos, plain.pad) == (2, 1, None)
    ids = tok.tokenize("the cat<EOD>a dog")
    assert ids == plain.tokenize("the cat") + [tok.eod] + plain.tokenize("a dog")
    assert tok.detokenize(ids) == "the cat <EOD> a dog"
    assert llama.tokenize("the cat") == [1, *plain.tokenize("the cat")]
    null = build_tokenizer("NullTokenizer", vocab_size=10)
    assert (null.tokenize("3 4 9"), null.eod, null.vocab_size) == ([3, 4, 9], 10, 11)
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(ConfigError, match="not supported"):
        build_tokenizer("BertWordPieceCase", vocab_file="x")


# ---- preprocessing -----------------------------------------------------------------------------

_WORDS = (("the", "a"), ("red", "small", "old", "quiet", "bright"),
          ("cat", "dog", "bird", "tree", "river", "house"), ("sees", "likes", "follows", "finds"))


def _sentence(rng: np.random.Generator) -> str:
    det, adj, noun, verb = (rng.choice(words) for words in _WORDS)
    return f"{det} {adj} {noun} {verb} {rng.choice(_WORDS[0])} {rng.choice(_WORDS[2])}."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """A JSONL corpus (one empty document), a sentencepiece model trained on it, and the
    corpus preprocessed with --append-eod by the script, in-process with one worker."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    texts = [" ".join(_sentence(rng) for _ in range(rng.integers(1, 5))) for _ in range(300)]
    texts[5] = ""
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    model = _script("train_tokenizer").train(_script("train_tokenizer").parse_args(
        ["--input", str(folder / "corpus.jsonl"), "--model-prefix", str(folder / "tok"),
         "--vocab-size", "320"]))
    flags = ["--input", str(folder / "corpus.jsonl"), "--tokenizer-type",
             "SentencePieceTokenizer", "--tokenizer-model", model, "--append-eod"]
    preprocess = _script("preprocess_data")
    [prefix] = preprocess.preprocess(preprocess.parse_args(
        [*flags, "--output-prefix", str(folder / "one")]))
    return {"texts": texts, "model": model, "prefix": prefix, "flags": flags, "folder": folder}


def test_preprocess_round_trips_documents(corpus):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=corpus["model"])
    assert corpus["prefix"].endswith("one_text_document")
    ds = IndexedDataset(corpus["prefix"])
    assert ds.dtype == np.uint16 and ds.num_documents == len(corpus["texts"])
    for d, text in enumerate(corpus["texts"]):
        begin, end = ds.document_indices[d], ds.document_indices[d + 1]
        if not text:
            assert begin == end  # an empty document: no sequence, no EOD
            continue
        ids = ds[int(begin)].tolist()
        assert end == begin + 1 and ids == tok.tokenize(text) + [tok.eod]
        assert tok.detokenize(ids[:-1]) == text


def test_preprocess_command_line_with_workers_writes_the_same_files(corpus):
    folder = corpus["folder"]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"),
                    *corpus["flags"], "--output-prefix", str(folder / "two"), "--workers", "2"],
                   check=True, capture_output=True, timeout=300)
    for suffix in (".bin", ".idx"):
        assert (Path(str(folder / "two_text_document") + suffix).read_bytes()
                == Path(corpus["prefix"] + suffix).read_bytes())


# ---- GPT samples ---------------------------------------------------------------------------------


def _check_samples_are_the_stream(ds: GPTDataset, seq: int) -> None:
    """Sample i is tokens [s * seq, s * seq + seq + 1) of the documents concatenated in document
    index order, s = shuffle_index[i]; every window that fits is there exactly once."""
    stream = np.concatenate([ds.indexed[int(d)] for d in ds.document_index]).astype(np.int64)
    assert len(ds) == (len(stream) - 1) // seq
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        start = int(ds.shuffle_index[i]) * seq
        assert ds.sample_tokens(i).tolist() == stream[start:start + seq + 1].tolist(), i


# Documents 10..49 hold 759 tokens, 47 samples of 16 + 1 per epoch. 60 samples need a second
# epoch for only 13 samples (< 80% of 47): it is shuffled apart; 90 need 43 of it: it is not.
@pytest.mark.parametrize("num_samples, epochs, apart", [(20, 1, False), (60, 2, True),
                                                        (90, 2, False)])
def test_samples_cross_documents_over_shuffled_epochs(tmp_path, num_samples, epochs, apart):
    lengths = _lengths(60, seed=1)  # some empty documents among them
    assert sum(lengths[10:50]) == 759
    ds = GPTDataset(IndexedDataset(_synthetic(tmp_path / "d", lengths)), (10, 50), num_samples,
                    seq_length=16, seed=3, eod=EOD, eod_mask_loss=False, cache_dir=None)
    assert len(ds) >= num_samples
    # Each document of the split appears once per epoch, and no other document does.
    assert collections.Counter(ds.document_index.tolist()) == {d: epochs for d in range(10, 50)}
    assert (sorted(ds.document_index[-40:].tolist()) == list(range(10, 50))) == (epochs == 1
                                                                                   or apart)
    _check_samples_are_the_stream(ds, seq=16)
    crossing = [i for i in range(len(ds)) if len(set(ds.sample_tokens(i) // 1000) - {0}) > 1]
    assert crossing, "no sample spans two documents"
    sample = ds[0]
    assert sample["tokens"].dtype == torch.long and sample["tokens"].shape == (17,)
    assert sample["loss_mask"].dtype == torch.float32 and sample["loss_mask"].shape == (16,)


def test_seed_decides_the_order_and_nothing_else(tmp_path):
    indexed = IndexedDataset(_synthetic(tmp_path / "d", _lengths(40, seed=2)))
    build = functools.partial(GPTDataset, indexed, (0, 40), 50, 8, eod=EOD, eod_mask_loss=False,
                              cache_dir=None)
    a, b, c = build(seed=5), build(seed=5), build(seed=6)
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert [a.sample_tokens(i).tolist() for i in range(len(a))] != \
        [c.sample_tokens(i).tolist() for i in range(len(c))]
    _check_samples_are_the_stream(c, seq=8)


def test_eod_mask_loss_masks_inputs_that_are_eod(tmp_path):
    indexed = IndexedDataset(_synthetic(tmp_path / "d", _lengths(30, seed=4, low=3, high=12)))
    masked = GPTDataset(indexed, (0, 30), 20, 16, 1, EOD, eod_mask_loss=True, cache_dir=None)
    plain = GPTDataset(indexed, (0, 30), 20, 16, 1, EOD, eod_mask_loss=False, cache_dir=None)
    zeros = 0
    for i in range(len(masked)):
        sample = masked[i]
        expected = (sample["tokens"][:-1] != EOD).float()
        assert torch.equal(sample["loss_mask"], expected)
        assert torch.equal(plain[i]["loss_mask"], torch.ones(16))
        zeros += int((expected == 0).sum())
    assert zeros > 0


def test_split_divides_documents_disjointly(tmp_path):
    prefix = _synthetic(tmp_path / "d", _lengths(1000, seed=5, low=10, high=30))
    datasets = build_train_valid_test_datasets([prefix], "969,30,1", seq_length=8, seed=1,
                                               num_samples=(100, 20, 5), tokenizer_eod=EOD,
                                               eod_mask_loss=False, cache_dir=None)
    expected = [range(0, 969), range(969, 999), range(999, 1000)]
    for ds, documents in zip(datasets, expected):
        assert set(ds.document_index.tolist()) == set(documents)
        seen = {int(t) // 1000 - 1 for i in range(len(ds)) for t in ds.sample_tokens(i) if t != EOD}
        assert seen <= set(documents)
    train_, valid, test = build_train_valid_test_datasets(
        [prefix], "98,2", 8, 1, (10, 10, 10), EOD, False, None)
    assert test is None and len(valid.document_index) == 20
    assert build_train_valid_test_datasets([prefix], "1", 8, 1, (10, 0, 0), EOD, False,
                                           None)[1:] == (None, None)
    with pytest.raises(ValueError, match="too few for one sample"):
        build_train_valid_test_datasets([prefix], "999,1", 512, 1, (1, 1, 0), EOD, False, None)


def test_index_cache_is_reused_and_keyed(tmp_path):
    prefix = _synthetic(tmp_path / "d", _lengths(50, seed=6))
    build = functools.partial(build_train_valid_test_datasets, [prefix], "9,1", 8,
                              num_samples=(40, 10, 0), tokenizer_eod=EOD, eod_mask_loss=False)
    first, _, _ = build(seed=1, cache_dir=str(tmp_path / "cache"))
    again, _, _ = build(seed=1, cache_dir=str(tmp_path / "cache"))
    other, _, _ = build(seed=2, cache_dir=str(tmp_path / "cache"))
    assert (first.from_cache, again.from_cache, other.from_cache) == (False, True, False)
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert len(list((tmp_path / "cache").glob("*GPTDataset-train-shuffle_index.npy"))) == 2
    default, _, _ = build(seed=1, cache_dir=None)  # beside the data
    assert not default.from_cache and (tmp_path / "index-cache").is_dir()
    assert build(seed=1, cache_dir=None)[0].from_cache


# ---- blends ------------------------------------------------------------------------------------


def test_parse_data_path_and_split():
    assert parse_data_path(["A"]) == (["A"], None)
    assert parse_data_path(["A", "B"]) == (["A", "B"], None)
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_data_path(["A", "B", "C"]) == (["A", "B", "C"], None)
    bounds = parse_split("969,30,1")
    assert [len(pair) for pair in bounds] == [2, 2, 2]
    assert [x for pair in bounds for x in pair] == pytest.approx([0, 0.969, 0.969, 0.999, 0.999, 1])
    assert parse_split("98/2")[2] is None
    for bad in ("", "1,2,3,4", "0,0", "1.2.3"):
        with pytest.raises(ConfigError, match="--split"):
            parse_split(bad)
    with pytest.raises(ConfigError, match="--data-path"):
        parse_data_path(["0", "A", "0", "B"])
    # a typo in one weight is named, not taken for a prefix ("0.5x.idx is missing")
    with pytest.raises(ConfigError, match="'0.5x' stands where a blend weight goes"):
        parse_data_path(["0.5x", "A", "0.5", "B"])


@pytest.mark.parametrize("count", [2, 3, 5])
def test_blend_prefixes_stay_within_two_samples_of_the_weights(count):
    weights = normalize_weights(np.random.default_rng(count).random(count))
    dataset_index, sample_index = blending_indices(weights, 2000)
    drawn = np.zeros((2000, count))
    drawn[np.arange(2000), dataset_index] = 1
    counts = drawn.cumsum(axis=0)
    assert np.abs(counts - np.outer(np.arange(1, 2001), weights)).max() <= 2
    # Each dataset's samples are taken in order 0, 1, 2, ...
    for k in range(count):
        assert sample_index[dataset_index == k].tolist() == list(range(int(counts[-1, k])))


def test_blends_draw_in_the_stated_proportions(tmp_path):
    a = _synthetic(tmp_path / "a", _lengths(200, seed=7, low=5))
    b = _synthetic(tmp_path / "b", _lengths(100, seed=8, low=5), base=1_000_000)

    def share_of_a(data_path: list[str], samples: int) -> float:
        ds = build_train_valid_test_datasets(data_path, "1", 8, 1, (samples, 0, 0), EOD, False,
                                             str(tmp_path / "cache"))[0]
        from_a = [all(t < 1_000_000 for t in ds[i]["tokens"].tolist()) for i in range(len(ds))]
        from_b = [all(t < 1000 or t >= 1_000_000 for t in ds[i]["tokens"].tolist())
                  for i in range(len(ds))]
        assert all(x != y for x, y in zip(from_a, from_b)), "a sample mixes the datasets"
        return sum(from_a) / len(ds)

    assert share_of_a(["0.3", a, "0.7", b], 1000) == pytest.approx(0.3, abs=0.02)
    assert share_of_a(["0.3", a, "0.7", b], 3000) == pytest.approx(0.3, abs=0.02)  # > 1 epoch
    sizes = [(int(IndexedDataset(p).sequence_lengths.sum()) - 1) // 8 for p in (a, b)]
    assert share_of_a([a, b], 1000) == pytest.approx(sizes[0] / sum(sizes), abs=0.02)



@pytest.mark.peers
def test_same_bytes_and_indices_as_megatron_core(tmp_path):
    """Run where megatron-core is installed (pip install megatron-core; CI lacks it): our files,
    GPT indices and blend indices equal Megatron-LM's own."""
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    from megatron.core.datasets import gpt_dataset as megatron_gpt
    from megatron.core.datasets import indexed_dataset as megatron_indexed

    lengths = _lengths(200, seed=9)
    ours = _synthetic(tmp_path / "ours", lengths)
    indexed = IndexedDataset(ours)  # with empty documents: no sequence
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), np.int32)
    for begin, end in zip(indexed.document_indices[:-1], indexed.document_indices[1:]):
        parts = [indexed[i] for i in range(begin, end)]
        builder.add_document(torch.from_numpy(np.concatenate([np.zeros(0, np.int32), *parts])),
                             [len(part) for part in parts])
    builder.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert Path(ours + suffix).read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()

    sizes = indexed.sequence_lengths
    for num_samples, seq, seed in ((50, 16, 1), (400, 16, 2), (700, 8, 3), (1600, 16, 4)):
        mine = build_indices(sizes, np.arange(20, 180, dtype=np.int32), num_samples, seq, seed)
        tokens = int(sizes[20:180].sum())
        epochs = -(-(num_samples * seq + 1) // tokens)
        before_final = ((epochs - 1) * tokens - 1) // seq
        apart = epochs > 1 and num_samples - before_final < int(0.8 * ((tokens - 1) // seq))
        rng = np.random.RandomState(seed)
        documents = megatron_gpt._build_document_index(np.arange(20, 180, dtype=np.int32),
                                                       epochs, rng, apart)
        samples = helpers.build_sample_idx(sizes, documents, seq, epochs, tokens, True, 1)
        total = len(samples) - 1
        shuffle = megatron_gpt._build_shuffle_index(before_final if apart else total, total, rng)
        for name, theirs in (("document_index", documents), ("sample_index", samples),
                             ("shuffle_index", shuffle)):
            assert np.array_equal(mine[name], theirs), (name, num_samples)
    weights = normalize_weights([0.2, 0.5, 0.3])
    datasets, samples = np.zeros(5000, np.int16), np.zeros(5000, np.int64)
    helpers.build_blending_indices(datasets, samples, np.array(weights), 3, 5000, False)
    mine = blending_indices(weights, 5000)
    assert np.array_equal(mine[0], datasets) and np.array_equal(mine[1], samples)

# ---- training on a preprocessed corpus at DP=2 ---------------------------------------------------


class _Recording:
    """The dataset, noting which sample indices this rank read."""

    def __init__(self, dataset):
        self.dataset, self.indices = dataset, []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.indices.append(index)
        return self.dataset[index]


def _case_train_dp2(prefix: str, vocab_size: int, eod: int, cache_dir: str) -> None:
    """30 steps of a tiny GPT at DP=2 on the preprocessed corpus: the loss falls, and in every
    step the two ranks read disjoint halves of the global batch, so no sample is seen twice."""
    iters, gbs = 30, 8
    train_data, valid_data, _ = build_train_valid_test_datasets(
        [prefix], "95,5", seq_length=32, seed=1234, num_samples=(iters * gbs, gbs, 0),
        tokenizer_eod=eod, eod_mask_loss=True, cache_dir=cache_dir)
    reads = _Recording(train_data)
    model_config = ModelConfig.preset("gpt-tiny", vocab_size=vocab_size, seq_length=32,
                                      hidden_dropout=0.0, attention_dropout=0.0)
    config = make_config(model_config, micro_batch_size=2, global_batch_size=gbs,
                         train_iters=iters, lr=5e-3, min_lr=5e-4, lr_warmup_iters=3,
                         log_interval=10, eval_interval=iters, eval_iters=1)
    history = train(config, ParallelDims(tp=1, dp=2), "gpt",
                    log=lambda line: None, train_data=reads, valid_data=valid_data)
    first, last = history["losses"][0], sum(history["losses"][-5:]) / 5
    assert first > 5.0, f"initial loss {first} should be near ln({vocab_size})"
    assert last < 0.6 * first and history["eval"][-1]["loss"] < 0.6 * first, (first, last)

    ranks: list[list[int]] = [[], []]
    dist.all_gather_object(ranks, reads.indices)
    for step in range(iters):
        batch = [{i for i in indices if step * gbs <= i < (step + 1) * gbs} for indices in ranks]
        assert not batch[0] & batch[1], f"step {step}: both ranks read {batch[0] & batch[1]}"
        assert batch[0] | batch[1] == set(range(step * gbs, (step + 1) * gbs))
    windows = [int(train_data.shuffle_index[i]) for indices in ranks for i in indices]
    assert len(set(windows)) == len(windows) == iters * gbs


SUITE = DistSuite(worlds=(2,))


@pytest.fixture(scope="module")
def train_inputs(corpus) -> tuple:
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=corpus["model"])
    return corpus["prefix"], tok.vocab_size, tok.eod, str(corpus["folder"] / "cache")


@SUITE.setup
def _train_setup(world: int, prefix: str, vocab_size: int, eod: int, cache_dir: str) -> dict:
    return {"prefix": prefix, "vocab_size": vocab_size, "eod": eod, "cache_dir": cache_dir}


SUITE.case("train_dp2", _case_train_dp2, C.prefix, C.vocab_size, C.eod, C.cache_dir)

test_tiny_gpt_learns_from_preprocessed_corpus_at_dp2 = SUITE.test(args_fixture="train_inputs")


def test_training_at_dp2_caches_its_sample_index(corpus, train_inputs):
    check_result(SUITE.results(2, *train_inputs), "train_dp2")
    assert list((corpus["folder"] / "cache").glob("*GPTDataset-train-sample_index.npy"))


def test_train_tokenizer_bad_input_is_one_line(tmp_path, capsys):
    """scripts/train_tokenizer.py: a missing file, a line that is not JSON, a line without the
    key, and a vocabulary the text cannot fill each end in one `error:` line naming the file
    (and line, or the flag), exit status 2."""
    script = _script("train_tokenizer")
    (tmp_path / "bad.jsonl").write_text('{"text": "hello"}\nnot json\n')
    (tmp_path / "nokey.jsonl").write_text('{"txt": "hello"}\n')
    (tmp_path / "small.txt").write_text("hello world\n")
    cases = [(tmp_path / "missing.jsonl", "100", "missing.jsonl: no such file"),
             (tmp_path / "bad.jsonl", "100", "bad.jsonl:2: not a JSON line"),
             (tmp_path / "nokey.jsonl", "100", "nokey.jsonl:1: no 'text' field"),
             (tmp_path / "small.txt", "100000", "a smaller --vocab-size")]
    for path, vocab, named in cases:
        status = script.main(["--input", str(path), "--model-prefix", str(tmp_path / "tok"),
                              "--vocab-size", vocab])
        err = capsys.readouterr().err
        assert status == 2 and err.startswith("error: ") and named in err, err
        assert err.count("\n") == 1, err


def test_missing_tokenizer_and_input_files_are_named(tmp_path):
    """A tokenizer file or a preprocessing input that does not exist is one ConfigError naming
    the flag and the path, not sentencepiece's or open()'s traceback."""
    from megadomino.data.tokenizer import build_tokenizer

    with pytest.raises(ConfigError, match="--tokenizer-model=.*nope.model: no such file"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "nope.model"))
    with pytest.raises(ConfigError, match="--vocab-file=.*vocab.json: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                        merge_file=str(tmp_path / "merges.txt"))
    preprocess = _script("preprocess_data")
    with pytest.raises(ConfigError, match="--input=.*missing.jsonl: no such file"):
        preprocess.preprocess(preprocess.parse_args(
            ["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o"),
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]))
