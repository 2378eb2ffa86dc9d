"""How the layers run across GPUs: the parallel degrees, sequence parallelism, the one
tensor-parallel overlap (none, fused SP communication or Domino with its plan), CUDA graphs,
activation recompute, the data-parallel engine (ZeroConfig) and DiLoCo's outer optimizer across
sites of data-parallel ranks (DilocoConfig).

Rules that involve the architecture or the precision are the validator's (config/validate.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megadomino.config.check import ConfigError, check
from megadomino.config.diloco import DilocoConfig
from megadomino.config.zero import ZeroConfig


@dataclass(frozen=True)
class DominoPlan:
    """Domino's slicing: N batch slices x K hidden (ffn) slices under its explicit schedule.

    Batch slices may be uneven: b=5, N=2 gives sizes [3, 2] (the first b % N slices get one
    more). Hidden slices cut this rank's ffn columns into K equal chunks (K divides ffn / tp).
    """

    batch_slices: int = 1
    hidden_slices: int = 1
    explicit_backward: bool = False
    """Run Domino's schedule (each linear's weight-gradient GEMM queued behind its input-gradient
    collective) even with one batch and one hidden slice: Domino without slicing."""

    @property
    def enabled(self) -> bool:
        return self.explicit_backward or self.batch_slices > 1 or self.hidden_slices > 1

    def slice_sizes(self, batch: int) -> list[int]:
        """Sizes of the batch slices for a micro-batch of `batch` sequences."""
        if self.batch_slices > batch:
            raise ConfigError(
                f"--domino-batch-slices={self.batch_slices} is invalid: it must be at most the "
                f"micro-batch size ({batch})")
        base, extra = divmod(batch, self.batch_slices)
        return [base + (1 if i < extra else 0) for i in range(self.batch_slices)]

    def validate(self, ffn_hidden_size: int, tp: int, micro_batch_size: int | None = None) -> None:
        """Refuse a plan that cannot run, naming the flag."""
        check(self.batch_slices >= 1, "--domino-batch-slices", self.batch_slices,
              "a positive integer")
        ffn_local = ffn_hidden_size // tp
        check(self.hidden_slices >= 1 and ffn_local % self.hidden_slices == 0,
              "--domino-hidden-slices", self.hidden_slices,
              f"a divisor of the per-rank ffn size ({ffn_hidden_size} / tp {tp} = {ffn_local})")
        if micro_batch_size is not None:
            self.slice_sizes(micro_batch_size)


@dataclass
class ParallelConfig:
    """Parallelism and overlap, under Megatron-LM's flag names."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline stage (the interleaved schedule); None: one."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """The same, as layers per chunk: chunks = num_layers / (pp * this)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers of the first stage (uneven split; the middle stages share the rest evenly)."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers of the last stage."""
    nccl_communicator_config_path: str | None = None
    """--nccl-communicator-config-path: NCCL settings per process group, a YAML file of
    Megatron-LM's format (config/nccl.py); None: NCCL's defaults."""
    high_priority_stream_groups: list[str] | None = None
    """--high-priority-stream-groups: the groups whose NCCL kernels get a high-priority stream."""
    pipeline_plan: str | None = None
    """--pipeline-plan: a JSON file of stages (ranks, TP degree, layer range) for stage meshes
    of different shapes, or 'auto': planned at start-up from measured links and device speeds
    (pipeline/placement/); None: Megatron's uniform plan. Either way the run's PipelinePlan is
    resolved once (`config/pipeline_plan.py`'s `resolve_plan`; auto's after the process group
    exists, before ParallelDims)."""
    pipeline_planner: str = "op-fence"
    """--pipeline-planner, with --pipeline-plan auto: 'op-fence' (bandwidth clusters, exact
    layer cut), 'dt-fm' (DT-FM's equal groups and objective) or 'brute-force' (every ordered
    partition of the ranks: the oracle; slow beyond 8 ranks)."""
    pipeline_placement_dir: str | None = None
    """--pipeline-placement-dir, with --pipeline-plan auto: where the planned plan (plan.json,
    the --pipeline-plan file format) and the start-up measurement (links.json) are written;
    None: --save's directory when given, else they are only printed."""
    pipeline_link_delay: float = 0.0
    """--pipeline-link-delay: seconds added to every pipeline message, an emulation of link
    latency for experiments (this kernel has no netem): a received message is used that long
    after its wait found it arrived (pipeline/transport_delay.py); the start-up measurement's
    latency probes are delayed alike. 0: none."""
    emulate_slow_rank: str | None = None
    """--emulate-slow-rank RANK:FACTOR: rank RANK computes FACTOR times slower, for experiments
    on uneven devices: after each pipeline compute action (pipeline/executor.py) and each GEMM
    of --pipeline-plan auto's speed probe it waits FACTOR - 1 times as long as the work took.
    None: every rank at full speed."""
    pipeline_reshard: str = "auto"
    """--pipeline-reshard: how a --pipeline-plan's boundaries between stages of different
    layouts move an activation and its gradient (pipeline/reshard/boundary.py): 'send-recv'
    (one message per overlapping tile), 'broadcast' (a collective from one holder to every
    replica), 'scatter-gather' (each replica receives a part, then an all-gather among the
    replicas), or 'auto': per boundary and direction the one the cost model predicts fastest."""
    pipeline_codec: str = "none"
    """--pipeline-codec: how each pipeline boundary encodes its activations and gradients
    (pipeline/codec.py): 'none', 'int8' / 'int4' (per-token scales), 'adatopk' (the top-k
    entries of each token row; the gradient at the kept indices) or 'auto' (per link the least
    of none, int8, int4, adatopk that keeps its transfer under the slowest stage's compute);
    config/pipeline_codec.py has the rules."""
    pipeline_codec_density: float = 0.1
    """--pipeline-codec-density: adatopk's kept share of each row, k = ceil(density h): the
    fixed k without adaptation, the least k (the most compression) with it."""
    pipeline_codec_interval: int = 10
    """--pipeline-codec-interval: steps between re-estimates of each link's codec from its
    transfers' own timings (pipeline/codec_rate.py); 0: fixed, every link at the codec's
    setting (auto needs > 0)."""
    pipeline_codec_values: str = "native"
    """--pipeline-codec-values: adatopk's kept values as the activation's dtype ('native'),
    'int8' or 'int4' (the ZeRO++ quantizer, a scale per row)."""
    pipeline_codec_grad_topk: bool = False
    """--pipeline-codec-grad-topk: adatopk's gradient as its own top-k instead of at the
    forward's kept indices (an approximation of the masked function's gradient)."""
    pipeline_codec_error_feedback: bool = False
    """--pipeline-codec-error-feedback: each message adds the error the previous message of its
    (micro-batch, chunk) slot left (approximate for samples that do not repeat)."""
    nics_per_node: int | None = None
    """--nics-per-node: network interfaces per node, the GPUs spread evenly over them; the
    resharding cost model balances a boundary's senders per NIC (1: per host; --gpus-per-node:
    per device). None: one."""
    overlap_p2p_communication: bool | None = None
    """True (--overlap-p2p-communication): each pipeline receive is posted one compute of its
    pass ahead (schedules.with_transfers' `prefetch`), so that the transfer overlaps the computes
    between (gloo and NCCL move a message only once its receive is posted); False
    (--no-overlap-p2p-communication, Megatron's flag): posted just before it is needed; None:
    `prefetches_receives` decides by the backend. Eager-1F1B always prefetches."""
    pipeline_schedule: str = "1f1b"
    """'1f1b', 'interleaved' (needs virtual stages), 'eager-1f1b' (Alpa's overlap-friendly
    1F1B: more warm-up forwards, each forward's send overlapping the next compute), 'zb-h1'
    (zero-bubble ZB-H1: 1F1B with split backwards, pipeline/schedules.py), 'eager-zb'
    (eager-1F1B's forwards with ZB-H1's deferred weight gradients), 'zbv' (the V-shaped
    zero-bubble schedule on 2 chunks a stage placed in a V, config/pipeline_split.py) or 'auto'
    (the one the
    pipeline simulator predicts fastest from a start-up profile, pipeline/schedule_auto.py)."""
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    """With sequence parallelism: fuse the all-gather / reduce-scatter into the GEMMs
    (symmetric-memory kernels over NVLink copy engines; distributed/fused_matmul.py)."""
    domino: DominoPlan = field(default_factory=DominoPlan)
    """Domino's plan; DominoPlan() (the default) is off."""
    domino_auto: bool = False
    """--domino: time plain TP and Domino's plans at start-up and run the fastest."""
    enable_cuda_graph: bool = False
    """Capture the layers' forward + backward in CUDA graphs (megadomino/overlap/cuda_graph.py)."""
    gradient_accumulation_fusion: bool = True
    """Weight gradients accumulate into the engine's fp32 buffers inside their GEMM (Megatron's
    default; `--no-gradient-accumulation-fusion` turns it off): tp/layers.py `weight_grad`. The
    linears whose backward another path owns (Domino's schedule, FP8, the GEMM-fused collectives)
    keep returning their gradients."""
    compile_layer_pieces: bool = False
    """Compile each element-wise piece of the layers (bias + dropout + residual add, norms, GELU /
    SwiGLU with fc1's bias, rotary, the QKV split's backward) and of the loss with torch.compile
    (megadomino/models/elementwise.py, tp/cross_entropy.py); GELU's backward with fc1's bias and
    FP8 operands' casts run as Triton kernels (kernels/bias_grad.py, kernels/fp8_cast.py)."""
    recompute_granularity: str | None = None
    """None, 'full' (whole layers) or 'selective' (the attention core)."""
    recompute_method: str | None = None
    """With 'full': 'uniform' or 'block' (Megatron semantics)."""
    recompute_num_layers: int | None = None
    gpus_per_node: int | None = None
    """GPUs per node for node-aware groups; None: the launcher's LOCAL_WORLD_SIZE."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """The data-parallel engine: ZeRO stage 0 (plain data parallelism), 1 or 3, ZeRO++'s
    options."""
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    """DiLoCo across sites of data-parallel ranks (the engine runs inside each site, an outer
    optimizer steps across them); DilocoConfig() (the default) is off."""

    @property
    def fused_weight_gradients(self) -> bool:
        """The layers' linears own their weights' whole backward: gradient-accumulation fusion
        on and no Domino schedule (which hands weight gradients to autograd itself)."""
        return self.gradient_accumulation_fusion and not (self.domino.enabled or self.domino_auto)

    def prefetches_receives(self, nccl: bool) -> bool:
        """Whether pipeline receives are posted one compute ahead: the flag when given, else on
        gloo only. A gloo receive waits on a host thread and costs the computes nothing; an NCCL
        receive is a kernel that holds its thread blocks (SMs) from its launch until its message
        arrives, so posted ahead it slows the compute it overlaps by more than a fast link's
        transfer takes (docs/pipeline.md, "Prefetched receives")."""
        if self.overlap_p2p_communication is not None:
            return self.overlap_p2p_communication
        return not nccl

    def slowdown(self, rank: int) -> float:
        """--emulate-slow-rank's factor on `rank` (1.0: full speed); the validator checked the
        value's form (config/pipeline_auto.py)."""
        if self.emulate_slow_rank is None:
            return 1.0
        slow, factor = self.emulate_slow_rank.split(":")
        return float(factor) if int(slow) == rank else 1.0

    def virtual_chunks(self, num_layers: int) -> int:
        """Model chunks per pipeline stage, from either virtual-pipeline flag (1 without)."""
        if self.num_layers_per_virtual_pipeline_stage is not None:
            per = self.num_layers_per_virtual_pipeline_stage * self.pipeline_model_parallel_size
            return max(1, num_layers // per) if per > 0 else 1
        return self.virtual_pipeline_model_parallel_size or 1

    def data_parallel_size(self, dp: int) -> int:
        """The DP degree the batch arithmetic counts: the grid's `dp`, or 1 under
        --pipeline-plan, whose micro-batch holds the sequences of every DP rank of a stage."""
        return 1 if self.pipeline_plan is not None else dp

    @property
    def overlap(self) -> str:
        """The one tensor-parallel overlap in effect: 'none', 'fused-sp' (--sequence-parallel
        --tp-comm-overlap: communication fused into the GEMMs) or 'domino NxK' (batch x hidden
        slices under Domino's schedule; '1x1' is its unsliced explicit backward)."""
        if self.domino.enabled:
            return f"domino {self.domino.batch_slices}x{self.domino.hidden_slices}"
        return "fused-sp" if self.tp_comm_overlap else "none"


PIPELINE_RESHARD = ("auto", "send-recv", "broadcast", "scatter-gather")
"""--pipeline-reshard's choices (ParallelConfig.pipeline_reshard)."""

PIPELINE_PLANNERS = ("op-fence", "dt-fm", "brute-force")
"""--pipeline-planner's choices (ParallelConfig.pipeline_planner)."""


def check_degrees(world: int, tp: int, pp: int, dp: int) -> None:
    """Refuse degrees that do not tile the world, naming the flags."""
    if tp < 1:
        raise ConfigError(f"--tensor-model-parallel-size={tp} is invalid: it must be >= 1")
    if pp < 1:
        raise ConfigError(f"--pipeline-model-parallel-size={pp} is invalid: it must be >= 1")
    if dp < 1 or tp * pp * dp != world:
        raise ConfigError(
            f"world size {world} is not divisible into --tensor-model-parallel-size={tp} x "
            f"--pipeline-model-parallel-size={pp} x data-parallel: launch a multiple of "
            f"{tp * pp} processes, or change the parallel sizes")


def check_gpus_per_node(world: int, tp: int, gpus_per_node: int) -> None:
    if gpus_per_node < 1 or world % gpus_per_node != 0 and gpus_per_node < world:
        raise ConfigError(
            f"--gpus-per-node={gpus_per_node} is invalid: it must divide the world size {world}")
    if gpus_per_node % tp != 0 and gpus_per_node < world:
        raise ConfigError(
            f"--gpus-per-node={gpus_per_node} is invalid: a tensor-parallel group "
            f"(--tensor-model-parallel-size={tp}) must fit inside a node; use a multiple of {tp}")
