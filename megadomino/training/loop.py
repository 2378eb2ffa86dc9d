"""The training loop: micro-batch accumulation, overlapped DP reduce, mixed precision, eval, logs.

One iteration consumes one global batch of `global_batch_size` samples: `global_batch_size //
(micro_batch_size * dp)` micro-batches per rank, each a forward and a backward of the mean loss
over its loss-mask tokens divided by the number of micro-batches (times the loss scale in fp16).
All but the last backward run under `GradBuffer.no_sync()`; the last launches the DP all-reduces
bucket by bucket while backward proceeds. Then `finish_grad_sync()`, clip, AdamW step.

Sampling is Megatron's pretraining sampler: iteration k reads samples [k * gbs, (k + 1) * gbs);
micro-batch m of DP rank r reads `micro_batch_size` consecutive samples starting at
k * gbs + (m * dp + r) * micro_batch_size. The ranks of one TP group read the same samples.

The device is the current CUDA device when CUDA is available, else the CPU; whoever initialised
the process group chose the backend to match.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megadomino.config import ConfigError, ModelConfig, TrainConfig
from megadomino.models import build_model
from megadomino.parallel import ParallelDims
from megadomino.parallel.random import model_parallel_seed
from megadomino.training.data.mock import MockDataset
from megadomino.training.ddp import GradBuffer
from megadomino.training.lr_schedule import LRSchedule
from megadomino.training.metrics import num_floating_point_operations, peak_memory_gib, throughput
from megadomino.training.optimizer import build_optimizer

Dataset = Sequence[torch.Tensor]
"""dataset[i]: a LongTensor [seq_length + 1] of token ids (inputs [:-1], labels [1:])."""


def batch_plan(config: TrainConfig, dp: int) -> tuple[int, int]:
    """(global batch size, micro-batches per rank per iteration); ConfigError if they don't tile.
    Pure arithmetic: call it before any collective so every rank refuses alike."""
    mbs = config.micro_batch_size
    if mbs < 1:
        raise ConfigError(f"--micro-batch-size={mbs} is invalid: it must be >= 1")
    gbs = config.global_batch_size if config.global_batch_size is not None else mbs * dp
    if gbs < 1 or gbs % (mbs * dp) != 0:
        raise ConfigError(
            f"--global-batch-size={gbs} is invalid: it must be a positive multiple of "
            f"--micro-batch-size ({mbs}) x data-parallel size ({dp}) = {mbs * dp}")
    return gbs, gbs // (mbs * dp)


def train_iterations(config: TrainConfig, global_batch_size: int) -> int:
    """--train-iters, or --train-samples // global batch size."""
    if config.train_iters is not None:
        iters = config.train_iters
    elif config.train_samples is not None:
        iters = config.train_samples // global_batch_size
    else:
        raise ConfigError("the run length is missing: pass --train-iters or --train-samples")
    if iters < 1:
        raise ConfigError(f"the run has {iters} iterations: --train-iters (or --train-samples / "
                          f"--global-batch-size) must give at least one")
    return iters


