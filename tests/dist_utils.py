"""Multi-process test cases: each case is registered once, every spawned world is bounded in time.

Starting ranks costs seconds, so a module registers its cases on one `DistSuite`, which starts
one process group per world size and runs every case of that world in every rank, in
registration order (so the ranks' collectives stay matched). Each case's name is written once:

    SUITE = DistSuite(worlds=(2, 4))

    @SUITE.setup
    def _setup(world: int) -> dict:            # runs in every rank, once per world
        return {"dims": ParallelDims(tp=world)}

    for sp in (False, True):
        SUITE.case(f"model-sp{sp}", check_model, C.dims, sp)   # C.dims: setup's "dims"

    test_model = SUITE.test()                  # one pytest test per (world, case)

`C.<name>` in a case's arguments stands for the setup's value of that name in the rank (`C.rank`
and `C.world` always exist). A case may also name `slow_worlds`: world sizes at which it runs only
in the slow tier, for a grid whose every code path already has a representative at that world in
the default tier; a run without the slow tier leaves them out of the world it starts.
`SUITE.test()` freezes the suite; `tests/conftest.py` refuses, at collection, a module whose
suite was never turned into a test, so no case runs unasserted.

Bounded in time: every case has a budget (`timeout`, seconds), and so have set-up and teardown.
A rank arms `faulthandler` for it, so a deadlocked case dumps every rank's stack and ends the
world. The pytest process watches too: a case that a rank entered more than its budget plus
`grace` seconds ago (a rank stuck where faulthandler cannot end it, say inside a CUDA driver
call) makes it kill the world, and every case of that world left unfinished fails with a line
naming the case that overran and the ranks still in it. The failure names the case, the rank
and the stacks. A crash in setup (an exception, or a rank that dies) fails every case with the
traceback or the rank's last output.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

DEFAULT_CASE_TIMEOUT = 180.0  # seconds; the slowest CPU case today takes about 40 s
SPAWN_GRACE = 60.0  # seconds a world may spend importing torch and forming its group
CASE_GRACE = 30.0  # seconds past a case's budget before the parent ends its world
LOG_TAIL = 4000  # characters of a dead rank's output shown in a failure
BOTH = frozenset({"main", "slow"})  # a world's cases outside and inside their slow_worlds


def tier(variant: str, default_variant: str, world: int) -> dict:
    """`SUITE.case` keywords: at `world` in the default tier for `default_variant` (say a model
    family), in the slow tier for the others, whose code paths the default one shares."""
    return {"worlds": (world,)} if variant == default_variant else {"worlds": (),
                                                                     "slow_worlds": (world,)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class _Ref:
    """A placeholder for the rank's setup value `name` (None: the whole setup object)."""

    name: str | None

    def resolve(self, context, rank: int, world: int):
        if self.name is None:
            return context
        if self.name == "rank":
            return rank
        if self.name == "world":
            return world
        if isinstance(context, dict):
            return context[self.name]
        return getattr(context, self.name)


class _Context:
    """`C.name` -> a placeholder for the setup's `name`; `C.all` -> the whole setup object."""

    def __getattr__(self, name: str) -> _Ref:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Ref(None if name == "all" else name)


C = _Context()


def _resolve(value, context, rank: int, world: int):
    if isinstance(value, _Ref):
        return value.resolve(context, rank, world)
    if isinstance(value, tuple):
        return tuple(_resolve(v, context, rank, world) for v in value)
    if isinstance(value, list):
        return [_resolve(v, context, rank, world) for v in value]
    if isinstance(value, dict):
        return {k: _resolve(v, context, rank, world) for k, v in value.items()}
    return value


