"""Pipeline parallelism: stage plans, schedules as action lists, their executor, and the
transports between stages (plain P2P between same-layout stages, cross-mesh resharding in
`reshard/` between meshes of different shapes).

Drives `models` (a stage runs a range of the layer stack) and is never imported by it.
"""
