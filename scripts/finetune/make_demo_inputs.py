"""Inputs for the SFT recipe without downloads: a learnable JSONL task and a randomly initialised
Hugging Face Llama directory (a preset's shape, fewer layers, the tokenizer's vocabulary).

    python scripts/finetune/make_demo_inputs.py data --out demo/sft.jsonl
    python scripts/train_tokenizer.py --input demo/sft.jsonl --json-keys prompt response \
        --model-prefix demo/hf/tokenizer --vocab-size 512
    python scripts/finetune/make_demo_inputs.py model --tokenizer-model demo/hf/tokenizer.model \
        --preset llama2-7b --num-layers 4 --out demo/hf

The task mixes two kinds of {"prompt", "response"} pairs: two-number sums ("What is 12 plus
30?" -> "12 plus 30 is 42.") and word-order reversal ("Reverse the words: a b c" -> "c b a").
"""

from __future__ import annotations

import argparse
import json
import random
import sys

WORDS = ("apple river stone cloud garden silver window forest candle mirror bridge island "
         "thunder meadow lantern harbor violet copper shadow orchard falcon pebble summer "
         "winter amber canyon desert glacier harvest ivory jungle kettle ladder marble needle "
         "ocean pepper quartz saddle timber velvet walnut").split()


def demo_example(rng: random.Random) -> dict[str, str]:
    """One prompt/response pair of the demo task."""
    if rng.random() < 0.5:
        a, b = rng.randrange(100), rng.randrange(100)
        return {"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."}
    words = rng.sample(WORDS, rng.randint(3, 6))
    return {"prompt": "Reverse the words: " + " ".join(words),
            "response": " ".join(reversed(words))}


def write_data(out: str, examples: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(out, "w", encoding="utf-8") as file:
        for _ in range(examples):
            file.write(json.dumps(demo_example(rng)) + "\n")


def write_model(out: str, tokenizer_model: str, preset: str, num_layers: int, dtype: str,
                seed: int) -> None:
    """A random LlamaModel of `preset` with `num_layers` layers, saved as an HF directory."""
    import sentencepiece
    import torch
    import torch.distributed as dist

    from megadomino.config import ModelConfig
    from megadomino.distributed import ParallelDims
    from megadomino.interop.hf import save_llama
    from megadomino.models.llama import LlamaModel

    vocab_size = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model).get_piece_size()
    config = ModelConfig.preset(preset, num_layers=num_layers, vocab_size=vocab_size)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(seed)
        model = LlamaModel(config, ParallelDims(tp=1), device="cpu")
        save_llama(model, out, dtype=dtype)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data", help="write the JSONL task")
    data.add_argument("--out", required=True)
    data.add_argument("--examples", type=int, default=20000)
    model = commands.add_parser("model", help="write a random HF Llama directory")
    model.add_argument("--out", required=True)
    model.add_argument("--tokenizer-model", required=True, help="sentencepiece .model")
    model.add_argument("--preset", default="llama2-7b")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    for sub in (data, model):
        sub.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.command == "data":
        write_data(args.out, args.examples, args.seed)
    else:
        write_model(args.out, args.tokenizer_model, args.preset, args.num_layers, args.dtype,
                    args.seed)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
