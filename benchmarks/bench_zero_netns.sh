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
SUBNET=10.232.84
# Names unique per invocation: other runs on this machine may hold their own namespaces.
NS_A="mdz-$$-a" NS_B="mdz-$$-b" VETH_A="mdz$$a" VETH_B="mdz$$b"
ADDR_A="$SUBNET.1" ADDR_B="$SUBNET.2"

cleanup() {
  local ns pid
  for ns in "$NS_A" "$NS_B"; do
    if ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns"); do kill -TERM "$pid" 2>/dev/null || true; done
      sleep 0.5
      for pid in $(ip netns pids "$ns"); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "$ns"
    fi
  done
  ip link del "$VETH_A" 2>/dev/null || true  # only left if setup failed before the move
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$NS_A"
ip netns add "$NS_B"
ip link add "$VETH_A" type veth peer name "$VETH_B"
ip link set "$VETH_A" netns "$NS_A"
ip link set "$VETH_B" netns "$NS_B"
ip -n "$NS_A" addr add "$ADDR_A/24" dev "$VETH_A"
ip -n "$NS_B" addr add "$ADDR_B/24" dev "$VETH_B"
for ns in "$NS_A" "$NS_B"; do ip -n "$ns" link set lo up; done
ip -n "$NS_A" link set "$VETH_A" up
ip -n "$NS_B" link set "$VETH_B" up

# limit_link NAMESPACE VETH RATE: netem (rate, 1 ms delay) as NETWORK.md says; where the kernel
# lacks netem, a token bucket (tbf) at the same rate without the delay (the burst covers one
# 64 KB segmentation-offload packet, which a smaller bucket would drop forever).
limit_link() {
  if [ "$3" = none ]; then
    ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
    echo "$2: no rate limit" >&2
  elif ip netns exec "$1" tc qdisc replace dev "$2" root netem rate "$3" delay 1ms limit 100000 \
      2>/dev/null; then
    echo "$2: netem rate $3 delay 1ms" >&2
  else
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst 256kb limit 8mb
    echo "$2: no netem in this kernel; tbf rate $3 burst 256kb (no added delay)" >&2
  fi
}

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
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  if [ "$status" -ne 0 ]; then
    echo "rate $rate failed ($status); rank 0's log:" >&2
    tail -30 "$OUT_DIR/rank0-$rate.log" >&2
    exit "$status"
  fi
  port=$((port + 1))
done
python3 benchmarks/bench_zero_netns.py report "$OUT_DIR" --json "$OUT_DIR/results.json"
