#!/usr/bin/env bash
# Cross-mesh resharding in training over two emulated hosts (issue 39): bench_reshard_train.py
# on gloo with each boundary's two stages on different hosts, counting the bytes each host's
# link carries per transfer under every --pipeline-reshard strategy. A TP1 -> TP2 boundary's
# forward and a TP2 -> TP1 boundary's backward should put one activation on the host link,
# not one per TP rank.
#
#   sudo bash benchmarks/bench_reshard_train_netns.sh
#
# Runs: plan tp1_tp2 with rank 0 on host 0 and ranks 1, 2 on host 1; plan tp2_tp1 with ranks
# 0, 1 on host 0 and rank 2 on host 1. The cost model's hosts come from --gpus-per-node, as in
# training: 2 for tp2_tp1 (hosts 0, 1 | 2, as emulated); 1 for tp1_tp2, whose emulated hosts
# (0 | 1, 2) no uniform count describes (the model then prices the TP2 stage's all-gather on a
# host link it does not cross). Each link limited to RATE_MBIT both ways (tbf, no added
# latency). Environment: RATE_MBIT (400), SHAPE ("128 4 256": seq, micro-batch, hidden; fp32,
# 0.5 MiB), ITERS (10), ROUNDS (3), RUN_TIMEOUT (300), PYTHON (python3), OUT_DIR (a temporary
# directory: each run's log and JSON). Needs root (ip netns, tc); the namespaces and every
# process started in them are removed on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
RATE_MBIT=${RATE_MBIT:-400}
read -r -a SHAPE <<<"${SHAPE:-128 4 256}"
ITERS=${ITERS:-10}
ROUNDS=${ROUNDS:-3}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
SUBNET=10.233.79
source scripts/lib/netns.sh
netns_hosts_up mdt "$SUBNET" 2
for h in 0 1; do limit_host "$h" "${RATE_MBIT}mbit"; done

port=29850
for run in "tp1_tp2:0 1 1:1" "tp2_tp1:0 0 1:2"; do  # plan:each rank's host:--gpus-per-node
  IFS=: read -r plan host_list gpus <<<"$run"
  read -r -a hosts <<<"$host_list"
  pids=()
  for r in 0 1 2; do
    h=${hosts[r]}
    ip netns exec "${NS_HOSTS[h]}" env GLOO_SOCKET_IFNAME="${VETH_HOSTS[h]}" RANK="$r" \
      WORLD_SIZE=3 LOCAL_RANK=0 MASTER_ADDR="${ADDR_HOSTS[${hosts[0]}]}" MASTER_PORT="$port" \
      timeout -k 5 "$RUN_TIMEOUT" "$PYTHON" benchmarks/bench_reshard_train.py --device cpu \
      --plans "$plan" --seq "${SHAPE[0]}" --micro-batch "${SHAPE[1]}" --hidden "${SHAPE[2]}" \
      --iters "$ITERS" --rounds "$ROUNDS" --gpus-per-node "$gpus" --veth "${VETH_HOSTS[h]}" --host-of "${hosts[@]}" \
      --out "$OUT_DIR/$plan.json" >"$OUT_DIR/$plan-rank$r.log" 2>&1 &
    pids+=($!)
  done
  wait_ranks "plan $plan" "$OUT_DIR/$plan-rank0.log" "${pids[@]}"
  cat "$OUT_DIR/$plan-rank0.log"
  port=$((port + 1))
done
