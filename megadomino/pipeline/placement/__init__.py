"""Pipeline placement over slow and uneven links (`--pipeline-plan auto`; docs/placement.md):
measure the machine, price a plan, place the stages.

    measure    bandwidth and latency between every pair of ranks, both directions; each rank's
               GEMM speed (start-up, all ranks)
    cost       the one cost model: stage compute, boundary transfer, DP reduce, the step through
               pipeline/simulate.py
    cut        the exact layer cut (dynamic programming) and its brute-force check
    chains     the stage orders a plan may take: bandwidth clusters (OP-Fence), every ordered
               partition (the oracle)
    dtfm       DT-FM's objective and search
    planners   op-fence, dt-fm, brute-force
    resolve    the launcher's resolver: measure, plan, check, print, write
    scale      the scale model: a TP x PP x DP run of any size priced by `cost` and the
               simulator from measured rates (benchmarks/scale_model.py; docs/scale_model.md)

Only `resolve` (the launcher's `resolve_auto`) is used outside pipeline/, and `scale` by the
scale model's command.
"""
