"""Kernel-timeline summaries and CUDA-graph capture shared by the GPU benchmarks.

`profile_summary(step)` profiles one call of `step()` and says how busy the GPU was: compute
kernels, NCCL kernels, memcpy (copy engines), their overlap, the idle time inside the step's
span, and the top kernels by total time. `graphed(step)` captures `step()` (forward + backward,
gradients accumulated into buffers that already exist) in a CUDA graph and returns its replay,
so that a step's host time drops out of its device time. `python3 benchmarks/timeline.py TRACE`
sums a Chrome trace's GPU kernels (e.g. pretrain_gpt.py --profile --use-pytorch-profiler) by kind
(`kernel_kinds`: GEMM, attention, optimizer, loss, norm, ...) to say where a step's time goes,
and its idle time by gap length (`idle_gaps`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def _union(intervals: list[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _busy(spans: list[list[float]]) -> float:
    return sum(end - start for start, end in spans)


def _overlap(a: list[list[float]], b: list[list[float]]) -> float:
    total = 0.0
    for start, end in a:
        for b_start, b_end in b:
            total += max(0.0, min(end, b_end) - max(start, b_start))
    return total


def profile_summary(step: Callable[[], object], top: int = 12, host: bool = False,
                    trace: str | None = None) -> dict:
    """One profiled step: busy ms of compute kernels, NCCL kernels and memcpy, NCCL under
    compute, GPU idle inside the span, how many kernels, copies and sets ran (`gpu_events`), and
    the `top` kernels by total ms ([ms, count]).
    host=True also records the CPU side and adds the `top` host ops by self time
    (`top_host_ops`: [self ms, count]; CUDA runtime calls such as cudaStreamSynchronize or
    cudaMalloc appear there), to find what keeps the GPU idle."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if host else [])
    with profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    if trace:
        compact_trace(prof, trace)
    host_ops = {}
    if host:
        for event in prof.key_averages():
            if event.self_cpu_time_total > 0:
                host_ops[event.key[:70]] = [round(event.self_cpu_time_total / 1e3, 3),
                                            event.count]
        host_ops = dict(sorted(host_ops.items(), key=lambda item: -item[1][0])[:top])
    comm, compute, copies, by_name = [], [], [], {}
    for event in prof.events():
        if event.device_type.name != "CUDA" or event.time_range.elapsed_us() <= 0:
            continue
        interval = (event.time_range.start, event.time_range.end)
        name = event.name.lower()
        if "nccl" in name:
            comm.append(interval)
        elif "memcpy" in name or "memset" in name:
            copies.append(interval)
        else:
            compute.append(interval)
        total, count = by_name.get(event.name[:70], (0.0, 0))
        by_name[event.name[:70]] = (total + event.time_range.elapsed_us() / 1e3, count + 1)
    comm_u, compute_u, copies_u = _union(comm), _union(compute), _union(copies)
    everything = _union(comm + compute + copies)
    span = (everything[-1][1] - everything[0][0]) if everything else 0.0
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"span_ms": span / 1e3, "compute_busy_ms": _busy(compute_u) / 1e3,
            "nccl_busy_ms": _busy(comm_u) / 1e3, "memcpy_busy_ms": _busy(copies_u) / 1e3,
            "nccl_under_compute_ms": _overlap(comm_u, compute_u) / 1e3,
            "gpu_idle_ms": (span - _busy(everything)) / 1e3,
            "gpu_events": len(comm) + len(compute) + len(copies),
            "top_kernels": {name: [round(ms, 3), n] for name, (ms, n) in ranked},
            **({"top_host_ops": host_ops} if host else {})}


def compact_trace(prof, path: str) -> None:
    """Write `prof`'s timeline, small enough to carry back from the GPU machine, as gzipped JSON:
    every GPU kernel / memcpy / memset (`gpu`: [name, stream, start us, duration us,
    correlation]), the launches of NCCL kernels, stream waits and synchronizations (`launch`:
    [runtime call, start us, duration us, correlation]) and the collectives' host ops (`ops`:
    [name, start us, duration us]). Times are the profiler's host clock, comparable across the
    processes of one machine; ranks' files side by side show who waits for whom."""
    import gzip
    import json
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as f:
            events = json.load(f).get("traceEvents", [])
    gpu, launch, ops, nccl_correlations = [], [], [], set()
    for event in events:
        category, name = event.get("cat", ""), event.get("name", "")
        correlation = event.get("args", {}).get("correlation")
        if category in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append([name[:60], event.get("tid"), event["ts"], event.get("dur", 0),
                        correlation])
            if "nccl" in name.lower():
                nccl_correlations.add(correlation)
        elif category == "cpu_op" and (name.startswith("nccl:") or "c10d" in name
                                       or name.startswith("_BeforeBackward")):
            ops.append([name[:60], event["ts"], event.get("dur", 0)])
        elif category == "cuda_runtime":
            launch.append([name, event["ts"], event.get("dur", 0), correlation])
    launch = [row for row in launch if row[3] in nccl_correlations
              or "Wait" in row[0] or "Synchronize" in row[0]]
    with gzip.open(path, "wt") as f:
        json.dump({"gpu": gpu, "launch": launch, "ops": ops}, f)


