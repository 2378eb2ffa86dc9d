"""What benchmarks/bench_domino.py derives from its timings, and its tables (pure: no devices).
Run as a script, it prints the tables of one or more of its JSON files, e.g. one per link:

    python3 benchmarks/domino_report.py domino_nvlink.json domino_pcie.json [--json all.json]

Column names: `a_no_comm` the no-communication limit (plain TP's layers with every collective
skipped), `a_sp_no_comm` the same for the sequence-parallel layout, `b_plain_tp`, `b_plain_tp_sp`,
`c_megatron_core`, `d_deepspeed_domino`, `e_domino_N<n>_K<k>` (Domino's schedule, explicit
backward), `f_sp_comm_overlap` (SP with the collectives fused into the GEMMs).

Communication share of plain TP's layer time, two ways:
- `comm_share` (the one the tables show): (b_plain_tp - a_no_comm) / b_plain_tp per round, the
  median and range over rounds. It is what removing the collectives saves, which is what any
  overlap scheme can at most win back.
- `serial_comm_share`: four all-reduces of the layer's activation (two forward after the
  row-parallel linears, two backward for the column-parallel input gradients), each at the time
  the bandwidth probe measured alone for that size, over b_plain_tp's median. Higher than
  comm_share where the collectives run slower alone than beside the GEMMs' memory traffic
  allows, lower where they contend with them.
"""

from __future__ import annotations

import argparse
import json
import statistics

PLAN_PREFIX = "e_domino_"
AUTO_TOLERANCE = 1.02
"""Auto's choice counts as right when its measured time is within 2% of the best candidate's."""


def plan_column(n: int, k: int, runner: bool) -> str:
    """The bench column that times autotune's candidate (n, k, runner)."""
    return f"{PLAN_PREFIX}N{n}_K{k}" if runner else "b_plain_tp"


def spread(values: list[float]) -> dict:
    """{"median", "min", "max"} of one column's rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def comm_share(plain: list[float], limit: list[float]) -> dict | None:
    """(plain - limit) / plain round by round (the two columns of a round run back to back):
    median and range. None unless both columns have every round."""
    if not plain or len(plain) != len(limit):
        return None
    return spread([(b - a) / b for b, a in zip(plain, limit)])


def serial_comm_share(allreduce_ms: float | None, plain_ms: float | None,
                      collectives: int = 4) -> float | None:
    """`collectives` all-reduces at `allreduce_ms` each, over plain TP's ms per layer."""
    if not allreduce_ms or not plain_ms:
        return None
    return collectives * allreduce_ms / plain_ms


def auto_vs_best(ms: dict[str, float], plans: list, choice: int) -> dict:
    """Auto's choice (plans[choice], autotune's (n, k, runner)) against the fastest of the same
    candidates as the bench measured them. Candidates the bench did not run are listed, and the
    best is taken over the others."""
    columns = [plan_column(*plan) for plan in plans]
    measured = {column: ms[column] for column in columns if column in ms}
    chosen = columns[choice]
    result = {"choice": chosen, "missing": [c for c in columns if c not in measured]}
    if chosen not in measured:
        return result
    best = min(measured, key=measured.get)
    ratio = measured[chosen] / measured[best]
    result.update(best=best, ratio=ratio, within=ratio <= AUTO_TOLERANCE)
    return result


def finish_row(result: dict) -> None:
    """Fill a row's medians (`ms_per_layer`), ranges, best Domino plan, communication shares and,
    when auto was probed, its choice against the best measured candidate."""
    rounds = result["ms_rounds"]
    result["ms_per_layer"] = {name: statistics.median(v) for name, v in rounds.items()}
    result["ms_range"] = {name: [min(v), max(v)] for name, v in rounds.items()}
    result["host_ms_per_layer"] = {name: statistics.median(v)
                                   for name, v in result["host_rounds"].items()}
    ms = result["ms_per_layer"]
    domino = {name: v for name, v in ms.items() if name.startswith(PLAN_PREFIX)}
    if domino:
        result["best_domino"] = min(domino, key=domino.get)
    result["comm_share"] = comm_share(rounds.get("b_plain_tp", []), rounds.get("a_no_comm", []))
    full = result.get("collectives", {}).get(str(result.get("message_numel")), {})
    result["serial_comm_share"] = serial_comm_share(
        full.get("all_reduce", {}).get("ms"), ms.get("b_plain_tp"))
    if "auto" in result:
        result["auto"]["vs_best"] = auto_vs_best(ms, result["auto"]["plans"],
                                                 result["auto"]["choice"])


