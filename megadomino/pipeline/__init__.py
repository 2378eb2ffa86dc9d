"""Pipeline parallelism: a stage's chunks of the model (`stage`, of the run's plan:
config/pipeline_plan.py), schedules as action lists (`schedules`: 1F1B, interleaved 1F1B,
eager-1F1B, ZB-H1), their executor (`executor`), the transports between stages
(`transport_protocol`, what the executor calls; `transport_p2p`: plain P2P between same-layout
stages; `transport_reshard`: the cross-mesh resharding plans of `reshard/` between stages of
different layouts, for --pipeline-plan; `transport_delay`: an emulated link latency), the
training step that joins them to the data-parallel engine (`runtime`), and --pipeline-plan
auto's placement (`placement/`: links and speeds measured, a cost model, the planners;
docs/placement.md). docs/pipeline.md says what composes.

Drives `models` (a stage runs a range of the layer stack) and is never imported by it.
"""
