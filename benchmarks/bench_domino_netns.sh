#!/usr/bin/env bash
# Tensor parallelism across two emulated hosts (benchmarks/bench_domino.py on CPUs): two network
# namespaces, one TP rank each (TP=2, gloo, fp32, one thread a rank), joined by a veth pair whose
# both directions tc limits to each rate in turn (tbf: this kernel has no netem, so no latency is
# added; "none" leaves the pair unlimited). Every rate runs bench_domino's small CPU rows in one
# call: the no-communication limit, plain TP, SP with and without the fused collectives, every
# Domino plan and the plan --domino would choose, 3 rounds; then every rate's tables together.
#
#   sudo bash benchmarks/bench_domino_netns.sh [bench_domino flags, e.g. --rows cpu-gpt]
#
# Environment: RATES_MBIT ("none 1000 300"), RUN_TIMEOUT seconds per rate (600), PYTHON
# (python3: one that imports megadomino), OUT_DIR (a temporary directory: one JSON per rate,
# the ranks' logs and report.txt land there).
# Needs root (ip netns, tc). Traffic only reaches the two namespaces' addresses and their
# loopbacks; the namespaces, the link and every process started in them are removed on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

FLAGS=("$@")
PYTHON=${PYTHON:-python3}
RATES_MBIT=${RATES_MBIT:-"none 1000 300"}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
SUBNET=10.235.45
source scripts/lib/netns.sh
netns_pair_up mdd "$SUBNET"

port=29850
outs=()
for mbit in $RATES_MBIT; do
  rate=$mbit label="netns ${mbit} Mbit/s"
  if [ "$mbit" != none ]; then rate="${mbit}mbit"; else label="netns unlimited veth"; fi
  limit_link "$NS_A" "$VETH_A" "$rate"
  limit_link "$NS_B" "$VETH_B" "$rate"
  echo "link $label: $NS_A ($ADDR_A) <-> $NS_B ($ADDR_B), logs in $OUT_DIR" >&2
  pids=()
  for r in 0 1; do
    if [ "$r" -eq 0 ]; then ns=$NS_A veth=$VETH_A; else ns=$NS_B veth=$VETH_B; fi
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$veth" MASTER_ADDR="$ADDR_A" \
      MASTER_PORT="$port" RANK="$r" WORLD_SIZE=2 LOCAL_RANK=0 OMP_NUM_THREADS=1 \
      timeout -k 5 "$RUN_TIMEOUT" "$PYTHON" benchmarks/bench_domino.py --device cpu --rows cpu \
      --layers 2 --warmup 1 --iters 3 --rounds 3 --comm-overlap --auto --peers '' \
      --tag "$label" --out "$OUT_DIR/domino_${mbit}.json" "${FLAGS[@]}" \
      >"$OUT_DIR/rank$r-${mbit}.log" 2>&1 &
    pids+=($!)
  done
  wait_ranks "rate $label" "$OUT_DIR/rank0-${mbit}.log" "${pids[@]}"
  outs+=("$OUT_DIR/domino_${mbit}.json")
  port=$((port + 1))
done
"$PYTHON" benchmarks/domino_report.py "${outs[@]}" | tee "$OUT_DIR/report.txt"