def _fmt(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value else "-"


def _ratio(p: float | None, q: float | None) -> str:
    return f"{p / q:.2f}" if p and q else "-"


def table(results: list[dict]) -> str:
    """(e) is the best Domino plan; (f) sequence parallelism with the GEMM-fused communication
    (`--comm-overlap`); ratios of each peer against our best of (e) and (f). (a') is the
    no-communication limit of the sequence-parallel layout (norms and residuals on s / tp rows;
    all-gathers become local repeats, reduce-scatters slices), the tighter limit for (f).
    Medians over the rounds."""
    lines = ["| row | TP | (a) limit | (a') SP limit | (b) plain TP | (c) mcore | (d) DS Domino "
             "| (e) best Domino | (f) SP + fused comm | ours best / a | f / a' | b / ours "
             "| c / ours | d / ours |",
             "|" + " --- |" * 14]
    for r in results:
        ms = r["ms_per_layer"]
        a, b = ms.get("a_no_comm"), ms.get("b_plain_tp")
        c, d = ms.get("c_megatron_core"), ms.get("d_deepspeed_domino")
        f = ms.get("f_sp_comm_overlap")
        a_sp = ms.get("a_sp_no_comm")
        best = r.get("best_domino")
        e = ms.get(best) if best else None
        ours = min(v for v in (e, f) if v) if (e or f) else None
        lines.append(f"| {r['row']} | {r['tp']} | {_fmt(a)} | {_fmt(a_sp)} | {_fmt(b)} | "
                     f"{_fmt(c)} | {_fmt(d)} | {_fmt(e)} ({best}) | {_fmt(f)} | "
                     f"{_ratio(ours, a)} | {_ratio(f, a_sp)} | {_ratio(b, ours)} | "
                     f"{_ratio(c, ours)} | {_ratio(d, ours)} |")
    return "\n".join(lines)


def columns_table(results: list[dict]) -> str:
    """Every column of every row: median ms per layer and the range over rounds."""
    lines = ["| row | TP | column | ms/layer (median) | range | rounds |", "|" + " --- |" * 6]
    for r in results:
        for name, median in r["ms_per_layer"].items():
            low, high = r["ms_range"][name]
            lines.append(f"| {r['row']} | {r['tp']} | {name} | {median:.3f} | "
                         f"{low:.3f}-{high:.3f} | {len(r['ms_rounds'][name])} |")
    return "\n".join(lines)


def link_table(results: list[dict]) -> str:
    """Per row: the link, the collectives' bus bandwidth at the layer's message, the
    communication share of plain TP (module docstring) and auto's choice against the best."""
    lines = ["| row | TP | link | message MiB | bus GB/s all-reduce / reduce-scatter / "
             "all-gather | comm share of plain TP (range) | serial estimate | auto's choice | "
             "best measured | auto / best |", "|" + " --- |" * 10]
    for r in results:
        full = r.get("collectives", {}).get(str(r.get("message_numel")), {})
        gbps = [full.get(name, {}).get("bus_gbps")
                for name in ("all_reduce", "reduce_scatter", "all_gather")]
        bandwidth = " / ".join(f"{v:.3g}" if v else "-" for v in gbps)
        share = r.get("comm_share")
        share_text = (f"{share['median']:.0%} ({share['min']:.0%}-{share['max']:.0%})"
                      if share else "-")
        serial = r.get("serial_comm_share")
        auto = r.get("auto", {}).get("vs_best", {})
        within = "" if "within" not in auto else (" ok" if auto["within"] else " MISSED")
        lines.append(f"| {r['row']} | {r['tp']} | {r.get('link', '-')} | "
                     f"{full.get('bytes', 0) / 2**20:.2f} | {bandwidth} | {share_text} | "
                     f"{f'{serial:.0%}' if serial else '-'} | {auto.get('choice', '-')} | "
                     f"{auto.get('best', '-')} | {_fmt(auto.get('ratio'))}{within} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="bench_domino.py's tables, run by run")
    parser.add_argument("files", nargs="+", help="bench_domino.py --out files")
    parser.add_argument("--json", help="also write the runs, in order, to this one file")
    args = parser.parse_args(argv)
    runs = []
    for path in args.files:
        with open(path) as f:
            runs.append(json.load(f))
    for run in runs:
        print(f"## {run['device']} x {run['world']}, link {run['link']} "
              f"({run.get('link_emulates', '-')}), NCCL variables {run.get('nccl_env', {})}\n")
        for text in (columns_table, table, link_table):
            print(text(run["results"]), end="\n\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