def train(model_config: ModelConfig, train_config: TrainConfig, dims: ParallelDims,
          family: str = "gpt", log: Callable[[str], None] = print,
          train_data: Dataset | None = None, valid_data: Dataset | None = None) -> dict:
    """Train a `family` model ('gpt' or 'llama') as the configs say; lines go to `log` on rank 0.

    Datasets default to `MockDataset` (train / valid splits) when `train_config.mock_data`.
    Returns per-iteration lists `losses` (DP-averaged), `lrs`, `grad_norms` (nan when an fp16
    step was skipped), `eval` ({iteration, loss, ppl} dicts), `skipped_iterations`, the last
    interval's `metrics`, and the `model` and `optimizer`.
    """
    gbs, num_micro = batch_plan(train_config, dims.dp)
    iters = train_iterations(train_config, gbs)
    if train_config.bf16 and train_config.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive: choose one")
    if dims.pp != 1 or train_config.pipeline_model_parallel_size != 1:
        raise ConfigError("--pipeline-model-parallel-size > 1 is not supported: use 1")
    if train_config.tensor_model_parallel_size != dims.tp:
        raise ConfigError(f"--tensor-model-parallel-size={train_config.tensor_model_parallel_size}"
                          f" disagrees with the process grid's tp={dims.tp}")
    dtype = "bfloat16" if train_config.bf16 else "float16" if train_config.fp16 else "float32"
    model_config = model_config.replace(params_dtype=dtype)
    model_config.validate(tp=dims.tp)
    schedule = LRSchedule.from_config(train_config, iters)
    if train_data is None or valid_data is None:
        if not train_config.mock_data:
            raise ConfigError("no training data: pass --mock-data, or build datasets from "
                              "--data-path and hand them to train()")
        seq, vocab, seed = model_config.seq_length, model_config.vocab_size, train_config.seed
        train_data = train_data or MockDataset(seq, vocab, seed, "train")
        valid_data = valid_data or MockDataset(seq, vocab, seed, "valid")

    model_parallel_seed(train_config.seed, dims)
    model = build_model(model_config, dims, family)
    model.train()
    device = next(model.parameters()).device
    grads = GradBuffer(model.parameters(), dims, bucket_numel=train_config.ddp_bucket_size)
    optimizer = build_optimizer(model.parameters(), dims, train_config)
    padded_vocab = model_config.padded_vocab_size(dims.tp)
    flops = num_floating_point_operations(model_config, gbs, padded_vocab)
    step = _Stepper(model, grads, optimizer, dims, train_config.micro_batch_size, num_micro, device)

    history = {"losses": [], "lrs": [], "grad_norms": [], "eval": [], "skipped_iterations": 0,
               "metrics": {}, "model": model, "optimizer": optimizer}
    pending_loss: list[torch.Tensor] = []
    pending_norm: list[torch.Tensor] = []
    successful_steps, valid_consumed = 0, 0
    interval_start, interval_skipped = time.perf_counter(), 0
    evaluating = train_config.eval_iters > 0 and train_config.eval_interval > 0
    for iteration in range(1, iters + 1):
        lr = schedule(successful_steps)
        optimizer.set_lr(lr)
        loss, result = step.train(train_data, consumed=(iteration - 1) * gbs)
        successful_steps += not result.skipped
        interval_skipped += result.skipped
        pending_loss.append(loss)
        nan = torch.full((), math.nan, device=device)
        pending_norm.append(nan if result.grad_norm is None else result.grad_norm)
        history["lrs"].append(lr)

        if iteration % train_config.log_interval == 0 or iteration == iters:
            losses = _dp_mean(torch.stack(pending_loss), dims).tolist()
            norms = torch.stack(pending_norm).tolist()
            history["losses"] += losses
            history["grad_norms"] += norms
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = (time.perf_counter() - interval_start) / len(losses)
            metrics = throughput(flops, gbs * model_config.seq_length, seconds, dims.world_size,
                                 train_config.peak_tflops)
            metrics.update(loss=losses[-1], lr=lr, grad_norm=norms[-1], ms_per_iter=1e3 * seconds,
                           peak_memory_gib=peak_memory_gib(device))
            history["metrics"] = metrics
            if dims.rank == 0:
                log(_format_line(iteration, iters, metrics, optimizer, interval_skipped))
            pending_loss, pending_norm, interval_skipped = [], [], 0
            interval_start = time.perf_counter()
        history["skipped_iterations"] += result.skipped

        if evaluating and (iteration % train_config.eval_interval == 0 or iteration == iters):
            valid_loss = step.evaluate(valid_data, valid_consumed, train_config.eval_iters)
            valid_consumed += train_config.eval_iters * gbs
            ppl = math.exp(min(20.0, valid_loss))
            history["eval"].append({"iteration": iteration, "loss": valid_loss, "ppl": ppl})
            if dims.rank == 0:
                log(f" validation at iteration {iteration} | loss {valid_loss:.6E} | "
                    f"ppl {ppl:.6E}")
            interval_start = time.perf_counter()
    return history


