"""Fine-tuning: the SFT samples (loss on the response only, template, truncation, BOS, epochs),
the JSONL errors, and one run of finetune_llama.py from a Hugging Face checkpoint on CPU (it
says it starts from those weights, the loss falls, it validates, saves, and writes TensorBoard
scalars); tests/test_readme.py checks and runs the commands of its docstring. TensorBoard being
optional: a clear error without the package."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megadomino.config import ConfigError, ModelConfig
from megadomino.data.sft import SFTDataset, build_sft_datasets, read_examples
from megadomino.data.tokenizer import NullTokenizer, Tokenizer
from megadomino.interop.hf import hf_shapes
from megadomino.interop.hf_config import hf_config_from
from megadomino.train.tensorboard import open_writer

ROOT = Path(__file__).resolve().parents[1]


def _dataset(examples, tokenizer: Tokenizer | None = None, seq_length: int = 12,
             template: str = "90 {prompt} 91", num_samples: int = 4) -> SFTDataset:
    return SFTDataset(examples, tokenizer or NullTokenizer(99), seq_length, template, seed=3,
                      split="train", num_samples=num_samples)


def test_loss_mask_covers_the_response_and_its_eod_only():
    sample = _dataset([("1 2 3", "4 5")]).encode("1 2 3", "4 5")
    #   tokens: 90 1 2 3 91 | 4 5 eod | pad ...  (eod = pad = 99, NullTokenizer has no pad)
    assert sample["tokens"].tolist() == [90, 1, 2, 3, 91, 4, 5, 99, 99, 99, 99, 99, 99]
    # label t is tokens[t + 1]: labels 4, 5 and eod sit at t = 4, 5, 6
    assert sample["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert sample["loss_mask"].dtype == torch.float32


def test_truncation_keeps_seq_length_plus_one_tokens():
    sample = _dataset([], seq_length=6).encode("1 2", "3 4 5 6 7")
    assert sample["tokens"].tolist() == [90, 1, 2, 91, 3, 4, 5]
    assert sample["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1]
    prompt_only = _dataset([], seq_length=3).encode("1 2 3 4", "5")
    assert prompt_only["loss_mask"].sum() == 0


class _BosTokenizer(NullTokenizer):
    """Prepends BOS to every text, as Llama2Tokenizer does."""

    bos = 98

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *super().tokenize(text)]


def test_one_bos_at_the_start_and_pad_id():
    tokenizer = _BosTokenizer(99)
    tokenizer.pad = 0
    sample = _dataset([], tokenizer, seq_length=8, template="{prompt}").encode("1 2", "3")
    assert sample["tokens"].tolist() == [98, 1, 2, 3, 99, 0, 0, 0, 0]
    assert sample["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]


def test_epochs_visit_every_example_once_in_a_seeded_order():
    examples = [(str(i), str(i)) for i in range(5)]
    dataset = _dataset(examples, template="{prompt}", num_samples=10)
    firsts = [dataset[i]["tokens"][0].item() for i in range(10)]
    assert sorted(firsts[:5]) == sorted(firsts[5:]) == list(range(5))
    assert firsts != list(range(5)) * 2, "examples should be shuffled"
    again = _dataset(examples, template="{prompt}", num_samples=10)
    assert [again[i]["tokens"][0].item() for i in range(9, -1, -1)] == firsts[::-1]
    with pytest.raises(IndexError):
        dataset[10]


def test_split_and_jsonl_errors(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(i), "response": str(i)}) + "\n"
                            for i in range(10)))
    train, valid = build_sft_datasets([str(path)], "80,20,0", NullTokenizer(99), 4, "{prompt}", 1,
                                      (16, 4))
    assert (len(train.examples), len(valid.examples), len(train), len(valid)) == (8, 2, 16, 4)
    assert build_sft_datasets([str(path)], "1,0,0", NullTokenizer(99), 4, "{prompt}", 1,
                              (16, 4))[1] is None
    path.write_text('{"prompt": "1", "response": "2"}\n\n{"prompt": "1"}\n')
    with pytest.raises(ConfigError, match=r"sft.jsonl:3: expected an object with string"):
        read_examples([str(path)])
    path.write_text('{"prompt": "1", "response": \n')
    with pytest.raises(ConfigError, match=r"sft.jsonl:1: not JSON"):
        read_examples([str(path)])
    with pytest.raises(ConfigError, match="--data-path .*missing.jsonl"):
        read_examples([str(tmp_path / "missing.jsonl")])


def test_tensorboard_is_optional(monkeypatch, tmp_path):
    assert open_writer(None, rank=0) is None
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="--tensorboard-dir=.* needs the tensorboard package"):
        open_writer(str(tmp_path), rank=1)


def _write_hf_checkpoint(directory: Path, config: ModelConfig) -> None:
    """A random Llama in Hugging Face's layout: config.json and model.safetensors."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_from(config)))
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.ones(shape) if len(shape) == 1
               else 0.02 * torch.randn(shape, generator=generator)
               for name, shape in hf_shapes(config).items()},
              str(directory / "model.safetensors"))


def _sft_corpus(path: Path, count: int) -> None:
    """Prompts of 3-6 ids in [0, 16); the response is the prompt shifted into [16, 32)."""
    rng = random.Random(0)
    with open(path, "w") as file:
        for _ in range(count):
            prompt = [rng.randrange(16) for _ in range(rng.randrange(3, 7))]
            file.write(json.dumps({"prompt": " ".join(map(str, prompt)),
                                   "response": " ".join(str(t + 16) for t in prompt)}) + "\n")


def test_finetune_llama_from_hf_checkpoint(tmp_path):
    """finetune_llama.py, one process: from an HF checkpoint, on JSONL, the response loss falls;
    it validates, logs the phase times, saves at the end and (where tensorboard is installed)
    writes TensorBoard scalars."""
    config = ModelConfig.preset("llama-tiny", vocab_size=65, seq_length=24,
                                max_position_embeddings=24)
    _write_hf_checkpoint(tmp_path / "hf", config)
    _sft_corpus(tmp_path / "sft.jsonl", 200)
    try:
        import tensorboard  # noqa: F401
        with_tensorboard = True
    except ImportError:  # optional: the run is still checked, the scalars are not
        with_tensorboard = False
    argv = ["--hf-checkpoint", str(tmp_path / "hf"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--data-path", str(tmp_path / "sft.jsonl"),
            "--split", "90,10,0", "--prompt-template", "60 {prompt} 61", "--seq-length", "24",
            "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "40",
            "--lr", "3e-3", "--lr-warmup-iters", "4", "--log-interval", "10",
            "--eval-interval", "20", "--eval-iters", "2", "--save", str(tmp_path / "ckpt"),
            "--load", str(tmp_path / "ckpt")]
    if with_tensorboard:
        argv += ["--tensorboard-dir", str(tmp_path / "tb")]
    result = subprocess.run([sys.executable, "finetune_llama.py", *argv], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any("is missing): starting from the --hf-checkpoint weights" in line
               for line in lines), lines
    losses = [float(m.group(1)) for line in lines
              if (m := re.search(r"iteration +\d+/ +40 \| loss (\S+)", line))]
    assert len(losses) == 4 and losses[-1] < 0.65 * losses[0], lines
    results = [line for line in lines if "validation at iteration" in line and " | loss " in line]
    assert len(results) == 2, lines
    assert all("time (ms): data" in line for line in lines if "/      40 |" in line)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "40"
    if not with_tensorboard:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "throughput/tokens_per_s",
            "memory/peak_gib", "timers/forward_ms", "valid/loss", "valid/ppl"} <= tags, tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 41))
