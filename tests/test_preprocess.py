"""scripts/preprocess_data.py: plain text (one document per line) and JSONL give the same files;
the outputs appear whole or not at all (a run that fails, whenever it fails, leaves no `.bin` or
`.idx` and keeps an older pair intact); the last lines count the documents and tokens written;
bad input is one `error:` line, exit status 2."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megadomino.data import IndexedDataset

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["5 6 7", "", "8 9", "10 11 12 13"]  # NullTokenizer text: ids; one empty document
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod"]


def _script():
    spec = importlib.util.spec_from_file_location("preprocess_data",
                                                  ROOT / "scripts" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocess = _script()


def _main(source: Path, prefix: Path, *flags: str) -> int:
    return preprocess.main(["--input", str(source), "--output-prefix", str(prefix), *TOKENIZER,
                            *flags])


def _outputs(folder: Path) -> dict[str, bytes]:
    """Every output file of the folder, temporary ones included, and its bytes."""
    return {path.name: path.read_bytes() for path in folder.iterdir()
            if "_document" in path.name}


def test_plain_text_and_jsonl_write_the_same_files(tmp_path, capsys):
    """In-process with one worker, and as a command with a pool of two."""
    (tmp_path / "in.txt").write_text("".join(f"{text}\n" for text in DOCUMENTS))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": text}) + "\n"
                                               for text in DOCUMENTS))
    for name in ("in.txt", "in.jsonl"):
        assert _main(tmp_path / name, tmp_path / name.replace(".", "_")) == 0
    lines = capsys.readouterr().out.splitlines()
    pool = subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"),
                           "--input", str(tmp_path / "in.txt"), "--output-prefix",
                           str(tmp_path / "pool"), *TOKENIZER, "--workers", "2"],
                          capture_output=True, text=True, timeout=300)
    assert pool.returncode == 0, pool.stderr
    for suffix in (".bin", ".idx"):
        assert len({(tmp_path / f"{name}_text_document{suffix}").read_bytes()
                    for name in ("in_txt", "in_jsonl", "pool")}) == 1
    dataset = IndexedDataset(str(tmp_path / "in_txt_text_document"))
    assert dataset.num_documents == 4 and [dataset[i].tolist() for i in range(3)] == [
        [5, 6, 7, 100], [8, 9, 100], [10, 11, 12, 13, 100]]  # 100: the eod of 100 ids
    for line in (*lines, pool.stdout.strip()):
        assert line.endswith("_text_document.idx: 4 documents, 12 tokens"), line


def test_bad_arguments_are_one_line(tmp_path, capsys):
    """--json-keys with plain text, an input that is a directory, an output prefix under a
    file: one line naming the flag, exit status 2, nothing written."""
    (tmp_path / "in.txt").write_text("1 2\n")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    for source, prefix, flags, named in (
            ("in.txt", "out", ["--json-keys", "body"], "--json-keys reads JSONL"),
            ("a_dir", "out", [], "--input=" + str(tmp_path / "a_dir") + ": a directory"),
            ("in.txt", "a_file/out", [], "--output-prefix=" + str(tmp_path / "a_file"))):
        assert _main(tmp_path / source, tmp_path / prefix, *flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert _outputs(tmp_path) == {}


@pytest.mark.parametrize("failure", ["bad tokenizer", "bad line", "not UTF-8", "our own bug"])
def test_a_failed_run_leaves_no_output_and_keeps_the_old(tmp_path, capsys, monkeypatch,
                                                         failure):
    """A bad tokenizer file fails before any output, a bad line and undecodable bytes part way
    through, and an exception of ours (injected at the third document) is raised as itself:
    in each case no .bin or .idx appears, no temporary file remains, and the pair an earlier
    run wrote to the same prefix is untouched."""
    (tmp_path / "in.txt").write_text("".join(f"{text}\n" for text in DOCUMENTS))
    (tmp_path / "tok.model").write_bytes(b"\x00not a sentencepiece model")
    (tmp_path / "bad.jsonl").write_text('{"text": "1 2"}\n{"text": "3"}\nnot json\n')
    (tmp_path / "bad.txt").write_bytes(b"1 2\n3 4\n\xff\xfe 5\n")
    assert _main(tmp_path / "in.txt", tmp_path / "old") == 0
    before = _outputs(tmp_path)
    source, flags = tmp_path / "in.txt", []
    if failure == "bad tokenizer":
        flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                 str(tmp_path / "tok.model")]
    elif failure in ("bad line", "not UTF-8"):
        source = tmp_path / ("bad.jsonl" if failure == "bad line" else "bad.txt")
    else:
        encode, calls = preprocess.Encoder.encode, []

        def third_fails(self, line):
            calls.append(line)
            if len(calls) % 3 == 0:
                raise RuntimeError("our own bug")
            return encode(self, line)

        monkeypatch.setattr(preprocess.Encoder, "encode", third_fails)
    capsys.readouterr()
    for prefix in ("old", "new"):
        if failure == "our own bug":
            with pytest.raises(RuntimeError, match="our own bug"):
                _main(source, tmp_path / prefix, *flags)
            continue
        assert _main(source, tmp_path / prefix, *flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    assert _outputs(tmp_path) == before
