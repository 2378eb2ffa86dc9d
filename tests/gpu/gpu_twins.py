"""Running the CPU twins' distributed cases on a rank's GPU: what tests/gpu's NCCL suites of the
pipeline, resharding and checkpoint cases share.

The twins (tests/test_pipeline_*.py, test_reshard_dist.py, test_checkpoint.py, ...) write their
cases for gloo: a few of their helpers build on an explicit `device="cpu"`, draw inputs from a
CPU `torch.Generator()`, or sum into a CPU `torch.zeros(())`. A GPU suite's setup replaces
exactly those helpers, in the twin's namespace and in the rank only (ranks are spawned, so
nothing leaks into the pytest process), with the wrappers below, and leaves everything else as
the CPU run has it: the default device stays the CPU, so the library's own placement (the
training loop's device, its host-side data) is what runs, not a test-wide override. Inputs are
drawn on the CPU, as the twin draws them, then moved: the GPU run sees the CPU run's values.

The device is the default group's (`comm.group_device()`): the rank's GPU under NCCL, the CPU
under gloo, so the same setup runs a gloo world of the same cases (how these suites are checked
on a machine without GPUs).
"""

from __future__ import annotations

import functools
import inspect
import os
import types
from collections.abc import Callable

import torch

from dist_utils import C, DistSuite
from megadomino.distributed import comm

FP32_REL = 1e-4
"""fp32 with TF32 off against the twin's single-process reference: the GPU's kernels sum in
other orders than the CPU's (the twins' 1e-5 is a CPU bound)."""

BF16_TRACK_REL = 0.02
"""bf16 run-and-track: each step's loss within 2% of the same run in fp32."""

_REF = type(C.rank)


def rank_device() -> torch.device:
    """The default group's device; on a GPU, TF32 off (the fp32 bounds are for full fp32), and
    cuBLAS's workspace fixed so that the cases that resume bit for bit can ask for
    deterministic kernels (it must be set before the first cuBLAS call: setup runs first)."""
    device = comm.group_device()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return device


def patch(module: types.ModuleType, **values) -> None:
    """Set module attributes that already exist (a typo would silently add a new one)."""
    for name, value in values.items():
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name!r} to replace")
        setattr(module, name, value)


def built_on(fn: Callable, device: torch.device) -> Callable:
    """fn (a builder with a `device` parameter) called with device=`device`, whatever device its
    caller named (the twins name "cpu")."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def build(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["device"] = device
        return fn(*bound.args, **bound.kwargs)

    return build


def drawn_then_moved(fn: Callable, device: torch.device) -> Callable:
    """fn run as the twin runs it (its CPU generator, its values, on the CPU even inside a
    reference run under another default device), its tensor or tuple of tensors moved to
    `device`."""

    @functools.wraps(fn)
    def draw(*args, **kwargs):
        with torch.device("cpu"):
            out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out.to(device)
        return tuple(t.to(device) for t in out)

    return draw


def under_default_device(fn: Callable, device: torch.device) -> Callable:
    """fn with `device` the default device while it runs (a twin's reference that sums into a
    fresh `torch.zeros(())`); only there, not in the code under test."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.device(device):
            return fn(*args, **kwargs)

    return run


class TorchDrawingOnCpu(types.ModuleType):
    """torch, except that `randn` and `randint` draw on the CPU (with the caller's CPU
    generator, so the values are the twin's) and return the draw on `device`."""

    def __init__(self, device: torch.device):
        super().__init__("torch")
        self._device = device

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def randn(self, *args, **kwargs) -> torch.Tensor:
        return torch.randn(*args, **kwargs).to(self._device)

    def randint(self, *args, **kwargs) -> torch.Tensor:
        return torch.randint(*args, **kwargs).to(self._device)


def deterministic(fn: Callable, *args, **kwargs):
    """A case that asserts bit-identical losses across a resume, run with torch's deterministic
    kernels: on a GPU, kernels that accumulate with atomics (attention's backward among them)
    may round differently from one call to the next, which no checkpoint can restore. Only
    while the case runs; warn_only: an op without a deterministic variant warns, not fails."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.use_deterministic_algorithms(False)


def _renamed(value, refs: dict[str, str]):
    if isinstance(value, _REF) and value.name in refs:
        return getattr(C, refs[value.name])
    if isinstance(value, tuple):
        return tuple(_renamed(v, refs) for v in value)
    if isinstance(value, dict):
        return {k: _renamed(v, refs) for k, v in value.items()}
    return value


def adopt(suite: DistSuite, twin: DistSuite, name: str, world: int, *, prefix: str | None,
          timeout: float, refs: dict[str, str] | None = None, wrap: Callable | None = None,
          requires: str | None = None, **kwargs) -> None:
    """Register the twin's case `name` (its function and arguments as the twin registered them)
    on `suite` as `prefix-name` (`name` when prefix is None) at `world`. refs: setup names
    renamed where two twins use one name for different dims; wrap: a case wrapper
    (`deterministic`); requires: replaces the twin's; kwargs: added to or replacing the twin's
    keyword arguments."""
    case = twin.cases[name]
    args, extra = _renamed(case.args, refs or {}), _renamed(case.kwargs, refs or {})
    fn, args = (case.fn, args) if wrap is None else (wrap, (case.fn, *args))
    suite.case(f"{prefix}-{name}" if prefix else name, fn, *args, worlds=(world,), timeout=timeout,
               requires=requires or case.requires, **{**extra, **kwargs})


def assert_bf16_tracks(bf16: dict, fp32: dict, what: str) -> None:
    """Two training runs' histories: the bf16 one really ran in bf16, trained (its last loss
    below its first), and each step's loss is within BF16_TRACK_REL of the fp32 run's."""
    model = bf16["model"]
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16}, f"{what}: the bf16 run's parameters are {dtypes}"
    assert len(bf16["losses"]) == len(fp32["losses"]) > 1, what
    assert bf16["losses"][-1] < bf16["losses"][0], (what, bf16["losses"])
    for step, (low, full) in enumerate(zip(bf16["losses"], fp32["losses"], strict=True)):
        assert abs(low - full) <= BF16_TRACK_REL * abs(full), (what, step, low, full)
