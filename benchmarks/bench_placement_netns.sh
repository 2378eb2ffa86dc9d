#!/usr/bin/env bash
# Pipeline placement over three emulated sites (issue 41; benchmarks/bench_placement.py): the
# rank-order plan, DT-FM's plan and ours (--pipeline-plan auto, OP-Fence) trained on real text
# (benchmarks/text_corpus.py), beside the no-communication limit (ours without rate limits).
#
#   sudo bash benchmarks/bench_placement_netns.sh
#   python3 benchmarks/bench_placement.py report OUT_DIR --warmup 2 --tokens T   # again, later
#
# Sites (scripts/lib/netns.sh's netns_sites_up: each site's uplink and downlink limited, a star
# through a switch namespace): A = ranks 0, 1 at 100 Mbit/s, C = rank 2 at 10 Mbit/s, B = rank 3
# at 100 Mbit/s, so A-B runs at 100 and every link to C at 10 Mbit/s; in rank order a pipeline
# crosses the slow site twice (A -> C -> B). Rank SLOW_RANK computes at half speed
# (--emulate-slow-rank SLOW_RANK:2). Before each run every site-to-site direction is verified
# within 10% of its rate by a TCP transfer (bench_placement.py probe-*); a run whose links miss
# it stops the benchmark.
# Order: one --pipeline-plan auto run measures the links and plans ours (OUT_DIR/measure), the
# plans of the others follow from that measurement (bench_placement.py plans); then ROUNDS
# rounds, each running rank-order, dt-fm, ours and nocomm once (interleaved, so that load drifts
# cancel in the paired ratios), WARMUP + STEPS iterations each, rank 0's log OUT_DIR/roundN-
# PLAN.log and the 1-minute load average at its start in OUT_DIR/load.json; then the report.
# Bounded: RUN_TIMEOUT seconds a run (default 600). The default size (4 layers, hidden 128,
# sequence 128, 4 micro-batches of 16 a step, a 512-piece tokenizer) makes the step mostly
# communication: on the repository's 2-core machine the rank-order plan takes about 8 s a
# step and the limit under 1 s, so the defaults take about 30 minutes.
#
# Environment: ROUNDS (3), WARMUP (2), STEPS (20), SLOW_RANK (3), RUN_TIMEOUT (600), HOST_OF
# ("0 0 1 2": each rank's site, 0 = A, 1 = C, 2 = B), PYTHON
# (python3, one that imports megadomino), OUT_DIR (a temporary directory), CORPUS_DIR (where
# text_corpus.py's files are, made there when missing; default OUT_DIR/corpus), VOCAB (the
# corpus tokenizer's pieces when it is made: 512, so that the output layer is a small part of
# the compute), MODEL_FLAGS (the model and batch: default below, sized so that the planned
# run's step is at least 4.5x the no-communication limit's on the testbed; the report says
# whether it is).
# Needs root (ip netns, tc). Traffic only reaches the namespaces' addresses and their loopbacks;
# the namespaces and every process started in them are removed on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-2}
STEPS=${STEPS:-20}
SLOW_RANK=${SLOW_RANK:-3}
RUN_TIMEOUT=${RUN_TIMEOUT:-600}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
CORPUS_DIR=${CORPUS_DIR:-$OUT_DIR/corpus}
VOCAB=${VOCAB:-512}
MODEL_FLAGS=${MODEL_FLAGS:-"--num-layers 4 --hidden-size 128 --num-attention-heads 4 \
--seq-length 128 --max-position-embeddings 128 --micro-batch-size 16 --global-batch-size 64 \
--untie-embeddings-and-output-weights"}
SUBNET=10.234.71
SITES=(100mbit 10mbit 100mbit)  # A, C, B
read -r -a HOST_OF <<<"${HOST_OF:-0 0 1 2}"  # rank -> site (bench_codec_netns.sh sets its own)
mkdir -p "$OUT_DIR"
source scripts/lib/netns.sh

text_corpus_flags "$CORPUS_DIR" "$PYTHON" "$VOCAB"
read -r -a MODEL <<<"$MODEL_FLAGS"
FLAGS=("${MODEL[@]}" "${TEXT_FLAGS[@]}"
       --lr 1e-4 --log-interval 1 --eval-iters 0 --eval-interval 100000
       --emulate-slow-rank "$SLOW_RANK:2")
ITERS=$((WARMUP + STEPS))

netns_sites_up mdpl "$SUBNET" "${SITES[@]}"

