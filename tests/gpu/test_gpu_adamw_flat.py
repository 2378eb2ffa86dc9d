"""On the GPU machine: the flat AdamW kernel (kernels/adamw_flat.py, the engine's step on CUDA)
equals its torch reference, which the CPU tests check against torch's AdamW, at sizes that are
not multiples of anything, with clipping, two to four groups, a skipped step and the bf16 weights
written (rounded to nearest, exactly); and on the same data torch's fused AdamW over the
per-parameter views; and a training run with compiled pieces, evaluation and a learning rate
that changes every step compiles in its first step and never after (dynamo's counters).
`python -m pytest tests/gpu/test_gpu_adamw_flat.py -q` runs it."""

from __future__ import annotations

import pytest
import torch
from test_adamw_flat_kernel import CASES, check_adamw
from torch._dynamo.utils import counters

from configs import make_config
from megadomino.config import ModelConfig
from megadomino.distributed import ParallelDims
from megadomino.kernels.adamw_flat import adamw_flat, adamw_flat_reference
from megadomino.train.loop import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("n", [1, 4097, 3_000_001])
def test_flat_adamw_kernel_equals_reference_and_torch(n):
    torch.manual_seed(n)
    device = torch.device("cuda")
    split = n // 3
    group = torch.zeros(n, dtype=torch.uint8, device=device)
    group[split:] = 1
    lr = torch.tensor([1e-3, 2e-3], device=device)
    weight_decay = torch.tensor([0.1, 0.0], device=device)
    start = torch.randn(n, device=device)
    runs = {}
    for name, kernel in (("reference", adamw_flat_reference), ("kernel", adamw_flat)):
        master, exp_avg, exp_avg_sq = start.clone(), torch.zeros(n, device=device), \
            torch.zeros(n, device=device)
        weights = torch.empty(n, dtype=torch.bfloat16, device=device)
        step = torch.zeros((), device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        for i in range(4):
            grad = torch.randn(n, device=device, generator=gen)
            skip = torch.tensor(1.0 if i == 1 else 0.0, device=device)
            step += 1 - skip
            kernel(master, grad, exp_avg, exp_avg_sq, group, lr, weight_decay, 0.9, 0.95, 1e-8,
                   step, torch.tensor(0.5, device=device), skip, weights)
        assert torch.equal(weights, master.to(torch.bfloat16))
        runs[name] = (master, exp_avg, exp_avg_sq)
    for reference, kernel in zip(runs["reference"], runs["kernel"]):
        torch.testing.assert_close(kernel, reference, rtol=1e-6, atol=1e-7)
    pieces = [start[:split].clone(), start[split:].clone()]
    optimizer = torch.optim.AdamW([{"params": pieces[:1], "lr": 1e-3},
                                   {"params": pieces[1:], "lr": 2e-3, "weight_decay": 0.0}],
                                  weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    for i in range(4):
        grad = torch.randn(n, device=device, generator=gen)
        if i == 1:
            continue
        pieces[0].grad, pieces[1].grad = grad[:split] * 0.5, grad[split:] * 0.5
        optimizer.step()
    torch.testing.assert_close(runs["kernel"][0], torch.cat(pieces), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_flat_adamw_kernel_cases_on_cuda(case):
    """The interpreted CPU cases (tests/test_adamw_flat_kernel.py) on CUDA, bf16 copy exact."""
    check_adamw("cuda", False, *CASES[case], exact_weights=True, block=1024)


def _train(iters: int) -> dict:
    model = ModelConfig.preset("gpt-tiny", seq_length=32, max_position_embeddings=32,
                               vocab_size=331, params_dtype="bfloat16")
    config = make_config(model, compile_layer_pieces=True, micro_batch_size=2,
                         global_batch_size=4, train_iters=iters, lr=1e-3,
                         lr_warmup_iters=min(5, iters), log_interval=50, eval_interval=10,
                         eval_iters=2, mock_data=True, bf16=True)
    return train(config, ParallelDims(tp=1), "gpt", log=lambda _line: None)


@pytest.mark.usefixtures("single_process_group")
def test_training_compiles_once():
    torch._dynamo.reset()
    history = _train(iters=1)
    assert history["optimizer"].optimizer.flat
    compiled = counters["stats"]["unique_graphs"]
    history = _train(iters=30)
    assert len(history["eval"]) == 3
    assert history["losses"][-1] < history["losses"][0]
    assert counters["stats"]["unique_graphs"] == compiled, "compiled again after the first step"

