"""Every file-valued flag, given a file that is corrupt, truncated, empty, a directory where a file
goes (a file where a directory goes) or of the wrong kind: one `error:` line naming the flag and
the file, exit status 2, never a traceback. Where a combination is fine (an empty --save or
--tensorboard-dir directory; a --load directory without a checkpoint, which starts afresh as in
Megatron-LM) the table says so and the run must train. A checkpoint that --load finds but cannot
read is the same: one line naming --load and the file, exit status 2.

The table runs launch.main, the entry scripts' main, in-process on one rank: it reads every file
as a launched run does. Subprocess runs show the entry scripts' real exit status, and 2 ranks
that both refuse a file read after the process group exists. Flags whose value is a path we
never read (notices such as --memory-snapshot-path) accept any value; refused flags are refused
whatever it is. A read-only directory is checked only where the tests do not run as root.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dist_utils import free_port
from megadomino.cli import launch
from megadomino.config import ModelConfig
from megadomino.interop.hf import SAFETENSORS_INDEX, hf_shapes
from megadomino.interop.hf_config import hf_config_from

ROOT = Path(__file__).resolve().parents[1]
JUNK = bytes(range(256)) * 4  # not UTF-8, JSON, a protobuf or a safetensors header
GPT = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
       "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0"]
MOCK = [*GPT, "--mock-data", "--vocab-size", "64"]
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]  # 65 ids with its eod
DATA = [*GPT, *NULL, "--split", "1,0,0"]
FINETUNE = ["--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--eval-iters", "0", "--split", "1,0,0", *NULL]
HF_MODEL = ModelConfig.preset("llama-tiny", num_layers=1, vocab_size=65, seq_length=16,
                              max_position_embeddings=16)
ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0  # writes anywhere: nothing to refuse


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_hf_checkpoint(directory: Path, config: ModelConfig, shards: int = 1) -> None:
    """A Llama in Hugging Face's layout: one safetensors file, or `shards` and their index."""
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_from(config)))
    tensors = {name: torch.full(shape, 0.02) for name, shape in hf_shapes(config).items()}
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    names, weight_map = sorted(tensors), {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensors[name] for name in names[k::shards]}, str(directory / file))
        weight_map.update(dict.fromkeys(names[k::shards], file))
    (directory / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """A good file (or directory) of every kind a flag reads."""
    root = tmp_path_factory.mktemp("good")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"the cat {i} sat on the mat"}) + "\n"
                              for i in range(200)))
    tokenizer = _script("train_tokenizer")
    model = tokenizer.train(tokenizer.parse_args(
        ["--input", str(corpus), "--model-prefix", str(root / "tok"), "--vocab-size", "300"]))
    (root / "ids.txt").write_text((" ".join(str(7 + i % 50) for i in range(40)) + "\n") * 20)
    preprocess = _script("preprocess_data")
    [prefix] = preprocess.preprocess(preprocess.parse_args(
        ["--input", str(root / "ids.txt"), "--output-prefix", str(root / "data"), *NULL,
         "--append-eod"]))
    vocab = {chr(b): b - 33 for b in range(33, 127)}
    for token in ("\u0120", "\u0120t", "th", "\u0120th", "he", "<|endoftext|>"):
        vocab[token] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n\u0120 t\nt h\n\u0120t h\nh e\n")
    (root / "sft.jsonl").write_text(json.dumps({"prompt": "1 2 3", "response": "4 5"}) + "\n")
    (root / "plan.json").write_text(json.dumps(
        {"stages": [{"ranks": [0], "tp": 1, "layers": [0, 1]}]}))
    (root / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    (root / "nccl.yaml").write_text("pp:\n  max_ctas: 2\n")
    write_hf_checkpoint(root / "hf", HF_MODEL)
    write_hf_checkpoint(root / "hf_sharded", HF_MODEL, shards=2)
    hf_tokenizer = root / "hf_tokenizer"
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        from megadomino.data.tokenizer import build_tokenizer
        bpe = build_tokenizer("GPT2BPETokenizer", vocab_file=str(root / "vocab.json"),
                              merge_file=str(root / "merges.txt")).tokenizer
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()),
                                eos_token="<|endoftext|>").save_pretrained(hf_tokenizer)
    except ImportError:  # without transformers its rows skip
        pass
    files = {"sp": Path(model), "vocab": root / "vocab.json", "merges": root / "merges.txt",
             "prefix": Path(prefix), "corpus": corpus, "sft": root / "sft.jsonl",
             "plan": root / "plan.json", "ds": root / "ds.json", "hf": root / "hf",
             "nccl": root / "nccl.yaml",
             "hf_sharded": root / "hf_sharded", "hf_tokenizer": hf_tokenizer,
             "checkpoint": root / "ckpt"}
    assert run(["--save", str(files["checkpoint"]), *MOCK])[0] == 0
    return files


