"""Who waits for whom: the ranks' compact timelines of one profiled step side by side
(`bench_zero.py --profile --trace-dir DIR` writes them; `timeline.compact_trace`).

    python benchmarks/rank_skew.py DIR CONFIG [--collectives 40]

Per rank: the host's time per unit in forward and backward (between successive `_BeforeBackward`
forward / backward calls: the hooks ZeRO-3 threads through each unit), the GPU's idle time and
compute time in the step. Then per collective, in issue order: when each rank's host issued it,
when its kernel started on each GPU and how long it ran. A collective's kernel runs until the
last rank's arrives, so the rank whose kernels are short and start right at issue is the one the
others wait for; if its GPU also idles, its host is the step's bottleneck.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import _busy, _union  # noqa: E402


def load(directory: str, config: str) -> list[dict]:
    ranks = []
    while os.path.exists(path := os.path.join(directory, f"{config}_rank{len(ranks)}.json.gz")):
        with gzip.open(path, "rt") as f:
            ranks.append(json.load(f))
    if not ranks:
        raise SystemExit(f"no {config}_rank0.json.gz in {directory}")
    return ranks


def busy(intervals: list[tuple[float, float]]) -> float:
    """Time covered by the union of `intervals`."""
    return _busy(_union(intervals))


def median_gap(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) / 1e3 if gaps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("config", help="the file prefix, e.g. zero3 or zero++_x4")
    parser.add_argument("--collectives", type=int, default=40, help="rows of the table")
    args = parser.parse_args()
    ranks = load(args.directory, args.config)
    origin = min(min(k[2] for k in rank["gpu"]) for rank in ranks)
    for index, rank in enumerate(ranks):
        forward = sorted(op[1] for op in rank["ops"] if op[0] == "_BeforeBackward")
        backward = sorted(op[1] for op in rank["ops"] if op[0] == "_BeforeBackwardBackward")
        everything = [(k[2], k[2] + k[3]) for k in rank["gpu"]]
        compute = [(k[2], k[2] + k[3]) for k in rank["gpu"] if "nccl" not in k[0].lower()]
        span = max(e for _, e in everything) - min(s for s, _ in everything)
        print(f"rank {index}: host per unit: forward {median_gap(forward):.2f} ms, backward "
              f"{median_gap(backward):.2f} ms; GPU: span {span / 1e3:.1f} ms, idle "
              f"{(span - busy(everything)) / 1e3:.1f}, compute {busy(compute) / 1e3:.1f}")
    kernels = [sorted((k for k in rank["gpu"] if "nccl" in k[0].lower()), key=lambda k: k[2])
               for rank in ranks]
    issued = [sorted((op for op in rank["ops"] if op[0].startswith("c10d::")),
                     key=lambda op: op[1]) for rank in ranks]
    count = min(min(map(len, kernels)), min(map(len, issued)), args.collectives)
    width = 8 * len(ranks)
    print(f"\n{'#':>3} {'collective':<22} {'host issue, ms':<{width}} {'GPU start, ms':<{width}} "
          f"{'kernel ms':<{width}}")
    for i in range(count):
        name = issued[0][i][0].removeprefix("c10d::")[:22]
        cells = [[(issued[r][i][1] - origin) / 1e3 for r in range(len(ranks))],
                 [(kernels[r][i][2] - origin) / 1e3 for r in range(len(ranks))],
                 [kernels[r][i][3] / 1e3 for r in range(len(ranks))]]
        print(f"{i:>3} {name:<22} " + " ".join(
            "".join(f"{value:8.2f}" for value in column) for column in cells))


if __name__ == "__main__":
    main()