rate_mbit() { echo "${1%mbit}"; }

# verify_links: every site-to-site direction within 10% of the slower site's rate.
verify_links() {
  local i j want got port=29901
  for ((i = 0; i < ${#SITES[@]}; i++)); do
    for ((j = 0; j < ${#SITES[@]}; j++)); do
      [ "$i" -eq "$j" ] && continue
      want=$(( $(rate_mbit "${SITES[i]}") < $(rate_mbit "${SITES[j]}") ?
               $(rate_mbit "${SITES[i]}") : $(rate_mbit "${SITES[j]}") ))
      local bytes=$((want * 1000000 / 8 * 2))  # about 2 s of the link
      ip netns exec "${NS_HOSTS[j]}" timeout 60 "$PYTHON" benchmarks/bench_placement.py \
        probe-recv "$port" "$bytes" >"$OUT_DIR/probe.txt" &
      local receiver=$!
      ip netns exec "${NS_HOSTS[i]}" timeout 60 "$PYTHON" benchmarks/bench_placement.py \
        probe-send "${ADDR_HOSTS[j]}" "$port" "$bytes"
      wait "$receiver"
      got=$(cat "$OUT_DIR/probe.txt")
      echo "link site $i -> site $j: $got Mbit/s (want $want)" >&2
      if ! "$PYTHON" -c "import sys; sys.exit(abs($got - $want) > 0.1 * $want)"; then
        echo "link site $i -> site $j is $got Mbit/s, not within 10% of $want" >&2
        exit 1
      fi
      port=$((port + 1))
    done
  done
}

# set_limits on|off: the sites' rates, or none (the no-communication limit).
set_limits() {
  local i
  for ((i = 0; i < ${#SITES[@]}; i++)); do
    limit_host "$i" "$([ "$1" = on ] && echo "${SITES[i]}" || echo none)"
  done
}

# train NAME ITERS FLAG...: the 4 ranks, each in its site's namespace; rank 0's log NAME.log.
PORT=29800
train() {
  local name=$1 iters=$2 rank pids=()
  shift 2
  PORT=$((PORT + 1))
  "$PYTHON" -c "import json, os, sys; p = sys.argv[1]; d = json.load(open(p)) \
if os.path.exists(p) else {}; d.setdefault(sys.argv[2], []).append(os.getloadavg()[0]); \
json.dump(d, open(p, 'w'))" "$OUT_DIR/load.json" "${name#round*-}"
  for rank in 0 1 2 3; do
    local host=${HOST_OF[rank]}
    ip netns exec "${NS_HOSTS[host]}" env GLOO_SOCKET_IFNAME="${VETH_HOSTS[host]}" \
      MASTER_ADDR="${ADDR_HOSTS[0]}" MASTER_PORT="$PORT" WORLD_SIZE=4 RANK="$rank" \
      LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 OMP_NUM_THREADS=1 \
      timeout -k 5 "$RUN_TIMEOUT" "$PYTHON" pretrain_gpt.py "${FLAGS[@]}" \
      --train-iters "$iters" "$@" >"$OUT_DIR/$name$([ "$rank" -eq 0 ] || echo "-rank$rank").log" \
      2>&1 &
    pids+=($!)
  done
  wait_ranks "$name" "$OUT_DIR/$name.log" "${pids[@]}"
}

# Sourced (benchmarks/bench_codec_netns.sh): the sites, the corpus and the functions above only.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi
set_limits on
verify_links
train measure 1 --pipeline-plan auto --pipeline-placement-dir "$OUT_DIR/measure"
"$PYTHON" benchmarks/bench_placement.py plans "$OUT_DIR" -- "${FLAGS[@]}" --train-iters 1
for ((round = 1; round <= ROUNDS; round++)); do
  for plan in rank-order dt-fm ours nocomm; do
    if [ "$plan" = nocomm ]; then set_limits off; else set_limits on; verify_links; fi
    train "round$round-$plan" "$ITERS" --pipeline-plan "$OUT_DIR/plan-$plan.json"
  done
done
set_limits on
TOKENS=$("$PYTHON" -c "import sys; a = sys.argv[1:]; \
print(int(a[a.index('--global-batch-size') + 1]) * int(a[a.index('--seq-length') + 1]))" \
  "${MODEL[@]}")
"$PYTHON" benchmarks/bench_placement.py report "$OUT_DIR" --warmup "$WARMUP" --tokens "$TOKENS" \
  | tee "$OUT_DIR/report.txt"
