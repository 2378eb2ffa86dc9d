#!/usr/bin/env bash
# ZeRO++ vs ZeRO-3 step time over a slow link, measured for real on one machine: two network
# namespaces are two nodes (2 CPU ranks each, gloo), joined by a veth pair that tc limits to each
# rate in turn (netem with 1 ms delay each way, or tbf where the kernel has no netem). Prints the table of bench_zero_netns.py's report:
# seconds per step, the logical inter-node bytes beside the bytes `ip -s link` counted on the veth.
#
#   sudo bash benchmarks/bench_zero_netns.sh [worker flags, e.g. --steps 5 --hidden-size 384]
#
# Environment: RATES ("1gbit 100mbit"; "none" is the unlimited veth), RUN_TIMEOUT seconds per rate (400), OUT_DIR (a temporary
# directory; results.jsonl and results.json land there).
# Needs root (ip netns, tc). Traffic only reaches the two namespaces' addresses and their
# loopbacks; the namespaces, the link and every process started in them are removed on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

FLAGS=("$@")
RATES=${RATES:-"1gbit 100mbit"}
RUN_TIMEOUT=${RUN_TIMEOUT:-400}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
SUBNET=10.232.84
source scripts/lib/netns.sh
netns_pair_up mdz "$SUBNET"

# rank RANK NAMESPACE VETH PORT RATE [flags]: one worker; the master is rank 0 at node A's address.
rank() {
  local rank=$1 ns=$2 veth=$3 port=$4 rate=$5
  shift 5
  ip netns exec "$ns" env RANK="$rank" WORLD_SIZE=4 MASTER_ADDR="$ADDR_A" MASTER_PORT="$port" \
    GLOO_SOCKET_IFNAME="$veth" VETH="$veth" timeout -k 5 "$RUN_TIMEOUT" \
    python3 benchmarks/bench_zero_netns.py worker --rate "$rate" --out "$OUT_DIR" "$@"
}

port=29700
for rate in $RATES; do
  limit_link "$NS_A" "$VETH_A" "$rate"
  limit_link "$NS_B" "$VETH_B" "$rate"
  echo "link $rate: $NS_A ($ADDR_A) <-> $NS_B ($ADDR_B), logs in $OUT_DIR" >&2
  pids=()
  for r in 0 1 2 3; do
    if [ "$r" -lt 2 ]; then ns=$NS_A veth=$VETH_A; else ns=$NS_B veth=$VETH_B; fi
    rank "$r" "$ns" "$veth" "$port" "$rate" "${FLAGS[@]}" >"$OUT_DIR/rank$r-$rate.log" 2>&1 &
    pids+=($!)
  done
  wait_ranks "rate $rate" "$OUT_DIR/rank0-$rate.log" "${pids[@]}"
  port=$((port + 1))
done
python3 benchmarks/bench_zero_netns.py report "$OUT_DIR" --json "$OUT_DIR/results.json"
