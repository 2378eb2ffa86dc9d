"""DilocoConfig, the DiLoCo section of ParallelConfig: data parallelism across slow links by an
outer optimizer (megadomino/zero/diloco.py), and the rules it meets beside the other sections.

The data-parallel ranks are cut into `sites` (by default one a node): inside a site the engine
trains as always (ZeRO at the configured stage over the site's data-parallel ranks), and every
`inner_steps` (H) steps the sites average their pseudo-gradients in one outer Nesterov step.
Field names follow the flags (`--diloco-inner-steps`, `--diloco-sites`, `--diloco-outer-lr`,
`--diloco-outer-momentum`, `--diloco-pseudo-grad-dtype`); errors name the flag. Every rule is
checked before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from megadomino.config.check import ConfigError, check

PSEUDO_GRAD_DTYPES = ("fp32", "bf16", "int8")
"""How a site sends its pseudo-gradient (--diloco-pseudo-grad-dtype): as it is, rounded to
bfloat16, or block-quantized to int8 (the kernels' scheme, megadomino.kernels.quant_scheme)."""


@dataclass
class DilocoConfig:
    inner_steps: int | None = None
    """H, the inner steps between two outer steps (--diloco-inner-steps); None: DiLoCo is off
    and the data-parallel group is every DP rank, as without this section."""
    sites: int | None = None
    """Sites the data-parallel ranks are cut into, each a run of consecutive DP ranks of every
    (stage, tensor-parallel rank) column (--diloco-sites); None: one site a node, as
    --gpus-per-node cuts the DP ranks (ParallelDims' intra-node groups)."""
    outer_lr: float = 0.7
    """The outer learning rate (DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """The outer Nesterov momentum (DiLoCo's 0.9); 0: plain SGD on the averaged
    pseudo-gradients (with outer_lr 1 and H = 1, plain data parallelism under SGD)."""
    pseudo_grad_dtype: str = "bf16"
    """What crosses the sites: 'fp32', 'bf16' (half fp32's bytes; OpenDiLoCo sends fp16) or
    'int8' (a quarter, plus one fp32 scale per `int8_block_size` elements; INTELLECT-1 sends
    int8)."""
    int8_block_size: int = 2048
    """int8: elements per quantization block, one fp32 scale each (0.2% more bytes at 2048)."""

    def __post_init__(self) -> None:
        check(self.inner_steps is None or (isinstance(self.inner_steps, int)
                                           and self.inner_steps >= 1),
              "--diloco-inner-steps", self.inner_steps, "an integer >= 1")
        check(self.sites is None or (isinstance(self.sites, int) and self.sites >= 2),
              "--diloco-sites", self.sites, "an integer >= 2 (DiLoCo averages across sites)")
        check(self.outer_lr > 0, "--diloco-outer-lr", self.outer_lr, "> 0")
        check(0 <= self.outer_momentum < 1, "--diloco-outer-momentum", self.outer_momentum,
              "in [0, 1)")
        check(self.pseudo_grad_dtype in PSEUDO_GRAD_DTYPES, "--diloco-pseudo-grad-dtype",
              self.pseudo_grad_dtype, " or ".join(PSEUDO_GRAD_DTYPES))
        check(isinstance(self.int8_block_size, int) and 2 <= self.int8_block_size <= 16384,
              "int8_block_size", self.int8_block_size, "an integer in [2, 16384]")
        if self.inner_steps is None:
            given = next((flag for flag, field in _OPTIONS.items()
                          if getattr(self, field) != getattr(DilocoConfig, field)), None)
            if given is not None:
                raise ConfigError(f"{given} sets DiLoCo's outer step: add --diloco-inner-steps "
                                  "H (inner steps between outer steps)")

    @property
    def enabled(self) -> bool:
        return self.inner_steps is not None


_OPTIONS = {"--diloco-sites": "sites", "--diloco-outer-lr": "outer_lr",
            "--diloco-outer-momentum": "outer_momentum",
            "--diloco-pseudo-grad-dtype": "pseudo_grad_dtype"}


def site_count(parallel, world_size: int, gpus_per_node: int | None) -> int:
    """The DiLoCo sites of a run of `world_size` ranks on `parallel` (a ParallelConfig) with
    `gpus_per_node` a node (None: one node): --diloco-sites, or one a node as ParallelDims cuts
    the data-parallel ranks by node; 1 with DiLoCo off."""
    diloco = parallel.diloco
    if not diloco.enabled:
        return 1
    if diloco.sites is not None:
        return diloco.sites
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dp = max(1, world_size // (tp * pp))
    dp_per_node = max(1, min(dp, (parallel.gpus_per_node or gpus_per_node or world_size) // tp))
    return -(-dp // dp_per_node)


def check_diloco(config, world_size: int | None = None,
                 gpus_per_node: int | None = None) -> None:
    """DiLoCo beside the other sections (a `Config`), and on `world_size` ranks: the sites must
    be whole, and nothing may talk across them during the inner steps."""
    parallel = config.parallel
    if not parallel.diloco.enabled:
        return
    if parallel.pipeline_plan is not None:
        raise ConfigError("--diloco-inner-steps cuts the data-parallel ranks of Megatron's grid "
                          "into sites; --pipeline-plan lays stages out otherwise: drop one")
    if config.train.schedule.calculate_per_token_loss:
        raise ConfigError("--calculate-per-token-loss counts the tokens of every data-parallel "
                          "rank each step, across DiLoCo's sites, which talk only every "
                          "--diloco-inner-steps: drop one")
    if world_size is None:
        return
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    sites = site_count(parallel, world_size, gpus_per_node)
    if parallel.diloco.sites is None and sites < 2:
        raise ConfigError(f"--diloco-inner-steps averages across sites, one a node, and the "
                          f"{dp} data-parallel ranks sit on one node: give --diloco-sites N "
                          "(N >= 2 dividing the data-parallel size) or a smaller --gpus-per-node")
    check(dp % sites == 0, "--diloco-sites", sites,
          f"a divisor of the data-parallel size ({dp} = world {world_size} / "
          f"(tensor-parallel {tp} x pipeline-parallel {pp}))")
