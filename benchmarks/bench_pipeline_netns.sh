#!/usr/bin/env bash
# Pipeline schedules over a slow link (benchmarks/bench_pipeline.py): two network namespaces are
# two hosts, one rank (one pipeline stage) each, gloo, joined by a veth pair whose both directions
# tc limits to each rate in turn (tbf: this kernel has no netem, so no latency is added). Every
# rate runs every schedule side by side in one gloo world; then the table and the target.
#
#   sudo bash benchmarks/bench_pipeline_netns.sh [worker flags, e.g. --micro 8 --steps 9]
#
# Environment: RATES_MBIT ("1000 100 50"), RUN_TIMEOUT seconds per rate (900), PYTHON (python3: one
# that imports megadomino), OUT_DIR (a temporary directory: results.jsonl, results.json and the
# ranks' logs land there).
# Needs root (ip netns, tc). Traffic only reaches the two namespaces' addresses and their
# loopbacks; the namespaces, the link and every process started in them are removed on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

FLAGS=("$@")
PYTHON=${PYTHON:-python3}
RATES_MBIT=${RATES_MBIT:-"1000 100 50"}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
SUBNET=10.234.61
source scripts/lib/netns.sh
netns_pair_up mdp "$SUBNET"

port=29750
for mbit in $RATES_MBIT; do
  limit_link "$NS_A" "$VETH_A" "${mbit}mbit"
  limit_link "$NS_B" "$VETH_B" "${mbit}mbit"
  echo "link ${mbit} Mbit/s: $NS_A ($ADDR_A) <-> $NS_B ($ADDR_B), logs in $OUT_DIR" >&2
  pids=()
  for r in 0 1; do
    if [ "$r" -eq 0 ]; then ns=$NS_A veth=$VETH_A; else ns=$NS_B veth=$VETH_B; fi
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$veth" timeout -k 5 "$RUN_TIMEOUT" \
      "$PYTHON" benchmarks/bench_pipeline.py worker --rank "$r" --master "$ADDR_A" \
      --port "$port" --rate "${mbit}mbit" --rate-mbit "$mbit" --out "$OUT_DIR" "${FLAGS[@]}" \
      >"$OUT_DIR/rank$r-${mbit}mbit.log" 2>&1 &
    pids+=($!)
  done
  wait_ranks "rate ${mbit} Mbit/s" "$OUT_DIR/rank0-${mbit}mbit.log" "${pids[@]}"
  port=$((port + 1))
done
"$PYTHON" benchmarks/bench_pipeline.py report "$OUT_DIR" --json "$OUT_DIR/results.json"