def run(argv: list[str], family: str = "gpt", finetune: bool = False,
        env: dict[str, str | None] | None = None) -> tuple[int, list[str]]:
    """launch.main in this process as one rank: (exit status, the `error:` lines it printed).
    env: launch variables changed from a single rank's (None: unset)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr), \
            contextlib.redirect_stdout(io.StringIO()):
        for name, value in env.items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        code = launch.main(family, argv, finetune=finetune)
    return code, [line for line in stderr.getvalue().splitlines() if line.startswith("error:")]


# ---- damage: each makes the bad path from the good files, under `tmp` ----------------------


HOW: dict[str, Callable[[Path, Path], object]] = {  # (good source, bad target)
    "corrupt": lambda source, target: target.write_bytes(JUNK),
    "truncated": lambda source, target: target.write_bytes(
        source.read_bytes()[:source.stat().st_size // 2]),
    "empty": lambda source, target: target.write_bytes(b""),
    "a directory": lambda source, target: target.mkdir(),
}
Make = Callable[[dict, Path], Path]


def damaged(kind: str, how: str, inner: str | None = None) -> Make:
    """`good[kind]` damaged `how`; with `inner`, its directory copied with that file damaged."""
    def make(good: dict, tmp: Path) -> Path:
        source = good[kind]
        if inner is None:
            HOW[how](source, tmp / source.name)
            return tmp / source.name
        copy = Path(shutil.copytree(source, tmp / source.name))
        (copy / inner).unlink()
        HOW[how](source / inner, copy / inner)
        return copy
    return make


def damaged_pair(suffix: str, how: str) -> Make:
    """The indexed dataset with its `suffix` file (.bin or .idx) damaged `how`."""
    def make(good: dict, tmp: Path) -> Path:
        prefix = tmp / good["prefix"].name
        for each in (".bin", ".idx"):
            source, target = Path(f"{good['prefix']}{each}"), Path(f"{prefix}{each}")
            if each == suffix:
                HOW[how](source, target)
            else:
                shutil.copy(source, target)
        return prefix
    return make


def edited(kind: str, edit: Callable[[Path], None]) -> Make:
    """A copy of the directory `good[kind]`, changed by `edit`."""
    def make(good: dict, tmp: Path) -> Path:
        copy = Path(shutil.copytree(good[kind], tmp / good[kind].name))
        edit(copy)
        return copy
    return make


def given(kind: str) -> Make:
    return lambda good, tmp: good[kind]


def empty_dir(good: dict, tmp: Path) -> Path:
    (tmp / "empty_dir").mkdir()
    return tmp / "empty_dir"


def a_file(good: dict, tmp: Path) -> Path:
    return good["sp"]


def text_sft(good: dict, tmp: Path) -> Path:  # NullTokenizer reads ids, not words
    (tmp / "text.jsonl").write_text(json.dumps({"prompt": "What is 2+2?", "response": "4"}))
    return tmp / "text.jsonl"


def read_only(good: dict, tmp: Path) -> Path:
    (tmp / "locked").mkdir(mode=0o500)
    return tmp / "locked" / "out"


def blocked_cache(good: dict, tmp: Path) -> Path:
    """The data in a directory where a file holds the default cache's name (as a read-only data
    directory would, the cache cannot be made beside the data)."""
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{good['prefix']}{suffix}", tmp)
    (tmp / "index-cache").write_text("a file in the way")
    return tmp / good["prefix"].name


def prefix_dir(good: dict, tmp: Path) -> Path:
    (tmp / "data").mkdir()
    return tmp / "data"


# ---- the table -------------------------------------------------------------------------------

Argv = Callable[[Path, dict], list[str]]


def flag(name: str, base: list[str] = MOCK, *also: tuple[str, str]) -> Argv:
    """The command `base`, `name` with the bad path, and each (flag, kind) of `also` with the
    good file of that kind."""
    def argv(bad: Path, good: dict) -> list[str]:
        return [*base, name, str(bad), *(x for f, kind in also for x in (f, str(good[kind])))]
    return argv


def tokenizer(kind: str) -> list[str]:
    return [*GPT, "--mock-data", "--tokenizer-type", kind]


sentencepiece = flag("--tokenizer-model", tokenizer("SentencePieceTokenizer"))
hf_tokenizer = flag("--tokenizer-model", tokenizer("HuggingFaceTokenizer"))
data_path = flag("--data-path", DATA)
hf_checkpoint = flag("--hf-checkpoint", FINETUNE, ("--data-path", "sft"))


def _replace_json(name: str, **changes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / name).write_text(json.dumps({**json.loads((folder / name).read_text()),
                                               **changes}))
    return edit


def _remove_first_shard(folder: Path) -> None:
    (folder / "model-00001-of-00002.safetensors").unlink()


def _rename_weights(folder: Path) -> None:  # HF's older format: torch.save'd weights
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _cut_shard(folder: Path) -> None:
    shard = folder / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[:1000])


TRACKER, SP, MODEL = "latest_checkpointed_iteration.txt", "--tokenizer-model", "model.safetensors"


@dataclass(frozen=True)
class Row:
    flag: str
    damage: str
    make: Make
    argv: Argv
    exit: int = 2
    """2: refused with one line naming the flag and the file; 0: accepted, the run trains; 1: a
    checkpoint --load cannot read (one line naming the file)."""
    finetune: bool = False
    needs: str | None = None
    names: Callable[[Path], Path] | None = None
    """The path the line names, from the bad one (None: the bad path itself)."""


def _rows() -> list[Row]:
    def five(flag_name: str, kind: str, argv: Argv, wrong: str, **kw) -> list[Row]:
        return [*(Row(flag_name, how, damaged(kind, how), argv, **kw) for how in HOW),
                Row(flag_name, f"the wrong kind ({wrong})", given(wrong), argv, **kw)]

    transformers = {"needs": "transformers"}
    return [
        *five(SP, "sp", sentencepiece, "vocab"),
        *five("--vocab-file", "vocab", flag("--vocab-file", tokenizer("GPT2BPETokenizer"),
                                            ("--merge-file", "merges")), "merges"),
        *five("--merge-file", "merges", flag("--merge-file", tokenizer("GPT2BPETokenizer"),
                                             ("--vocab-file", "vocab")), "vocab"),
        *(Row(SP, f"HF {how} tokenizer.json", damaged("hf_tokenizer", how, "tokenizer.json"),
              hf_tokenizer, **transformers) for how in ("corrupt", "truncated")),
        Row(SP, "HF an empty directory", empty_dir, hf_tokenizer, **transformers),
        Row(SP, "HF a file", a_file, hf_tokenizer, **transformers),
        Row(SP, "HF the wrong kind (a model directory)", given("hf"), hf_tokenizer,
            **transformers),
        Row("--data-path", "corrupt .idx", damaged_pair(".idx", "corrupt"), data_path),
        Row("--data-path", "truncated .idx", damaged_pair(".idx", "truncated"), data_path),
        Row("--data-path", "truncated .bin", damaged_pair(".bin", "truncated"), data_path),
        Row("--data-path", "empty .idx", damaged_pair(".idx", "empty"), data_path),
        Row("--data-path", "a directory", prefix_dir, data_path),
        Row("--data-path", "the wrong kind (a JSONL corpus)", given("corpus"), data_path),
        *five("--data-path", "sft", flag("--data-path", FINETUNE, ("--hf-checkpoint", "hf")),
              "corpus", finetune=True),
        Row("--data-path", "text, for NullTokenizer's ids", text_sft,
            flag("--data-path", FINETUNE, ("--hf-checkpoint", "hf")), finetune=True),
        Row("--hf-checkpoint", "corrupt safetensors", damaged("hf", "corrupt", MODEL),
            hf_checkpoint, finetune=True),
        Row("--hf-checkpoint", "truncated safetensors", damaged("hf", "truncated", MODEL),
            hf_checkpoint, finetune=True),
        Row("--hf-checkpoint", "corrupt config.json", damaged("hf", "corrupt", "config.json"),
            hf_checkpoint, finetune=True),
        Row("--hf-checkpoint", "an empty directory", empty_dir, hf_checkpoint, finetune=True),
        Row("--hf-checkpoint", "a file", a_file, hf_checkpoint, finetune=True),
        Row("--hf-checkpoint", "the wrong kind (pytorch_model.bin)",
            edited("hf", _rename_weights), hf_checkpoint, finetune=True),
        Row("--hf-checkpoint", "a missing shard", edited("hf_sharded", _remove_first_shard),
            hf_checkpoint, finetune=True),
        Row("--hf-checkpoint", "tensors unlike config.json",
            edited("hf", _replace_json("config.json", intermediate_size=48)), hf_checkpoint,
            finetune=True),
        Row("--hf-checkpoint", "tensors unlike the tokenizer's vocabulary", given("hf"),
            flag("--hf-checkpoint", [*FINETUNE, "--vocab-size", "100"], ("--data-path", "sft")),
            finetune=True),
        *five("--deepspeed_config", "ds", flag("--deepspeed_config", [*MOCK, "--deepspeed"]),
              "plan"),
        *five("--pipeline-plan", "plan", flag("--pipeline-plan"), "ds"),
        *five("--nccl-communicator-config-path", "nccl",
              flag("--nccl-communicator-config-path"), "plan"),
        Row("--load", "corrupt tracker", edited("checkpoint", lambda d: (d / TRACKER).write_bytes(
            JUNK)), flag("--load")),
        Row("--load", "truncated shard", edited("checkpoint", _cut_shard), flag("--load")),
        Row("--load", "an empty directory: a fresh start", empty_dir, flag("--load"), exit=0),
        Row("--load", "a file", a_file, flag("--load")),
        Row("--load", "the wrong kind (no checkpoint): a fresh start", given("hf"),
            flag("--load"), exit=0),
        *(Row(name, damage, make, flag(name, *base), exit=code,
              needs="tensorboard" if name == "--tensorboard-dir" and not code else None)
          for name, base in (("--save", ()), ("--tensorboard-dir", ()),
                             ("--data-cache-path", (DATA, ("--data-path", "prefix"))))
          for damage, make, code in (("a file", a_file, 2), ("read-only", read_only, 2),
                                     ("an empty directory: fine", empty_dir, 0))),
        *(Row("--pipeline-placement-dir", damage, make,
              flag("--pipeline-placement-dir", [*MOCK, "--pipeline-plan", "auto"]))
          for damage, make in (("a file", a_file), ("read-only", read_only))),
        Row("--data-cache-path", "default, beside data it cannot be written beside",
            blocked_cache, data_path, names=lambda bad: bad.parent / "index-cache"),
    ]


ROWS = _rows()
NOT_PATHS = {"--ckpt-format", "--dataloader-type", "--fp8-amax-compute-algo", "--fp8-format",
             "--fp8-recipe", "--lr-decay-style", "--lr-wsd-decay-style", "--model-preset",
             "--normalization", "--optimizer", "--pipeline-schedule", "--position-embedding-type",
             "--prompt-template", "--recompute-granularity", "--recompute-method", "--split",
             "--step-batch-size-schedule", "--tokenizer-type", "--emulate-slow-rank",
             "--diloco-pseudo-grad-dtype", "--pipeline-planner", "--pipeline-reshard",
             "--pipeline-codec", "--pipeline-codec-values", "--high-priority-stream-groups"}
"""The flags taking a string that is not a path: a name, a choice, a template or a schedule."""


def test_every_flag_that_reads_a_path_has_rows():
    """A new string flag must be classified: a path the table damages, or not a path."""
    from megadomino.cli.flags import FINETUNE_FLAGS, FLAGS, NOTICE, REFUSED

    strings = {flag.name for flag in FLAGS + FINETUNE_FLAGS
               if flag.type is str and flag.policy not in (NOTICE, REFUSED)}
    assert strings - NOT_PATHS == {row.flag for row in ROWS}


@pytest.mark.parametrize("row", ROWS, ids=[f"{row.flag} {row.damage}" for row in ROWS])
def test_bad_file_is_one_line(row: Row, good: dict, tmp_path: Path):
    if row.needs is not None:
        pytest.importorskip(row.needs)
    if row.make is read_only and ROOT_USER:
        pytest.skip("root writes anywhere: nothing to refuse")
    bad = row.make(good, tmp_path)
    code, errors = run(row.argv(bad, good), "llama" if row.finetune else "gpt", row.finetune)
    if row.exit == 0:
        assert (code, errors) == (0, []), errors
        return
    assert (code, len(errors)) == (row.exit, 1), errors
    assert str(bad if row.names is None else row.names(bad)) in errors[0], errors
    assert row.flag in errors[0], errors


# ---- the real entry scripts, and several ranks ---------------------------------------------


def _one_error_line(stderr: str, *named: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in stderr and len(errors) == 1, stderr[-3000:]
    assert all(name in errors[0] for name in named), errors


def test_entry_scripts_exit_2_with_one_line(good: dict, tmp_path: Path):
    """pretrain_gpt.py and finetune_llama.py as launched, one process each."""
    model = damaged("sp", "corrupt")(good, tmp_path)
    checkpoint = edited("hf_sharded", _remove_first_shard)(good, tmp_path)
    runs = [("pretrain_gpt.py", sentencepiece(model, good), SP, model),
            ("finetune_llama.py", hf_checkpoint(checkpoint, good), "--hf-checkpoint",
             checkpoint / "model-00001-of-00002.safetensors")]
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    processes = [subprocess.Popen([sys.executable, script, *argv], cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for script, argv, _, _ in runs]
    for process, (_, _, flag_name, bad) in zip(processes, runs):
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 2, stderr[-3000:]
        _one_error_line(stderr, flag_name, str(bad))


AFTER_THE_GROUP = {  # script, argv of (bad path, good files), the bad path, what the line names
    "an index cache": ("pretrain_gpt.py", lambda bad, good: data_path(bad, good), blocked_cache,
                       lambda bad, tmp: ("--data-cache-path", str(tmp / "index-cache"))),
    "SFT text for NullTokenizer's ids": (
        "finetune_llama.py", flag("--data-path", FINETUNE, ("--hf-checkpoint", "hf")), text_sft,
        lambda bad, tmp: ("--data-path", str(bad))),
}


@pytest.mark.parametrize("case", AFTER_THE_GROUP)
def test_two_ranks_refuse_a_file_read_after_the_group_alike(good: dict, tmp_path: Path,
                                                          case: str):
    """Rank 0 reads the data first once the process group exists (builds the index cache,
    tokenizes the SFT examples); what it cannot read is exit status 2 on both ranks, neither
    left waiting, and one line for the node (rank 0's: the other rank met the same error)."""
    script, argv, make, named = AFTER_THE_GROUP[case]
    bad = make(good, tmp_path)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, script, *argv(bad, good)],
                              cwd=ROOT, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                              text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for rank in range(2)]
    stderrs = [process.communicate(timeout=300)[1] for process in ranks]
    for process, stderr in zip(ranks, stderrs):
        assert process.returncode == 2, stderr[-3000:]
    _one_error_line(stderrs[0], *named(bad, tmp_path))
    assert "Traceback" not in stderrs[1] and "error:" not in stderrs[1], stderrs[1][-3000:]


def test_hf_tokenizer_without_transformers_is_one_line(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets
    code, errors = run(hf_tokenizer(tmp_path, {}))
    assert (code, len(errors)) == (2, 1), errors
    assert SP in errors[0] and "pip install megadomino[hf]" in errors[0], errors
