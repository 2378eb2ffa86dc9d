#!/usr/bin/env bash
# DiLoCo across a slow link (issue 43; megadomino/zero/diloco.py): two network namespaces are two
# sites, one CPU rank each (DP=2, gloo), joined by a veth pair that tc limits to RATE each way
# (tbf where the kernel has no netem: no added latency). On real text (benchmarks/text_corpus.py)
# it trains:
#   plain           plain DP over the limited link, PLAIN_ITERS iterations (its step time)
#   plain-unshaped-I  plain DP over the unlimited link, one run of I iterations for each DiLoCo
#                   run length I (the reference loss at equal tokens and the same LR schedule)
#   nocomm          DiLoCo whose first outer step would come after the run (nothing crosses the
#                   link: the no-communication limit), NOCOMM_ITERS iterations (its step time)
#   diloco-hH-D     DiLoCo, H inner steps for each H in H_VALUES, pseudo-gradients as D in
#                   DTYPES, OUTER_STEPS x H iterations
# then benchmarks/bench_diloco.py's report: throughput against the limit, final validation loss
# against plain DP's, and the targets (it exits 1 when one is missed).
#
#   sudo bash benchmarks/bench_diloco_netns.sh
#   python3 benchmarks/bench_diloco.py report OUT_DIR     # again, later
#
# With the defaults (a 3.3M-parameter GPT, 4096 tokens a rank a step, an inner step about 1.5 s
# on one core) plain DP's all-reduce over 10 Mbit/s takes about 8 inner steps and an int8
# pseudo-gradient exchange about 3; the whole benchmark takes about 75 minutes on two cores.
# Environment: RATE (10mbit), OUTER_STEPS (20), PLAIN_ITERS (20), NOCOMM_ITERS (300), H_VALUES
# ("10 50"), DTYPES (int8; e.g. "bf16 int8"), EVAL_ITERS (20), RUN_TIMEOUT seconds a run (3600),
# PYTHON (python3, one that imports megadomino), OUT_DIR (a temporary directory: every rank's
# log, report.txt and results.json), RESUME (1: keep every run whose log in OUT_DIR has ended,
# so a pass cut short goes on where it stopped), CORPUS_DIR (text_corpus.py's files, made there
# when missing; default OUT_DIR/corpus), MODEL_FLAGS (the model and batch, default below),
# DILOCO_FLAGS (more flags of every DiLoCo run, e.g. "--diloco-outer-lr 1.0
# --diloco-outer-momentum 0"; default none: DiLoCo's outer defaults).
# Needs root (ip netns, tc). Traffic only reaches the two namespaces' addresses and their
# loopbacks; the namespaces, the link and every process started in them are removed on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
RATE=${RATE:-10mbit}
OUTER_STEPS=${OUTER_STEPS:-20}
PLAIN_ITERS=${PLAIN_ITERS:-20}
NOCOMM_ITERS=${NOCOMM_ITERS:-300}
H_VALUES=${H_VALUES:-"10 50"}
DTYPES=${DTYPES:-int8}
read -r -a DILOCO <<<"${DILOCO_FLAGS:-}"
EVAL_ITERS=${EVAL_ITERS:-20}
RUN_TIMEOUT=${RUN_TIMEOUT:-3600}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
CORPUS_DIR=${CORPUS_DIR:-$OUT_DIR/corpus}
MODEL_FLAGS=${MODEL_FLAGS:-"--num-layers 4 --hidden-size 192 --num-attention-heads 4 \
--seq-length 256 --max-position-embeddings 256 --micro-batch-size 16 --global-batch-size 32"}
SUBNET=10.235.43
mkdir -p "$OUT_DIR"
source scripts/lib/netns.sh

text_corpus_flags "$CORPUS_DIR" "$PYTHON"
read -r -a MODEL <<<"$MODEL_FLAGS"
FLAGS=("${MODEL[@]}" "${TEXT_FLAGS[@]}"
       --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.02 --log-interval 10
       --gpus-per-node 1 --seed 1234)

netns_pair_up mddl "$SUBNET"

# train NAME ITERS EVAL_ITERS FLAG...: rank 0 in site A, rank 1 in site B (one a node, so the
# default DiLoCo sites are the two namespaces); logs NAME.log and NAME-rank1.log. The validation
# runs once, at the end.
PORT=29860
train() {
  local name=$1 iters=$2 eval_iters=$3 rank ns veth pids=()
  shift 3
  PORT=$((PORT + 1))
  if [ "${RESUME:-}" = 1 ] && grep -q "run ended" "$OUT_DIR/$name.log" 2>/dev/null; then
    echo "$name: kept from an earlier pass" >&2
    return
  fi
  echo "$name: $iters iterations, $(cut -d' ' -f1 /proc/loadavg) load" >&2
  for rank in 0 1; do
    if [ "$rank" -eq 0 ]; then ns=$NS_A veth=$VETH_A; else ns=$NS_B veth=$VETH_B; fi
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$veth" MASTER_ADDR="$ADDR_A" \
      MASTER_PORT="$PORT" WORLD_SIZE=2 RANK="$rank" LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
      OMP_NUM_THREADS=1 timeout -k 5 "$RUN_TIMEOUT" "$PYTHON" pretrain_gpt.py "${FLAGS[@]}" \
      --train-iters "$iters" --eval-interval "$iters" --eval-iters "$eval_iters" "$@" \
      >"$OUT_DIR/$name$([ "$rank" -eq 0 ] || echo "-rank$rank").log" 2>&1 &
    pids+=($!)
  done
  wait_ranks "$name" "$OUT_DIR/$name.log" "${pids[@]}"
}

limit() {
  limit_link "$NS_A" "$VETH_A" "$1"
  limit_link "$NS_B" "$VETH_B" "$1"
}

# plain DP over the unlimited link for each DiLoCo run length: the same tokens and LR schedule
read -r -a HS <<<"$H_VALUES"
limit none
for iters in $(for h in "${HS[@]}"; do echo $((OUTER_STEPS * h)); done | sort -nu); do
  train "plain-unshaped-$iters" "$iters" "$EVAL_ITERS"
done
limit "$RATE"
train plain "$PLAIN_ITERS" 0
train nocomm "$NOCOMM_ITERS" 0 --diloco-inner-steps $((NOCOMM_ITERS + 1)) ${DILOCO[@]+"${DILOCO[@]}"}
for h in "${HS[@]}"; do
  for dtype in $DTYPES; do
    train "diloco-h$h-$dtype" $((OUTER_STEPS * h)) "$EVAL_ITERS" --diloco-inner-steps "$h" \
      --diloco-pseudo-grad-dtype "$dtype" ${DILOCO[@]+"${DILOCO[@]}"}
  done
done
status=0
"$PYTHON" benchmarks/bench_diloco.py report "$OUT_DIR" --json "$OUT_DIR/results.json" \
  | tee "$OUT_DIR/report.txt" || status=$?
echo "logs, report.txt and results.json in $OUT_DIR" >&2
exit "$status"
