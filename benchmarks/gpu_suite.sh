#!/usr/bin/env bash
# The GPU machine's checks and benchmarks, step by step, each under its own time limit, results in
# $OUT (default ./gpu_out). Meant for the device tool, which lends a machine for 10 minutes a
# call: pick the steps that fit, e.g.
#
#   bash benchmarks/gpu_suite.sh setup tests-gpu zero domino        # 4 GPUs
#   bash benchmarks/gpu_suite.sh setup kernels quant                # 1 GPU
#
# Steps:
#   setup        editable install (python3's pip: plain `pip` there is another Python) and, when
#                .peerwhl/ holds megatron-core / DeepSpeed wheels (carry it), the peers in /tmp/site
#   tests-gpu    the gpu tier: python3 -m pytest tests --tier gpu -q (tests/gpu and every NCCL
#                suite; cases needing more GPUs than here skip, naming the count). At 4 GPUs it
#                takes longer than one call's 10 minutes: run its modules in groups (the
#                2026-11-28 report lists the groups and what each took)
#   tests=LABEL:MODULE,MODULE,...[:KEXPR]
#                the gpu tier's modules named (tests/gpu/MODULE.py), logged to $OUT/tests-LABEL.txt:
#                the tier in groups, e.g. two groups side by side on GPUs 0,1 and 2,3
#                (CUDA_VISIBLE_DEVICES=0,1 OUT=out/a bash benchmarks/gpu_suite.sh tests=a:...);
#                KEXPR: pytest -k, which also picks the cases a world runs (a long world split
#                over calls); each case is logged with its seconds as every rank leaves it
#   fp8-text-gather
#                benchmarks/bench_fp8_text.py on GPUs 0,1: ZeRO 1 bf16 against FP8 (hybrid,
#                delayed) with --fp8-param-gather, 200 steps of real text (carry .text/)
#   fp8-text-graphs
#                benchmarks/bench_fp8_text.py on GPU 0: gpt3-1.3b at micro-batch 4, both arms
#                --enable-cuda-graph, bf16 against FP8 (hybrid, delayed), 200 steps of real
#                text (carry .text/)
#   fp8-linear   benchmarks/bench_fp8_linear.py: each gpt3-1.3b linear's forward + backward at
#                micro-batch 1 and 4, bf16 and FP8 (eager, compiled casts, tensorwise): the
#                wall time against the GPU's busy time and launches (where FP8's time goes)
#   tests-cpu    the default tier on this machine's torch (2.11, the oldest declared) and CPUs
#   kernels      tests/gpu/test_gpu_kernels.py only (1 GPU)
#   quant        benchmarks/bench_quant.py: our kernels vs DeepSpeed's quantizer, one GPU
#   codec        benchmarks/bench_codec.py: the pipeline codecs on a gpt3-1.3b boundary
#                (micro-batch 4, bf16) against the copy bandwidth; top-k against int8, one GPU
#   reshard-train
#                benchmarks/bench_reshard_train.py: each boundary of the heterogeneous plans
#                (TP2 -> TP1, DP2 -> DP1, TP1 -> TP2 on 3 GPUs; with 4 GPUs also the 4-rank
#                chains) through the training transport under every --pipeline-reshard
#                strategy, gpt3-1.3b's activation (seq 2048, micro-batch 4, bf16), 3 rounds,
#                against the busiest link's bytes at the P2P bandwidth measured in the same run
#                -> $OUT/reshard_train_3.json (and _4.json)
#   reshard-profile
#                the 3-GPU plans TP2 -> TP1 and DP2 -> DP1 with --profile: each row's kernel
#                timeline on every rank (NCCL, copies, idle, host calls), to see where a batch-
#                split boundary's time goes -> $OUT/reshard_profile_3.json
#   zero         benchmarks/bench_zero.py: ZeRO-3 vs ZeRO++ (and its parts) on 4 GPUs as 2 x 2
#                (2 GPUs: 2 x 1),
#                GPT-3 1.3B at micro-batch 4 (GPU-bound), with the one-deep reducer beside
#                (rows named "... xK": K layers a unit; the others units of 2e8 parameters, the
#                default: 4 layers at 1.3B)
#   zero-mb1     the same at micro-batch 1 (host-bound: the slowest rank's Python sets the pace)
#   zero-6.7b    GPT-3 6.7B at micro-batch 1 (the default makes one layer a unit there), K = 2
#   zero-rounds  default units vs one layer a unit, ZeRO-3 and ZeRO++ (and ZeRO++ with
#                DeepSpeed's levels), micro-batch 1 (3 passes) and 4 (2 passes): medians that
#                the run-to-run drift (10%) does not decide
#   fp8-gather   benchmarks/bench_zero.py: GPT-3 1.3B with FP8 linears (hybrid; delayed at ZeRO 3
#                and 1, tensorwise at ZeRO 3), without and with --fp8-param-gather, micro-batch 4,
#                3 rounds: step time, the weight gathers' bytes (the engine's count), each loss
#   domino       benchmarks/bench_domino.py core rows, CUDA-graphed, with megatron-core
#   domino-ds    the GPT row with DeepSpeed's Domino too (CUDA_DEVICE_MAX_CONNECTIONS=1)
#   domino-link=LINK[:ROWS]
#                the communication-bound testbed: bench_domino.py --link LINK (nvlink, pcie,
#                pcie-1ch, socket: NCCL variables each rank exports, benchmarks/domino_links.py)
#                on ROWS (default `link`: GPT-3 6.7B and Llama-2 7B at micro-batch 4 and 8),
#                eager as --domino times its plans, 3 rounds: the limit, plain TP, SP (SP with
#                fused collectives under nvlink only: they bypass NCCL), megatron-core, every
#                Domino plan, auto's choice; the collectives' bus bandwidth and their share of
#                plain TP -> $OUT/domino_link_LINK[-ROWS].json (written as each row finishes).
#                Slow links (socket) fit one call with one or two rows: domino-link=socket:gpt3-6.7b
#   e2e          pretrain_gpt.py gpt3-6.7b, 8 layers, TP = all GPUs: eager vs SP + fused comm +
#                CUDA graphs
#   profile      where a step's GPU time goes by kernel kind (benchmarks/timeline.py): gpt3-1.3b
#                (TP=1, micro-batch 4, compiled pieces) and gpt3-6.7b with 4 layers in FP8, one
#                profiled iteration each ($OUT/profile_*.json)
#   fp8-profile  gpt3-1.3b, 1 GPU, micro-batch 2 (global 16), compiled pieces, bf16 and FP8
#                (hybrid, delayed): each run's log (recompiles logged) and one profiled
#                iteration summed by kernel kind and idle gaps ($OUT/fp8_profile_*.json)
#   e2e=LABEL:ARGS
#                benchmarks/bench_pretrain.py ARGS (shell-quoted) -> $OUT/e2e_LABEL.json: with
#                --peer megatron --rounds 3, ours beside megatron-core's own training step
#                (benchmarks/megatron_pretrain.py; carry .peerwhl/) on the same shapes
#   pp-prefetch  gpt3-1.3b PP 2 on GPUs 0,1, 16 micro-batches of 4 (1F1B), 3 rounds beside
#                megatron-core's 1F1B: receives not prefetched (NCCL's default), prefetched
#                (--overlap-p2p-communication), and prefetched with the pipeline's NCCL kernels
#                capped at 2 thread blocks (benchmarks/nccl_pp_max_ctas2.yaml) -> $OUT/pp_prefetch.json
#   mfu-1.3b     issue 19's gpt3-1.3b command (TP=1, micro-batch 4, dropout as the preset has it):
#                eager, compiled pieces, and each with the layers in CUDA graphs, one call
#   optimizer    benchmarks/bench_optimizer.py: the optimizer step's passes over 1.3B parameters
#   bias-grad    benchmarks/bench_bias_grad.py: the bias-gradient sums beside the passes that
#                write the gradients (compiled, and our GELU kernel), GPT-3 1.3B and 6.7B layers
#   smoke-fp32   benchmarks/gpu_smoke.py: every parallel mode README lists, pretrain_gpt.py under
#   smoke-bf16   torchrun on all GPUs, 10 iterations, each run's losses against the DP run's
#                ($OUT/smoke_<dtype>.json). A launch takes 30-60 s (start-up, not training):
#                4 at once on 4 GPUs, 8 at once on 2 (10 at once beside other work overran)
#   scale-inputs the scale model's inputs (benchmarks/bench_scale_inputs.py): each preset's layer
#                at TP shards 1-8, micro-batch 1-4, on GPU 0; NCCL bus bandwidth 1 MiB-1 GiB on
#                2 GPUs and, with 4, on 4 ($OUT/scale_layers.json, scale_busbw_N.json)
#   graph-dp     scripts/debug/cuda_graph_dp_drift.py (--enable-cuda-graph at TP 2 x DP 2: eager,
#                graphed, graphed without the gradient hooks' stream join)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name rc=$?"
  tail -n 12 "$OUT/$name.txt"
}

