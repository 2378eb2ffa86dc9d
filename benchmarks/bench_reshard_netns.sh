#!/usr/bin/env bash
# Cross-mesh resharding over emulated hosts (benchmarks/bench_reshard.py): one network namespace
# per host, each joined to a switch namespace by its own veth pair whose both directions tc
# limits to RATE_MBIT (tbf: this kernel has no netem, so no latency is added); ranks on one host
# talk over its loopback. Every case of bench_reshard.py runs as its own gloo world, then the
# table and the targets are printed.
#
#   sudo bash benchmarks/bench_reshard_netns.sh
#
# Environment: CASES (default: every case; names from `bench_reshard.py cases`), RATE_MBIT (400),
# REPEATS (5 timed runs of each plan, after one warm-up), RUN_TIMEOUT seconds per case (600),
# PYTHON (python3: one that imports megadomino), OUT_DIR (a temporary directory: results.jsonl
# and results.json land there).
# Needs root (ip netns, tc). Traffic only reaches the namespaces' addresses and their loopbacks;
# the namespaces, the links and every process started in them are removed on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
RATE_MBIT=${RATE_MBIT:-400}
REPEATS=${REPEATS:-5}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
CASES=${CASES:-$("$PYTHON" benchmarks/bench_reshard.py cases)}
SUBNET=10.233.77
MAX_HOSTS=5
source scripts/lib/netns.sh
netns_hosts_up mdr "$SUBNET" "$MAX_HOSTS"
for ((h = 0; h < MAX_HOSTS; h++)); do limit_host "$h" "${RATE_MBIT}mbit"; done
echo "hosts ${NS_HOSTS[*]} on switch $NS_SWITCH, ${RATE_MBIT} Mbit/s each way, logs in $OUT_DIR" >&2

port=29800
for case in $CASES; do
  read -r -a hosts <<<"$("$PYTHON" benchmarks/bench_reshard.py hosts "$case")"
  world=${#hosts[@]}
  echo "$case: $world ranks on hosts ${hosts[*]} (rank 0 at ${ADDR_HOSTS[${hosts[0]}]})" >&2
  pids=()
  for ((r = 0; r < world; r++)); do
    h=${hosts[r]}
    ip netns exec "${NS_HOSTS[h]}" env GLOO_SOCKET_IFNAME="${VETH_HOSTS[h]}" \
      timeout -k 5 "$RUN_TIMEOUT" "$PYTHON" benchmarks/bench_reshard.py worker --case "$case" \
      --rank "$r" --world "$world" --master "${ADDR_HOSTS[${hosts[0]}]}" --port "$port" \
      --veth "${VETH_HOSTS[h]}" --rate-mbit "$RATE_MBIT" --repeats "$REPEATS" --out "$OUT_DIR" \
      >"$OUT_DIR/rank$r-${case//\//_}.log" 2>&1 &
    pids+=($!)
  done
  wait_ranks "case $case" "$OUT_DIR/rank0-${case//\//_}.log" "${pids[@]}"
  port=$((port + 1))
done
"$PYTHON" benchmarks/bench_reshard.py report "$OUT_DIR" --json "$OUT_DIR/results.json"
