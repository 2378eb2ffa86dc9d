#!/usr/bin/env bash
# A real two-node run on one machine: two network namespaces joined by a veth pair act as nodes.
# Each runs `torchrun --nnodes 2 --nproc_per_node 2` with c10d rendezvous on the first node's
# address; the tiny GPT trains with TP=2 inside each node and DP=2 across them (gloo over the
# veth). The same run as 4 processes on one node follows, and the two logs' losses must agree
# within REL (scripts/compare_losses.py): exit 0 if they do, 1 if not, other codes on failure.
#
#   sudo bash scripts/two_node_netns.sh [extra pretrain_gpt.py flags]
#
# Environment: ITERS (8), RUN_TIMEOUT seconds per run (150), REL (1e-5), RATE (e.g. 100mbit: a
# limit on each direction of the link, scripts/lib/netns.sh; default none), LOG_DIR (a temporary dir).
# Needs root (ip netns). Traffic only reaches the two namespaces' addresses and loopback; the
# namespaces, the link and every process started here are removed on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

ITERS=${ITERS:-8}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
REL=${REL:-1e-5}
RATE=${RATE:-}
LOG_DIR=${LOG_DIR:-$(mktemp -d)}
SUBNET=10.231.57
PORT=29400
source scripts/lib/netns.sh
netns_pair_up md2n "$SUBNET"
if [ -n "$RATE" ]; then
  limit_link "$NS_A" "$VETH_A" "$RATE"
  limit_link "$NS_B" "$VETH_B" "$RATE"
fi

TRAIN_ARGS=(pretrain_gpt.py --model-preset gpt-tiny --tensor-model-parallel-size 2 --mock-data
  --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" --lr 1e-3
  --log-interval 1 --eval-interval "$ITERS" --eval-iters 2 --seed 1234 "$@")

# node: NAMESPACE VETH ADDRESS IS_HOST: torchrun for one node of two, rendezvous at the first.
# Both namespaces share this machine's hostname, so torchrun cannot tell from it which node hosts
# the rendezvous store (is_host says so) or which address the rank-0 node has (--local-addr).
node() {
  ip netns exec "$1" env GLOO_SOCKET_IFNAME="$2" timeout -k 5 "$RUN_TIMEOUT" \
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-id two-node-$$ \
    --rdzv-endpoint "$ADDR_A:$PORT" --rdzv-conf "is_host=$4" --local-addr "$3" \
    "${TRAIN_ARGS[@]}"
}

echo "two nodes: $NS_A ($ADDR_A) + $NS_B ($ADDR_B), logs in $LOG_DIR"
node "$NS_A" "$VETH_A" "$ADDR_A" 1 >"$LOG_DIR/node_a.log" 2>&1 &
pid_a=$!
node "$NS_B" "$VETH_B" "$ADDR_B" 0 >"$LOG_DIR/node_b.log" 2>&1 &
pid_b=$!
status=0
wait "$pid_a" || status=$?
wait "$pid_b" || status=$?
if [ "$status" -ne 0 ]; then
  tail -n 30 "$LOG_DIR/node_a.log" "$LOG_DIR/node_b.log" >&2
  echo "two-node run failed (exit $status)" >&2
  exit 2
fi
# Rank 0 is on whichever node the rendezvous put first: its log holds the loss lines.
cat "$LOG_DIR/node_a.log" "$LOG_DIR/node_b.log" >"$LOG_DIR/two_nodes.log"

echo "one node: 4 processes in $NS_A over loopback"
if ! ip netns exec "$NS_A" env GLOO_SOCKET_IFNAME=lo timeout -k 5 "$RUN_TIMEOUT" \
    torchrun --nnodes 1 --nproc_per_node 4 --rdzv-backend c10d --rdzv-id one-node-$$ \
    --rdzv-endpoint "127.0.0.1:$PORT" --local-addr 127.0.0.1 "${TRAIN_ARGS[@]}" \
    >"$LOG_DIR/one_node.log" 2>&1; then
  tail -n 30 "$LOG_DIR/one_node.log" >&2
  echo "one-node run failed" >&2
  exit 2
fi

python3 scripts/compare_losses.py "$LOG_DIR/two_nodes.log" "$LOG_DIR/one_node.log" --rel "$REL"
