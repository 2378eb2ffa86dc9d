"""ZeroConfig, the data-parallel engine's section of ParallelConfig: which ZeRO stage (0: plain
data parallelism), and which of ZeRO++'s three communication cuts are on. An option left at its
default counts as not asked for.

Field names follow the command-line flags that set them (`--zero-stage`,
`--zeropp-quantized-weights`, `--zeropp-hpz-partition-size`, `--zeropp-quantized-gradients`,
`--zeropp-gradient-bits`, `--zeropp-block-size`); errors name the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megadomino.config.check import ConfigError, check

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ZeroConfig:
    stage: int = 0
    """0: plain data parallelism (every rank holds everything; gradients all-reduced in buckets
    overlapped with backward, Megatron's DDP). 1: optimizer states and fp32 masters sharded over
    DP, gradients reduce-scattered, parameters all-gathered after the step (Megatron's
    --use-distributed-optimizer). 3: parameters too."""
    bucket_numel: int = 25_000_000
    """Stage 0: elements per all-reduce bucket (--ddp-bucket-size; partition.find_buckets)."""
    quantized_weights: bool = False
    """qwZ (stage 3): each forward all-gather sends the weight shard block-quantized to
    `weight_bits` and dequantizes it on arrival."""
    weight_bits: int = 8
    hpz_partition_size: int = 1
    """hpZ (stage 3): 1 = off; else the DP ranks of one node (dims.dp_per_node), which then keep a
    secondary copy of every gathered parameter partitioned among themselves, so that backward and
    further micro-batches of a step gather inside the node only."""
    quantized_gradients: bool = False
    """qgZ: the gradient reduce-scatter becomes the hierarchical quantized all-to-all."""
    gradient_bits: int = 4
    block_size: int = 2048
    """Elements per quantization block (one fp32 scale each), for weights and gradients."""
    quantize_full_range: bool = False
    """qwZ and qgZ quantize with every two's-complement level, as DeepSpeed's quantizer: scale
    absmax / 2^(bits-1), q in [-2^(bits-1), 2^(bits-1) - 1] (the block's positive maximum
    clipped one step). Off: the symmetric scheme, absmax / (2^(bits-1) - 1), q within
    +-(2^(bits-1) - 1). int4's error is about 12% lower with it and its int4 kernels up to 15%
    slower (BENCHMARKS.md, "ZeRO++ quantization kernels")."""
    overlap_param_gather: bool = False
    """Stage 1: the all-gather of the new weights after the step is launched per unit and waited
    on just before the unit's first use in the next forward (--overlap-param-gather), not
    before the step returns; the same values either way."""
    fp8_param_gather: bool = False
    """Stages 1 and 3, with FP8 linears (--fp8-format): their weights are all-gathered as e4m3
    codes with one scale per weight, about half a bf16 gather's bytes (Megatron-LM's
    --fp8-param-gather; zero/fp8_gather.py). The weight is rounded to FP8 once either way;
    with it the weight's scale is its current amax's (max-reduced over DP) under both
    recipes."""
    prefetch: bool = True
    """Stage 3: start gathering the next unit (layer) while this one computes."""
    reduce_dtype: str = "float32"
    """The dtype the plain reduce-scatter sends ('float32', 'bfloat16', 'float16'); gradients are
    accumulated and the result is kept in fp32 either way. qgZ quantizes from fp32."""
    reduce_pipeline_depth: int = 2
    """Gradient reductions in flight during backward: 2 (default) finishes unit i-2's and
    advances unit i-1's (qgZ: its inter-node all-to-all) when unit i launches; 1 finishes unit
    i-1's first (less memory at stage 3: two units' gradient buffers instead of three)."""
    layers_per_unit: int | None = None
    """Consecutive transformer layers gathered, freed and reduced together as one unit (one flat
    buffer, one collective each way). None (the default): as many as it takes for a unit to hold
    `unit_params` parameters. More per unit: fewer, larger collectives and kernel launches, less
    host time a step (what a small micro-batch waits on), for more memory: stage 3 holds about
    two units' gathered parameters at once (the one running and the prefetched one) and up to
    three units' fp32 gradient buffers."""
    unit_params: int = 200_000_000
    """With `layers_per_unit` None: a unit takes consecutive layers of one list until it holds at
    least this many parameters (this rank's, after tensor parallelism), like DeepSpeed's bucket
    sizes. 2e8 is measured (BENCHMARKS.md, "Data parallelism"; the study:
    benchmarks/reports/2026-11-22-zero-engine-nvlink.md): GPT-3 1.3B's 50M-parameter layers go
    four to a unit (0.65-0.85x the step time at micro-batch 1), 6.7B's 201M-parameter layers stay
    one to a unit, so that the transient memory stays what a layer of 2e8 parameters needs."""
    min_units: int = 6
    """With `layers_per_unit` None: a unit takes at most 1/min_units of its list's layers (at
    least one), so that a list of small layers still makes min_units units. Gathers are
    prefetched a unit ahead and gradient reductions run two units deep, so only several units
    overlap communication with compute: a small model made one unit ran 1.3-1.4x slower over a
    100 Mbit/s link than one layer a unit (benchmarks/reports/2026-11-22-zero-slow-link-netns.md).
    GPT-3 1.3B's 24 layers: at most 4."""
    on_nonfinite: str = "skip"
    """A step whose gradients hold inf/NaN on any rank: 'skip' it (the fp16 loss scaler backs off)
    or 'error' (FloatingPointError on every rank)."""

    def __post_init__(self) -> None:
        check(self.stage in (0, 1, 3), "--zero-stage", self.stage, "0, 1 or 3")
        check(isinstance(self.bucket_numel, int) and self.bucket_numel >= 1, "--ddp-bucket-size",
               self.bucket_numel, "an integer >= 1")
        check(self.weight_bits in (4, 8), "weight_bits", self.weight_bits, "4 or 8")
        check(self.gradient_bits in (4, 8), "--zeropp-gradient-bits", self.gradient_bits,
               "4 or 8")
        # Even, so that int4 halves pack into whole bytes inside every block.
        check(self.block_size >= 2 and self.block_size % 2 == 0, "--zeropp-block-size",
               self.block_size, "an even integer >= 2")
        check(self.hpz_partition_size >= 1, "--zeropp-hpz-partition-size",
               self.hpz_partition_size, ">= 1")
        check(self.reduce_dtype in REDUCE_DTYPES, "reduce_dtype", self.reduce_dtype,
               f"one of {sorted(REDUCE_DTYPES)}")
        check(self.reduce_pipeline_depth in (1, 2), "reduce_pipeline_depth",
               self.reduce_pipeline_depth, "1 or 2")
        check(self.layers_per_unit is None
               or (isinstance(self.layers_per_unit, int) and self.layers_per_unit >= 1),
               "--zero-layers-per-unit", self.layers_per_unit, "an integer >= 1 (or none: "
               "units of --zero-unit-params parameters)")
        check(isinstance(self.unit_params, int) and self.unit_params >= 1, "--zero-unit-params",
               self.unit_params, "an integer >= 1")
        check(isinstance(self.min_units, int) and self.min_units >= 1, "min_units",
               self.min_units, "an integer >= 1")
        check(self.on_nonfinite in ("skip", "error"), "on_nonfinite", self.on_nonfinite,
               "'skip' or 'error'")
        if self.quantize_full_range and not (self.quantized_weights or self.quantized_gradients):
            raise ConfigError("--zeropp-quantize-full-range sets how qwZ and qgZ quantize: add "
                              "--zeropp-quantized-weights or --zeropp-quantized-gradients")
        options = {"--zeropp-quantized-weights": self.quantized_weights,
                   "--zeropp-hpz-partition-size": self.hpz,
                   "--zeropp-quantized-gradients": self.quantized_gradients,
                   "--zeropp-gradient-bits": self.gradient_bits != ZeroConfig.gradient_bits,
                   "--zeropp-block-size": self.block_size != ZeroConfig.block_size,
                   "--zeropp-quantize-full-range": self.quantize_full_range,
                   "--zero-layers-per-unit": self.layers_per_unit is not None,
                   "--zero-unit-params": self.unit_params != ZeroConfig.unit_params}
        if self.stage == 0:
            flag = next((flag for flag, on in options.items() if on), None)
            if flag is not None:
                raise ConfigError(f"{flag} is a ZeRO option: add --zero-stage 3 (or --zero-stage "
                                  "1 for --zeropp-quantized-gradients, --zero-layers-per-unit "
                                  "and --zero-unit-params)")
            check(self.reduce_dtype == "float32", "reduce_dtype", self.reduce_dtype,
                  "'float32' at stage 0")
        if options["--zeropp-gradient-bits"] and not self.quantized_gradients:
            raise ConfigError("--zeropp-gradient-bits sets qgZ's precision: add "
                              "--zeropp-quantized-gradients")
        quantized = self.quantized_weights or self.quantized_gradients
        if options["--zeropp-block-size"] and not quantized:
            raise ConfigError("--zeropp-block-size sets the blocks of qwZ and qgZ: add "
                              "--zeropp-quantized-weights or --zeropp-quantized-gradients")
        if options["--zero-layers-per-unit"] and options["--zero-unit-params"]:
            raise ConfigError(f"--zero-layers-per-unit {self.layers_per_unit} fixes the layers a "
                              f"unit, --zero-unit-params {self.unit_params} sizes units by "
                              "parameters: give one of them")
        check(not self.fp8_param_gather or self.stage in (1, 3), "--fp8-param-gather", True,
              "used with --use-distributed-optimizer (--zero-stage 1) or --zero-stage 3: at "
              "stage 0 nothing is gathered")
        check(not (self.fp8_param_gather and self.quantized_weights), "--fp8-param-gather", True,
              "without --zeropp-quantized-weights: both quantize the weight gather, choose one")
        check(not (self.fp8_param_gather and self.hpz), "--fp8-param-gather", True,
              "without --zeropp-hpz-partition-size: hpZ's secondary copies are kept in the "
              "parameters' dtype, not as FP8 codes")
        check(not self.overlap_param_gather or self.stage == 1, "--overlap-param-gather", True,
              "used with --use-distributed-optimizer (--zero-stage 1): stage 0 gathers nothing "
              "and stage 3 prefetches its gathers already")
        if self.stage == 1:
            check(not self.quantized_weights, "--zeropp-quantized-weights", True,
                   "off at --zero-stage 1 (parameters are not partitioned, nothing is gathered "
                   "before use)")
            check(self.hpz_partition_size == 1, "--zeropp-hpz-partition-size",
                   self.hpz_partition_size, "1 at --zero-stage 1")

    @property
    def hpz(self) -> bool:
        return self.hpz_partition_size > 1

    def check_dims(self, dims) -> None:
        """Refuse an hpZ partition that is not one node's DP ranks (the only secondary group the
        process grid provides)."""
        if self.hpz:
            check(self.hpz_partition_size == dims.dp_per_node, "--zeropp-hpz-partition-size",
                   self.hpz_partition_size,
                   f"1 or the data-parallel ranks per node ({dims.dp_per_node}: "
                   f"--gpus-per-node {dims.gpus_per_node} / tensor-parallel {dims.tp})")

