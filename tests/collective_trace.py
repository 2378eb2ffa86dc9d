"""Records the collectives a training step issues, to compare data-parallel engines' protocols.

`CollectiveTrace` wraps every collective function of `megadomino.distributed.comm`, the one
module through which the package calls torch.distributed (and every name megadomino's modules
bound to one with `from ... import`), and records, while a `Timers` phase
(data / forward / backward / optimizer) is open: the phase, how many parameter gradients had
arrived in this phase (post-accumulate-grad hooks run so far: the collective's place in the
backward), the op, the group's ranks, the reduce op, and the dtype and element count of every
tensor argument. Outside a phase (set-up, checkpoints, log lines) nothing is recorded.

The trace is the protocol: two engines with equal traces issue the same collectives, on the same
groups, with the same bytes, in the same order against the backward.

`python tests/collective_trace.py --write [KIND ...]` rewrites tests/fixtures/collective_trace.json
(the traces of KIND, default all of CONFIGS) from the code as it is (only when a change of
protocol is intended, or a configuration is added: say so in the commit).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

EXPECTED = Path(__file__).parent / "fixtures" / "collective_trace.json"
OPS = ("all_reduce", "all_gather", "all_gather_single", "reduce_scatter_single",
       "all_to_all_single", "broadcast", "barrier", "all_gather_object", "broadcast_object")


def _describe(value) -> list:
    if isinstance(value, torch.Tensor):
        return [[str(value.dtype).removeprefix("torch."), value.numel()]]
    if isinstance(value, (list, tuple)):
        return [item for element in value for item in _describe(element)]
    return []


class CollectiveTrace:
    """Install with `with CollectiveTrace() as trace:`; `trace.events` is the list of records."""

    def __init__(self):
        self.events: list[list] = []
        self.phase: str | None = None
        self.arrived = 0
        self._undo: list = []

    def __enter__(self) -> CollectiveTrace:
        from megadomino.distributed import comm

        originals = {getattr(comm, name): name for name in OPS}
        wrappers = {fn: self._wrap(name, fn) for fn, name in originals.items()}
        for module in [m for n, m in list(sys.modules.items())
                       if n.startswith("megadomino") and m is not None]:
            for attr, value in list(vars(module).items()):
                if callable(value) and value in wrappers:
                    self._patch(module, attr, wrappers[value])
        from megadomino.train.timers import Timers
        self._patch(Timers, "__call__", self._phase(Timers.__call__))
        self._patch(torch.Tensor, "register_post_accumulate_grad_hook",
                    self._counting(torch.Tensor.register_post_accumulate_grad_hook))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, value in reversed(self._undo):
            setattr(owner, attr, value)

    def _patch(self, owner, attr: str, value) -> None:
        self._undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def _wrap(self, name: str, fn):
        def recorded(*args, **kwargs):
            if self.phase is not None:
                group = kwargs.get("group")
                ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
                op = kwargs.get("op", dist.ReduceOp.SUM if "reduce" in name else None)
                self.events.append([self.phase, self.arrived, name.replace("_single", ""), ranks,
                                    None if op is None else str(op).rsplit(".", 1)[-1],
                                    _describe(list(args) + [v for k, v in kwargs.items()
                                                            if k != "group"])])
            return fn(*args, **kwargs)
        return recorded

    def _phase(self, call):
        trace = self

        @contextlib.contextmanager
        def phase(timers, name: str):
            previous, trace.phase, trace.arrived = trace.phase, name, 0
            try:
                with call(timers, name):
                    yield
            finally:
                trace.phase = previous
        return phase

    def _counting(self, register):
        trace = self

        def counting(tensor, hook):
            def counted(param):
                trace.arrived += 1
                return hook(param)
            return register(tensor, counted)
        return counting


CONFIGS = {
    "plain": ["--ddp-bucket-size", "700"],
    "zero1": ["--zero-stage", "1", "--zero-unit-params", "700"],
    "zero3": ["--zero-stage", "3", "--zero-layers-per-unit", "1"],
    "domino": ["--ddp-bucket-size", "700", "--micro-batch-size", "2", "--global-batch-size",
               "8", "--domino-batch-slices", "2", "--domino-hidden-slices", "2"],
}
"""The configurations traced, as pretrain_gpt.py flags after BASE: the data-parallel engines,
and Domino's schedule (N=2 batch slices x K=2 hidden slices, whose TP collectives are its
protocol)."""

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "101",
        "--make-vocab-size-divisible-by", "1", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--mock-data", "--micro-batch-size", "1", "--global-batch-size",
        "4", "--train-iters", "2", "--lr", "1e-2", "--log-interval", "100", "--eval-iters",
        "0"]
"""TP=2 x DP=2 (run on 4 ranks), sequence parallel, 2 micro-batches a step, 2 steps; buckets
and units small enough that each engine launches several reductions during the backward."""


def record(kind: str) -> list[list]:
    """This rank's trace of `train` with CONFIGS[kind] (call in a 4-rank gloo world)."""
    from megadomino.cli.arguments import parse_args
    from megadomino.distributed import ParallelDims
    from megadomino.train.loop import train

    config, _ = parse_args([*BASE, *CONFIGS[kind]], "gpt")
    dims = ParallelDims(tp=2)
    with CollectiveTrace() as trace:
        train(config, dims, "gpt", log=lambda line: None)
    return trace.events


def _write_case(out_dir: str, rank: int, kinds: list[str]) -> None:
    traces = {kind: record(kind) for kind in kinds}
    Path(out_dir, f"trace{rank}.json").write_text(json.dumps(traces))


if __name__ == "__main__":
    import tempfile

    from dist_utils import C, DistSuite, check_result, run_world

    if sys.argv[1:2] != ["--write"] or not set(sys.argv[2:]) <= set(CONFIGS):
        sys.exit(f"usage: python tests/collective_trace.py --write [{' | '.join(CONFIGS)} ...]")
    kinds = sys.argv[2:] or list(CONFIGS)
    with tempfile.TemporaryDirectory() as out:
        suite = DistSuite(worlds=(4,))
        suite.case("write", _write_case, out, C.rank, kinds, timeout=600)
        check_result(run_world(suite, 4), "write")
        ranks = [json.loads(Path(out, f"trace{r}.json").read_text()) for r in range(4)]
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}
    expected.update({kind: {str(r): ranks[r][kind] for r in range(4)} for kind in kinds})
    EXPECTED.write_text(json.dumps(expected, indent=0) + "\n")
    print(f"wrote {EXPECTED}: " + ", ".join(f"{k} {len(v['0'])} collectives on rank 0"
                                             for k, v in expected.items()))
