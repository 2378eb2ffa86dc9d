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
from megadomino.training.optimizer import MixedPrecisionAdamW, StepResult, build_optimizer

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
    model_config = _check_and_resolve(model_config, train_config, dims)
    schedule = LRSchedule.from_config(train_config, iters)
    if train_data is None or valid_data is None:
        if not train_config.mock_data:
            raise ConfigError("no training data: pass --mock-data, or build datasets from "
                              "--data-path and hand them to train()")
        seq, vocab, seed = model_config.seq_length, model_config.vocab_size, train_config.seed
        if train_data is None:
            train_data = MockDataset(seq, vocab, seed, "train")
        if valid_data is None:
            valid_data = MockDataset(seq, vocab, seed, "valid")

    model_parallel_seed(train_config.seed, dims)
    model = build_model(model_config, dims, family)
    model.train()
    device = next(model.parameters()).device
    grads = GradBuffer(model.parameters(), dims, bucket_numel=train_config.ddp_bucket_size)
    optimizer = build_optimizer(model.parameters(), dims, train_config)
    step = _Stepper(model, grads, optimizer, dims, train_config.micro_batch_size, num_micro, device)
    padded_vocab = model_config.padded_vocab_size(dims.tp)
    flops = num_floating_point_operations(model_config, gbs, padded_vocab)
    history = {"losses": [], "lrs": [], "grad_norms": [], "eval": [], "skipped_iterations": 0,
               "metrics": {}, "model": model, "optimizer": optimizer}
    reporter = _Reporter(history, dims, device, log, iters, flops,
                         gbs * model_config.seq_length, train_config.peak_tflops)

    successful_steps, valid_consumed = 0, 0
    evaluating = train_config.eval_iters > 0 and train_config.eval_interval > 0
    for iteration in range(1, iters + 1):
        lr = schedule(successful_steps)
        optimizer.set_lr(lr)
        loss, result = step.train(train_data, consumed=(iteration - 1) * gbs)
        successful_steps += not result.skipped
        reporter.record(loss, result, lr)
        if iteration % train_config.log_interval == 0 or iteration == iters:
            reporter.flush(iteration, optimizer)
        if evaluating and (iteration % train_config.eval_interval == 0 or iteration == iters):
            valid_loss = step.evaluate(valid_data, valid_consumed, train_config.eval_iters)
            valid_consumed += train_config.eval_iters * gbs
            reporter.validation(iteration, valid_loss)
    return history


def _check_and_resolve(model_config: ModelConfig, train_config: TrainConfig,
                       dims: ParallelDims) -> ModelConfig:
    """Refuse what the loop cannot run; the model config with params_dtype from --bf16/--fp16."""
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
    return model_config


class _Reporter:
    """Keeps each iteration's loss and grad norm as device tensors (no host sync per step); at a
    log boundary averages the losses over DP (one all-reduce for the interval), times the
    interval and logs one line on rank 0."""

    def __init__(self, history: dict, dims: ParallelDims, device: torch.device,
                 log: Callable[[str], None], iters: int, flops_per_iteration: float,
                 tokens_per_iteration: int, peak_tflops: float):
        self.history, self.dims, self.device, self.log = history, dims, device, log
        self.iters, self.flops = iters, flops_per_iteration
        self.tokens, self.peak_tflops = tokens_per_iteration, peak_tflops
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []
        self.skipped = 0
        self.start = time.perf_counter()

    def record(self, loss: torch.Tensor, result: StepResult, lr: float) -> None:
        self.losses.append(loss)
        no_norm = torch.full((), math.nan, device=self.device)
        self.norms.append(no_norm if result.grad_norm is None else result.grad_norm)
        self.skipped += result.skipped
        self.history["skipped_iterations"] += result.skipped
        self.history["lrs"].append(lr)

    def flush(self, iteration: int, optimizer: MixedPrecisionAdamW) -> None:
        """Log: the interval's mean loss, the current lr and grad norm, mean time per iteration."""
        losses = _dp_mean(torch.stack(self.losses), self.dims).tolist()
        norms = torch.stack(self.norms).tolist()
        self.history["losses"] += losses
        self.history["grad_norms"] += norms
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = (time.perf_counter() - self.start) / len(losses)
        metrics = throughput(self.flops, self.tokens, seconds, self.dims.world_size,
                             self.peak_tflops)
        metrics.update(loss=sum(losses) / len(losses), lr=self.history["lrs"][-1],
                       grad_norm=norms[-1], ms_per_iter=1e3 * seconds,
                       peak_memory_gib=peak_memory_gib(self.device))
        self.history["metrics"] = metrics
        if self.dims.rank == 0:
            line = (f" iteration {iteration:8d}/{self.iters:8d} | loss {metrics['loss']:.6E} | "
                    f"lr {metrics['lr']:.3E} | grad norm {metrics['grad_norm']:.3f} | "
                    f"{metrics['ms_per_iter']:.1f} ms/iter | "
                    f"{metrics['tokens_per_s']:.0f} tokens/s | "
                    f"{metrics['tflops_per_gpu']:.2f} TFLOP/s/GPU | "
                    f"MFU {100 * metrics['mfu']:.2f}% | "
                    f"peak mem {metrics['peak_memory_gib']:.2f} GiB")
            if optimizer.loss_scaler is not None:
                line += f" | loss scale {optimizer.loss_scaler.scale:.1f} | skipped {self.skipped}"
            self.log(line)
        self.losses, self.norms, self.skipped = [], [], 0
        self.start = time.perf_counter()

    def validation(self, iteration: int, loss: float) -> None:
        ppl = math.exp(min(20.0, loss))
        self.history["eval"].append({"iteration": iteration, "loss": loss, "ppl": ppl})
        if self.dims.rank == 0:
            self.log(f" validation at iteration {iteration} | loss {loss:.6E} | ppl {ppl:.6E}")
        self.start = time.perf_counter()  # evaluation time is not training time


class _Stepper:
    """One training iteration or one evaluation pass over global batches, for fixed shapes."""

    def __init__(self, model: nn.Module, grads: GradBuffer, optimizer: MixedPrecisionAdamW,
                 dims: ParallelDims, micro_batch_size: int, num_micro: int,
                 device: torch.device):
        self.model, self.grads, self.optimizer, self.dims = model, grads, optimizer, dims
        self.mbs, self.num_micro, self.device = micro_batch_size, num_micro, device

    def _micro_batch(self, dataset: Dataset, consumed: int,
                     micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    def train(self, dataset: Dataset, consumed: int) -> tuple[torch.Tensor, StepResult]:
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