@dataclass
class _Case:
    name: str
    fn: Callable
    args: tuple
    kwargs: dict
    worlds: tuple[int, ...]
    timeout: float
    requires: str | None = None
    slow_worlds: tuple[int, ...] = ()

    def available(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


@dataclass
class DistSuite:
    """The distributed cases of one test module (see the module docstring).

    worlds: the world sizes every case runs at unless it names its own; backend: "gloo" (CPU)
    or "nccl" (one GPU a rank; such suites are the `gpu` tier and skip without enough GPUs)."""

    worlds: tuple[int, ...] = (2,)
    backend: str = "gloo"
    timeout: float = DEFAULT_CASE_TIMEOUT
    grace: float = CASE_GRACE
    cases: dict[str, _Case] = field(default_factory=dict)
    frozen: bool = False
    _setup: Callable | None = None
    _results: dict = field(default_factory=dict)
    home: str = ""  # the module that made the suite (conftest checks it is asserted there)

    def __post_init__(self) -> None:
        self.home = self.home or sys._getframe(2).f_globals.get("__name__", "")

    def __getstate__(self) -> dict:
        # what a spawned rank needs: the cases and setup, not the results remembered here
        return {**self.__dict__, "_results": {}}

    def setup(self, fn: Callable) -> Callable:
        """Decorator: fn(world, *args) runs once per rank before the cases; its return value is
        what `C.<name>` refers to (a dict or an object with attributes)."""
        self._setup = fn
        return fn

    def case(self, name: str, fn: Callable, *args, worlds: tuple[int, ...] | None = None,
             timeout: float | None = None, requires: str | None = None,
             slow_worlds: tuple[int, ...] = (), **kwargs) -> None:
        """Register fn(*args, **kwargs) as case `name` (C.<name> arguments resolved in the rank).
        It passes in a rank when it returns, and fails when it raises on any rank. requires: a
        module the case needs; without it the case is skipped (and not run in the ranks).
        slow_worlds: further world sizes at which the case runs in the slow tier only (with
        `worlds=()`, a case of the slow tier alone)."""
        if self.frozen:
            raise RuntimeError(f"case {name!r} registered after the suite's test() was made")
        if name in self.cases:
            raise ValueError(f"case {name!r} is registered twice")
        case_worlds = tuple(self.worlds if worlds is None else worlds)
        if set(slow_worlds) & set(case_worlds):
            raise ValueError(f"case {name!r}: worlds {case_worlds} and slow_worlds "
                             f"{tuple(slow_worlds)} overlap")
        self.cases[name] = _Case(name, fn, args, kwargs, case_worlds + tuple(slow_worlds),
                                 timeout or self.timeout, requires, tuple(slow_worlds))

    def derived(self, *, backend: str, setup: Callable,
                worlds: tuple[int, ...] | None) -> DistSuite:
        """A suite of the same cases (same names, functions and arguments) on another backend,
        with its own setup (e.g. moving the cases' tensors to the rank's GPU) and world sizes
        (None: each case at its own)."""
        suite = DistSuite(worlds=worlds or self.worlds, backend=backend, timeout=self.timeout,
                          home=sys._getframe(1).f_globals.get("__name__", ""))
        suite.setup(setup)
        for case in self.cases.values():
            suite.cases[case.name] = _Case(case.name, case.fn, case.args, case.kwargs,
                                           case.worlds if worlds is None else worlds,
                                           case.timeout, case.requires)
        return suite

    def names(self, world: int, parts: frozenset[str] = BOTH,
              only: frozenset[str] | None = None) -> list[str]:
        """The cases of `world` in `parts` ("main": those not in its slow_worlds, "slow": those
        in), including those skipped for a missing module (their tests skip before asking for
        results); `only`: of these, those named (the cases the pytest run selected)."""
        return [case.name for case in self.cases.values() if world in case.worlds
                and ("slow" if world in case.slow_worlds else "main") in parts
                and (only is None or case.name in only)]

    def test(self, args_fixture: str | None = None, marks: tuple = ()) -> Callable:
        """The pytest test for every registered (world, case): assign it to a `test_*` name.
        args_fixture: a fixture whose value (a tuple) is passed to setup after the world;
        marks: pytest marks for it (e.g. a tier)."""
        self.frozen = True
        params = [pytest.param(world, name, id=f"w{world}-{name}",
                               marks=[pytest.mark.slow] if world in case.slow_worlds else [])
                  for world in sorted({w for c in self.cases.values() for w in c.worlds})
                  for name in self.names(world) for case in (self.cases[name],)]
        suite = self

        def test(request, world: int, case: str) -> None:
            suite.skip_without_devices(world)
            if not suite.cases[case].available():
                pytest.skip(f"needs {suite.cases[case].requires}, which is not installed")
            args = request.getfixturevalue(args_fixture) if args_fixture else ()
            # a run without the slow tier leaves the world's slow cases out
            chosen = getattr(request.config, "chosen_tiers", {"slow"})
            parts = BOTH if "slow" in chosen else frozenset({"main"})
            # a world runs the cases selected (-k, node ids), so a long world can be split
            only = frozenset(item.callspec.params["case"] for item in request.session.items
                             if getattr(item.function, "dist_suite", None) is suite
                             and item.callspec.params["world"] == world)
            check_result(suite.results(world, *args, parts=parts, only=only or None), case)

        test.dist_suite = self  # what conftest's collection check looks for
        marks = [*marks, *([pytest.mark.gpu] if self.backend == "nccl" else [])]
        decorated = pytest.mark.parametrize("world, case", params)(test)
        for mark in marks:
            decorated = mark(decorated)
        return decorated

    def skip_without_devices(self, world: int) -> None:
        if self.backend == "nccl" and torch.cuda.device_count() < world:
            plural = "s" if world > 1 else ""
            pytest.skip(f"tier gpu: needs {world} CUDA GPU{plural}, "
                        f"{torch.cuda.device_count()} here")

    def results(self, world: int, *args, parts: frozenset[str] = BOTH,
                only: frozenset[str] | None = None) -> dict[str, str | None]:
        """{case: None or the error} for every case of `world` in `parts` (and `only`, see
        `names`), run once per (world, args, parts, only) and remembered, failures included."""
        key = (world, parts, only, *(id(arg) for arg in args))
        if key not in self._results:
            self._results[key] = run_world(self, world, args, parts, only)
        return self._results[key]


def _rank_main(rank: int, world: int, port: int, suite: DistSuite, args: tuple,
               names: list[str], out_dir: str) -> None:
    """One rank: run setup, then each case of `names` under its faulthandler budget,
    appending {"case", "error"} lines to rank<r>.jsonl as it goes (so a crash loses nothing)."""
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)

    init = {}
    if suite.backend == "nccl":
        torch.cuda.set_device(rank)
        # Bound to its device, NCCL creates the world's communicator now and splits each new
        # group from it, instead of a lazy creation that waits for every member at a group's
        # first collective (a batch of P2P ops that names only some of them then hangs).
        init["device_id"] = torch.device("cuda", rank)
    results = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "w", buffering=1)  # noqa: SIM115

    def record(case: str, error: str | None) -> None:
        results.write(json.dumps({"case": case, "error": error}) + "\n")

    def under_budget(name: str, budget: float, fn: Callable, *fn_args, **fn_kwargs):
        print(f"--- {name}: started (budget {budget:g} s)", flush=True)
        faulthandler.dump_traceback_later(budget, exit=True, file=log)
        try:
            return fn(*fn_args, **fn_kwargs)
        finally:
            faulthandler.cancel_dump_traceback_later()

    context = None
    try:
        under_budget("<setup>", SPAWN_GRACE, _join, suite.backend, rank, world, port, init)
        if suite._setup is not None:
            context = under_budget("<setup>", suite.timeout, suite._setup, world, *args)
    except Exception:
        record("<setup>", traceback.format_exc())
        os._exit(3)  # a non-zero exit tells the parent to stop the ranks waiting on this one
    for case in (suite.cases[name] for name in names):
        try:
            under_budget(case.name, case.timeout, case.fn,
                         *_resolve(case.args, context, rank, world),
                         **_resolve(case.kwargs, context, rank, world))
            record(case.name, None)
        except Exception:
            record(case.name, traceback.format_exc())
    # A barrier is queued behind any collective a case left in flight (gloo runs them in order),
    # so the group is not torn down under a background thread still using it.
    under_budget("<teardown>", suite.timeout, _teardown, suite.backend)