def median_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` on the current CUDA stream (CUDA events, each call
    timed alone after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def queued_ms(fn: Callable[[int], object], calls: int = 20, iters: int = 15,
              warmup: int = 3) -> float:
    """Median over `iters` of the mean milliseconds of `calls` calls fn(0) .. fn(calls - 1),
    queued behind a spin of the GPU (about 10 ms) so that the host has enqueued them all before
    the first runs: the GPU's time, not the host's (a compiled call's guards, or a launcher's
    Python, can take longer than its kernels)."""
    for i in range(warmup):
        fn(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def graphed(step: Callable[[], object], warmup: int = 3) -> Callable[[], None]:
    """Capture `step()` in a CUDA graph after `warmup` eager calls on a side stream (which also
    create every gradient buffer, so that the captured backward accumulates into them in place;
    `step` must not set gradients to None). Returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph.replay


KERNEL_KINDS = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "attention", "mem_eff")),
                ("gemm", ("gemm", "nvjet", "sm90_xmma", "cutlass", "cublas", "scaled_mm")),
                ("optimizer", ("adam", "multi_tensor", "foreach")),
                ("loss", ("softmax", "nll", "cross_entropy", "logsumexp")),
                ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm")),
                ("compiled", ("triton",)), ("dropout", ("dropout", "bernoulli", "philox")),
                ("memcpy", ("memcpy", "memset")),
                ("reduce", ("reduce",)), ("elementwise", ("elementwise", "vectorized", "copy")))
"""A kernel's kind: the first whose patterns appear in its lower-cased name (else "other")."""


def kernel_kinds(path: str, top: int = 25) -> dict:
    """GPU time of a Chrome trace by kernel kind (KERNEL_KINDS), its span (first kernel start to
    last end), the GPU idle time inside it, the `top` kernels by total ms ([ms, count, kind]) and
    the `top` host ops that launched them (the innermost op, matched by the profiler's
    "External id": [GPU ms, kernels]), and the 2 x `top` (op, kernel) pairs."""
    import gzip
    import json
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kinds: dict[str, float] = {}
    by_name: dict[str, list] = {}
    by_op: dict[str, list] = {}
    by_pair: dict[str, list] = {}
    spans = []
    ops = {event["args"]["External id"]: event["name"] for event in events
           if event.get("cat") == "cpu_op" and "External id" in event.get("args", {})}
    for event in events:
        if event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, duration = event.get("name", ""), event.get("dur", 0) / 1e3
        spans.append((event["ts"], event["ts"] + event.get("dur", 0)))
        lowered = name.lower()
        kind = next((k for k, patterns in KERNEL_KINDS if any(p in lowered for p in patterns)),
                    "other")
        kinds[kind] = kinds.get(kind, 0.0) + duration
        row = by_name.setdefault(name[:90], [0.0, 0, kind])
        row[0] += duration
        row[1] += 1
        op = ops.get(event.get("args", {}).get("External id"), "?")
        row = by_op.setdefault(op[:90], [0.0, 0])
        row[0] += duration
        row[1] += 1
        row = by_pair.setdefault(f"{op[:40]} | {name[:70]}", [0.0, 0])
        row[0] += duration
        row[1] += 1
    merged = _union(spans)
    span = (merged[-1][1] - merged[0][0]) / 1e3 if merged else 0.0
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    return {"span_ms": span, "gpu_busy_ms": _busy(merged) / 1e3,
            "gpu_idle_ms": span - _busy(merged) / 1e3, "gaps": idle_gaps(events, ops),
            "kinds_ms": dict(sorted(((k, round(v, 3)) for k, v in kinds.items()),
                                    key=lambda item: -item[1])),
            "top_kernels": {name: [round(ms, 3), n, kind] for name, (ms, n, kind) in ranked},
            "top_ops": {name: [round(ms, 3), n] for name, (ms, n)
                        in sorted(by_op.items(), key=lambda item: -item[1][0])[:top]},
            "top_op_kernels": {name: [round(ms, 3), n] for name, (ms, n)
                               in sorted(by_pair.items(), key=lambda item: -item[1][0])[:2 * top]}}


GAP_BUCKETS_US = (2, 10, 100, 1000)


def idle_gaps(events: list[dict], ops: dict, top: int = 12) -> dict:
    """The GPU's idle time inside the span by gap length (`by_us`: [count, total ms] of the gaps
    up to 2 us, 2-10, 10-100, 100-1000 and over 1000 us: many short gaps are the launch
    pipeline's between back-to-back kernels, a few long ones the host or a synchronization)
    and the `top` longest gaps ([ms, ms into the span, the op of the kernel before, the op of
    the kernel after])."""
    kernels = sorted((event["ts"], event["ts"] + event.get("dur", 0), ops.get(
        event.get("args", {}).get("External id"), event.get("name", "?"))[:50])
        for event in events if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not kernels:
        return {}
    labels = [f"<={GAP_BUCKETS_US[0]}"] + [f"{a}-{b}" for a, b in zip(GAP_BUCKETS_US,
                                                                       GAP_BUCKETS_US[1:])]
    labels.append(f">{GAP_BUCKETS_US[-1]}")
    by_us = {label: [0, 0.0] for label in labels}
    longest, end, before = [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        gap = start - end
        if gap > 0:
            bucket = labels[sum(gap > edge for edge in GAP_BUCKETS_US)]
            by_us[bucket][0] += 1
            by_us[bucket][1] += gap / 1e3
            longest.append([round(gap / 1e3, 3), round((start - kernels[0][0]) / 1e3, 2),
                            before, name])
        if stop > end:
            end, before = stop, name
    return {"by_us": {k: [n, round(ms, 3)] for k, (n, ms) in by_us.items()},
            "longest": sorted(longest, reverse=True)[:top]}


if __name__ == "__main__":
    import json
    import sys
    for trace_path in sys.argv[1:]:
        print(json.dumps({"trace": trace_path, **kernel_kinds(trace_path)}, indent=1))