class _Stepper:
    """One training iteration or one evaluation pass over global batches, for fixed shapes."""

    def __init__(self, model: nn.Module, grads: GradBuffer, optimizer, dims: ParallelDims,
                 micro_batch_size: int, num_micro: int, device: torch.device):
        self.model, self.grads, self.optimizer, self.dims = model, grads, optimizer, dims
        self.mbs, self.num_micro, self.device = micro_batch_size, num_micro, device

    def _micro_batch(self, dataset: Dataset, consumed: int, micro: int):
        """(tokens, labels, loss_mask), each [mbs, seq], of micro-batch `micro` for this DP rank."""
        start = consumed + (micro * self.dims.dp + self.dims.dp_rank) * self.mbs
        samples = torch.stack([dataset[i] for i in range(start, start + self.mbs)])
        samples = samples.to(self.device, non_blocking=True)
        tokens, labels = samples[:, :-1], samples[:, 1:]
        return tokens, labels, torch.ones(labels.shape, device=self.device)

    def _loss(self, dataset: Dataset, consumed: int, micro: int) -> torch.Tensor:
        tokens, labels, loss_mask = self._micro_batch(dataset, consumed, micro)
        per_token = self.model(tokens, labels=labels, loss_mask=loss_mask)
        return per_token.sum() / loss_mask.sum()

    def train(self, dataset: Dataset, consumed: int):
        """Accumulate gradients over the micro-batches, reduce, step. Returns (this rank's mean
        loss as a 0-dim tensor, StepResult)."""
        self.grads.zero_grad()
        scaler = self.optimizer.loss_scaler
        scale = scaler.scale if scaler is not None else 1.0
        total = torch.zeros((), device=self.device)
        for micro in range(self.num_micro):
            last = micro == self.num_micro - 1
            with self.grads.no_sync() if not last else contextlib.nullcontext():
                loss = self._loss(dataset, consumed, micro)
                (loss * (scale / self.num_micro)).backward()
            total += loss.detach()
        self.grads.finish_grad_sync()
        return total / self.num_micro, self.optimizer.step()

    @torch.no_grad()
    def evaluate(self, dataset: Dataset, consumed: int, iters: int) -> float:
        """Mean loss over `iters` global batches starting at sample `consumed`, averaged over DP."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for batch in range(iters):
            for micro in range(self.num_micro):
                total += self._loss(dataset, consumed + batch * self.num_micro * self.mbs
                                    * self.dims.dp, micro)
        self.model.train()
        return _dp_mean(total / (iters * self.num_micro), self.dims).item()


def _dp_mean(values: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    if dims.dp > 1:
        values = values.clone()
        dist.all_reduce(values, group=dims.dp_group)
        values /= dims.dp
    return values


def _format_line(iteration: int, iters: int, metrics: dict, optimizer, skipped: int) -> str:
    line = (f" iteration {iteration:8d}/{iters:8d} | loss {metrics['loss']:.6E} | "
            f"lr {metrics['lr']:.3E} | grad norm {metrics['grad_norm']:.3f} | "
            f"{metrics['ms_per_iter']:.1f} ms/iter | {metrics['tokens_per_s']:.0f} tokens/s | "
            f"{metrics['tflops_per_gpu']:.2f} TFLOP/s/GPU | MFU {100 * metrics['mfu']:.2f}% | "
            f"peak mem {metrics['peak_memory_gib']:.2f} GiB")
    if optimizer.loss_scaler is not None:
        line += f" | loss scale {optimizer.loss_scaler.scale:.1f} | skipped {skipped}"
    return line