def _join(backend: str, rank: int, world: int, port: int, init: dict) -> None:
    """Join the world through the store the parent serves on `port` (run_world says why)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **init)


def _teardown(backend: str) -> None:
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.synchronize()
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    dist.destroy_process_group()


def _read_rank(out_dir: str, rank: int) -> tuple[dict[str, str | None], str]:
    results: dict[str, str | None] = {}
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    if os.path.exists(path):
        with open(path) as file:
            for line in file:
                if line.endswith("\n"):
                    entry = json.loads(line)
                    results[entry["case"]] = entry["error"]
    log_path = os.path.join(out_dir, f"rank{rank}.log")
    log = open(log_path).read() if os.path.exists(log_path) else ""  # noqa: SIM115
    return results, log


def _running_case(log: str) -> str | None:
    started = [line for line in log.splitlines() if line.startswith("--- ")]
    return started[-1][4:].split(":")[0] if started else None


def _rank_starter(backend: str):
    """A gloo world's ranks start as forks of one server process that imported torch and the
    library once (a fresh interpreter per rank re-imports them, seconds of CPU each). The server
    only imports, never joins a group or runs a case, so each rank starts from the state of a
    fresh import, as a spawned one would. An NCCL world's ranks are spawned: nothing may have
    touched CUDA before a fork, and the GPU tier is not timed."""
    if backend == "nccl":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "dist_utils",
                                    "megadomino.train.loop"])
    return context


def run_world(suite: DistSuite, world: int, args: tuple = (), parts: frozenset[str] = BOTH,
              only: frozenset[str] | None = None) -> dict[str, str | None]:
    """Start `world` ranks of `suite` running its cases of that world in `parts` and `only` (see
    `DistSuite.names`), wait at most the sum of the budgets, and merge the ranks' results: a case
    fails if it failed on any rank, or did not finish on one (named, with why).

    The parent serves the world's store on a port the OS picks as it listens: a port found free
    and handed to rank 0 to bind could be taken in the seconds a spawned rank takes to start
    (another world's store, NCCL's sockets), failing the set-up with EADDRINUSE."""
    import torch.distributed as dist

    names = [name for name in suite.names(world, parts, only) if suite.cases[name].available()]
    deadline = SPAWN_GRACE + suite.timeout + sum(suite.cases[n].timeout for n in names)
    starter = _rank_starter(suite.backend)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out_dir:
        port = store.port
        procs = [starter.Process(target=_rank_main,
                                 args=(rank, world, port, suite, args, names, out_dir))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        progress = _Progress(suite, out_dir, world)
        killed = _wait(procs, progress.started + deadline, progress)
        ranks = [_read_rank(out_dir, rank) for rank in range(world)]
        progress.report(ranks, time.monotonic())
    del store
    errors: dict[str, list[str]] = {name: [] for name in names}
    for rank, (results, log) in enumerate(ranks):
        why_unfinished = _why_unfinished(rank, procs[rank].exitcode, log, killed)
        if "<setup>" in results:
            why_unfinished = f"setup failed on rank {rank}:\n{results['<setup>']}"
        for name in names:
            error = results[name] if name in results else why_unfinished
            if error is not None:
                errors[name].append(f"rank {rank}: {error}")
    # every rank's error: the one that stopped first is often not the one that failed first
    return {name: "\n".join(found) or None for name, found in errors.items()}


class _Progress:
    """Which case each rank is in, as the parent sees it: a rank's log gets a `--- name:
    started` line as it enters a case, its jsonl a result as it leaves it. A case whose first
    rank entered it more than its budget + CASE_GRACE ago has overrun, whatever the ranks are
    doing (a faulthandler that cannot end a rank stuck in a driver call, a hang in set-up or
    teardown): the parent then ends the world and names the case and the ranks still in it."""

    def __init__(self, suite: DistSuite, out_dir: str, world: int):
        self.suite, self.out_dir, self.world = suite, out_dir, world
        self.entered: dict[str, float] = {}  # case -> when the parent first saw a rank in it
        self.started = time.monotonic()
        self.done: set[str] = set()  # cases every rank has left, each reported once
        self.last_done = self.started

    def overrun(self, now: float) -> str | None:
        """None, or the line naming the case that overran and the ranks still in it. Reports on
        stderr each case every rank has left, with its wall time (seen with `pytest -s`: which
        case of a long world took the time)."""
        current, ranks = {}, [_read_rank(self.out_dir, rank) for rank in range(self.world)]
        self.report(ranks, now)
        for rank, (results, log) in enumerate(ranks):
            running = _running_case(log)
            if running is not None and running not in results:
                current[rank] = running
                self.entered.setdefault(running, now)
        for case in sorted(set(current.values()), key=self.entered.get):
            budget = (self.suite.cases[case].timeout if case in self.suite.cases
                      else SPAWN_GRACE if case == "<setup>" else self.suite.timeout)
            if now - self.entered[case] > budget + self.suite.grace:
                waiting = sorted(rank for rank, running in current.items() if running == case)
                elsewhere = {rank: running for rank, running in current.items()
                             if running != case}
                return (f"case {case!r} overran its budget of {budget:g} s (+{self.suite.grace:g} "
                        f"s grace); ranks still in it: {waiting}"
                        + (f"; other ranks in: {elsewhere}" if elsewhere else
                           "; the other ranks had left it"))
        return None

    def report(self, ranks: list[tuple[dict[str, str | None], str]], now: float) -> None:
        """Print each case every rank has left since the last call, passed or failed, with the
        seconds since the previous one left (the case's time, to the 1 s the parent polls)."""
        left = set.intersection(*(set(results) for results, _ in ranks)) - self.done
        order = list(self.suite.cases)
        for case in sorted(left, key=lambda name: order.index(name) if name in order else -1):
            failed = any(results[case] is not None for results, _ in ranks)
            print(f"world of {self.world} ({self.suite.backend}): {case} "
                  f"{'failed' if failed else 'passed'}, {now - self.last_done:.0f} s",
                  file=sys.stderr, flush=True)
            self.done.add(case)
            self.last_done = now


def _wait(procs: list, deadline: float, progress: _Progress) -> str | None:
    """Join the ranks; once one dies with an error, the others get 10 s (they are likely blocked
    in a collective with it) before being killed. Returns why the parent killed the world (the
    world's deadline, or a case that overran its budget), or None."""
    failed_at, killed, checked = None, None, 0.0
    while any(proc.is_alive() for proc in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now - checked >= 1.0:
            checked = now
            killed = progress.overrun(now)
        if now > deadline:
            killed = f"the world ran past its {deadline - progress.started:.0f} s deadline"
        if killed is not None or (failed_at is not None and now > failed_at + 10):
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join()
            return killed
        for proc in procs:
            proc.join(timeout=0.2)
    return None


def _why_unfinished(rank: int, exitcode: int | None, log: str, killed: str | None) -> str:
    running = _running_case(log)
    tail = log[-LOG_TAIL:]
    if "Timeout (" in log:  # faulthandler's dump_traceback_later header
        return (f"case {running!r} timed out on rank {rank} (its budget ran out); "
                f"the ranks' stacks:\n{tail}")
    if killed is not None:
        return (f"{killed}; killed the world while rank {rank} was in {running!r}. "
                f"rank {rank}'s output:\n{tail}")
    return (f"did not finish: rank {rank} exited with {exitcode} during {running!r}; "
            f"its output:\n{tail}")


def shared_copy(source: str | os.PathLike, target: str) -> str:
    """In a case: `source` copied to `target` by rank 0, seen by every rank on return."""
    import shutil

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(source, target)
    dist.barrier()
    return target


def check_result(results: dict[str, str | None], case: str) -> None:
    if case not in results:
        raise AssertionError(f"case {case!r} is not registered for this world; "
                             f"registered: {sorted(results)}")
    if results[case] is not None:
        raise AssertionError(results[case])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    """max |actual - expected| <= rel * max |expected| (a relative error over the whole tensor)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    scale = expected.abs().max().item()
    error = (actual.double() - expected.double()).abs().max().item()
    if not error <= rel * max(scale, 1e-30):
        raise AssertionError(f"{what}: max abs error {error:.3e} > {rel:g} x max |ref| {scale:.3e}")