for name in "$@"; do
  case $name in
    setup)
      python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/setup.txt" 2>&1
      if ls .peerwhl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .peerwhl/*.whl \
          >> "$OUT/setup.txt" 2>&1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      fi
      nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/setup.txt" ;;
    profile)
      for row in "gpt3-1.3b:--compile-layer-pieces" \
                 "gpt3-6.7b:--num-layers 4 --compile-layer-pieces --fp8-format hybrid"; do
        rm -rf profile
        step "profile-${row%%:*}" 300 torchrun --standalone --nproc_per_node 1 pretrain_gpt.py \
          --model-preset "${row%%:*}" --bf16 --mock-data --micro-batch-size 4 \
          --global-batch-size 4 --train-iters 10 --lr 1e-4 --lr-warmup-iters 2 --log-interval 5 \
          --eval-interval 100000 --eval-iters 1 --peak-tflops 989 --profile \
          --use-pytorch-profiler --profile-step-start 8 --profile-step-end 9 ${row#*:}
        python3 benchmarks/timeline.py profile/*.json > "$OUT/profile_${row%%:*}.json"
      done ;;
    fp8-profile)
      for row in "bf16:" "fp8:--fp8-format hybrid"; do
        rm -rf profile
        step "fp8-profile-${row%%:*}" 200 env TORCH_LOGS=recompiles torchrun --standalone \
          --nproc_per_node 1 pretrain_gpt.py --model-preset gpt3-1.3b --bf16 --mock-data \
          --micro-batch-size 2 --global-batch-size 16 --train-iters 10 --lr 1e-4 \
          --lr-warmup-iters 2 --log-interval 1 --eval-interval 100000 --eval-iters 1 \
          --hidden-dropout 0 --attention-dropout 0 --seq-length 2048 --compile-layer-pieces \
          --peak-tflops 989 --profile --use-pytorch-profiler --profile-step-start 8 \
          --profile-step-end 9 ${row#*:}
        python3 benchmarks/timeline.py profile/*.json > "$OUT/fp8_profile_${row%%:*}.json"
      done ;;
    tests-gpu) step tests-gpu 500 python3 -m pytest tests --tier gpu -q -rfE --durations=30 ;;
    tests-cpu) step tests-cpu 500 env CUDA_VISIBLE_DEVICES= python3 -m pytest tests -q ;;
    kernels) step kernels 200 python3 -m pytest tests/gpu/test_gpu_kernels.py --tier gpu -q -x ;;
    quant) step quant 200 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_quant.py \
             --out "$OUT/quant.json" ;;
    codec) step codec 120 env CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_codec.py \
             --out "$OUT/codec.json" ;;
    reshard-train)
      for n in 3 4; do
        if [ "$GPUS" -ge "$n" ]; then
          step "reshard-train-$n" 280 torchrun --standalone --nproc_per_node "$n" \
            benchmarks/bench_reshard_train.py --out "$OUT/reshard_train_$n.json"
        fi
      done ;;
    reshard-profile) step reshard-profile 240 torchrun --standalone --nproc_per_node 3 \
                       benchmarks/bench_reshard_train.py --plans tp2_tp1 dp2_dp1 --profile \
                       --out "$OUT/reshard_profile_3.json" ;;
    zero) step zero 200 torchrun --standalone --nproc_per_node "$GPUS" benchmarks/bench_zero.py \
            --steps 8 --warmup 3 --micro-batch-size 4 --configs "plain dp" zero3 qwz qwz+hpz \
            zero++ "zero++ depth1" "zero3 x1" "zero++ x1" --out "$OUT/zero.json" ;;
    zero-mb1) step zero-mb1 200 torchrun --standalone --nproc_per_node "$GPUS" \
                benchmarks/bench_zero.py --steps 12 --warmup 3 --configs "plain dp" zero3 qwz \
                qwz+hpz zero++ "zero++ int8 grads" "zero3 x1" "zero++ x1" \
                --out "$OUT/zero_mb1.json" ;;
    zero-6.7b) step zero-6.7b 300 torchrun --standalone --nproc_per_node "$GPUS" \
                 benchmarks/bench_zero.py --preset gpt3-6.7b --steps 8 --warmup 2 --configs \
                 zero3 "zero3 x2" zero++ "zero++ x2" \
                 --out "$OUT/zero_6.7b.json" ;;
    zero-rounds) step zero-rounds-mb1 300 torchrun --standalone --nproc_per_node "$GPUS" \
                   benchmarks/bench_zero.py --steps 12 --warmup 3 --rounds 3 --configs \
                   "plain dp" zero3 "zero3 x1" zero++ "zero++ x1" "zero++ full range" \
                   --out "$OUT/zero_rounds_mb1.json"
                 step zero-rounds-mb4 300 torchrun --standalone --nproc_per_node "$GPUS" \
                   benchmarks/bench_zero.py --steps 8 --warmup 3 --rounds 2 --micro-batch-size 4 \
                   --configs zero3 "zero3 x1" zero++ "zero++ x1" "zero++ full range" \
                   --out "$OUT/zero_rounds_mb4.json" ;;
    tests=*)
      group=${name#tests=}
      label=${group%%:*}
      modules=${group#*:}
      select=
      if [[ $modules == *:* ]]; then select=${modules#*:}; modules=${modules%%:*}; fi
      files=$(echo "$modules" | tr ',' '\n' | sed 's|.*|tests/gpu/&.py|' | tr '\n' ' ')
      # shellcheck disable=SC2086
      step "tests-$label" 570 python3 -m pytest $files --tier gpu -q -s -rfE --durations=30 \
        -p no:cacheprovider ${select:+-k "$select"} ;;
    fp8-text-gather)
      if [ ! -d .text ]; then echo "fp8-text-gather: carry .text (text_corpus.py --out .text)"; \
        exit 2; fi
      step fp8-text-gather 420 env CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/bench_fp8_text.py \
        --data .text --nproc-per-node 2 --iters 200 --timeout 200 \
        --both=--use-distributed-optimizer \
        --fp8-args="--fp8-format hybrid --fp8-param-gather" --out "$OUT/fp8_text_gather.json" ;;
    fp8-text-graphs)
      if [ ! -d .text ]; then echo "fp8-text-graphs: carry .text (text_corpus.py --out .text)"; \
        exit 2; fi
      step fp8-text-graphs 330 python3 benchmarks/bench_fp8_text.py --data .text \
        --preset gpt3-1.3b --num-layers 24 --micro-batch-size 4 --iters 200 --timeout 150 \
        --both=--enable-cuda-graph --out "$OUT/fp8_text_graphs.json" ;;
    fp8-linear) step fp8-linear 300 python3 benchmarks/bench_fp8_linear.py \
        --micro-batch-size 1 4 --micro-batches 4 --out "$OUT/fp8_linear.json" ;;
    fp8-gather) step fp8-gather 420 torchrun --standalone --nproc_per_node "$GPUS" \
                  benchmarks/bench_zero.py --steps 8 --warmup 3 --rounds 3 --micro-batch-size 4 \
                  --configs "zero3 fp8" "zero3 fp8 gather" "zero1 fp8" "zero1 fp8 gather" \
                  "zero3 fp8 tw" "zero3 fp8 tw gather" \
                  --baseline "zero3 fp8" --out "$OUT/zero_fp8_gather.json" ;;
    domino) step domino 300 torchrun --standalone --nproc_per_node "$GPUS" \
              benchmarks/bench_domino.py --rows core --peers megatron --plans 1x1,2x1 \
              --comm-overlap --cuda-graph --iters 10 --out "$OUT/domino.json" ;;
    domino-ds) step domino-ds 200 env CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --standalone \
                 --nproc_per_node "$GPUS" benchmarks/bench_domino.py --rows gpt3-6.7b \
                 --peers megatron,deepspeed --plans 1x1 --comm-overlap --cuda-graph --iters 10 \
                 --out "$OUT/domino_ds.json" ;;
    domino-link=*)
      spec=${name#domino-link=}
      link=${spec%%:*} rows=link tag=${spec%%:*}
      if [[ $spec == *:* ]]; then rows=${spec#*:} tag="$link-${rows//,/+}"; fi
      step "domino-link-$tag" 540 torchrun --standalone --nproc_per_node "$GPUS" \
        benchmarks/bench_domino.py --link "$link" --rows "$rows" --rounds 3 --warmup 2 \
        --iters 6 --comm-overlap --peers megatron --auto --out "$OUT/domino_link_$tag.json" ;;
    pp-prefetch) step pp-prefetch 540 env CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/bench_pretrain.py \
        --preset gpt3-1.3b --tp 1 --pp 2 --micro-batch-size 4 --accumulation 16 --iters 12 \
        --rounds 3 --peer megatron --variants '' ' --overlap-p2p-communication' \
        ' --overlap-p2p-communication --nccl-communicator-config-path benchmarks/nccl_pp_max_ctas2.yaml' \
        --out "$OUT/pp_prefetch.json" ;;
    e2e) step e2e 400 python3 benchmarks/bench_pretrain.py --preset gpt3-6.7b --num-layers 8 \
           --tp "$GPUS" --iters 10 --micro-batch-size 4 \
           --variants '--hidden-dropout 0 --attention-dropout 0' \
           '--hidden-dropout 0 --attention-dropout 0 --sequence-parallel --tp-comm-overlap --enable-cuda-graph' \
           --out "$OUT/e2e.json" ;;
    e2e=*)  # e2e=LABEL:BENCH_PRETRAIN_ARGS (shell-quoted), e.g. with megatron-core beside:
      #   "e2e=dp2:--tp 1 --dp 2 --micro-batch-size 2 --accumulation 8 --peer megatron --rounds 3"
      spec=${name#e2e=}
      eval "extra=(${spec#*:})"
      step "e2e-${spec%%:*}" 580 python3 benchmarks/bench_pretrain.py "${extra[@]}" \
        --out "$OUT/e2e_${spec%%:*}.json" ;;
    mfu-1.3b) step mfu-1.3b 500 python3 benchmarks/bench_pretrain.py --preset gpt3-1.3b --tp 1 \
                --iters 15 --log-interval 5 --micro-batch-size 4 --variants '' \
                ' --compile-layer-pieces' ' --enable-cuda-graph' \
                ' --compile-layer-pieces --enable-cuda-graph' --out "$OUT/mfu_1.3b.json" ;;
    optimizer) step optimizer 200 python3 benchmarks/bench_optimizer.py --preset gpt3-1.3b \
                 --out "$OUT/optimizer.json" ;;
    bias-grad) step bias-grad 120 python3 benchmarks/bench_bias_grad.py --iters 10 \
                 --out "$OUT/bias_grad.json" ;;
    smoke-fp32|smoke-bf16)
      step "$name" 450 python3 benchmarks/gpu_smoke.py --nproc "$GPUS" --dtype "${name#smoke-}" \
        --jobs $((16 / GPUS)) --budget 150 --out "$OUT/$name.json" ;;
    scale-inputs)
      step scale-layers 400 env CUDA_VISIBLE_DEVICES=0 torchrun --standalone --nproc_per_node 1 \
        benchmarks/bench_scale_inputs.py layers --out "$OUT/scale_layers.json"
      for n in 2 4; do
        if [ "$GPUS" -ge "$n" ]; then
          step "scale-busbw-$n" 120 torchrun --standalone --nproc_per_node "$n" \
            benchmarks/bench_scale_inputs.py busbw --out "$OUT/scale_busbw_$n.json"
        fi
      done ;;
    graph-dp) step graph-dp 200 torchrun --standalone \
                --nproc_per_node 4 scripts/debug/cuda_graph_dp_drift.py ;;
    *) echo "unknown step $name" >&2; exit 2 ;;
  esac
done
