# Sourced by the sbatch files (and, through them, scripts/local/*.sh): start an entry script.
#
#   megadomino_launch ENTRY [ARGS...]
#
# LAUNCHER=torchrun (default): srun starts one torchrun per node; torchrun starts GPUS_PER_NODE
#   workers and the nodes meet through c10d rendezvous on the first node of the job.
# LAUNCHER=srun: srun starts every worker itself (GPUS_PER_NODE tasks per node); the entry point
#   reads SLURM_PROCID and friends (megadomino/cli/slurm_env.py).
# LAUNCHER=local: one node without SLURM, `torchrun --standalone`.
# DRY_RUN=1 prints the command instead of running it (also outside SLURM, for checking).
#
# From SLURM: SLURM_NNODES, SLURM_JOB_NODELIST, SLURM_JOB_ID. Overridable: GPUS_PER_NODE
# (default SLURM_GPUS_ON_NODE, else 8), RDZV_PORT (29500).

# The first host of the job: the rendezvous endpoint.
megadomino_first_node() {
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
  else
    python3 -c 'import sys; from megadomino.cli.slurm_env import first_host
print(first_host(sys.argv[1]))' "$SLURM_JOB_NODELIST"
  fi
}

# Run "$@", or print it on one line when DRY_RUN=1 (words quoted only where the shell needs it).
megadomino_run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    local word line=()
    for word in "$@"; do
      if [[ $word =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then
        line+=("$word")
      else
        line+=("$(printf '%q' "$word")")
      fi
    done
    echo "${line[*]}"
  else
    "$@"
  fi
}

megadomino_launch() {
  local gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  local launcher=${LAUNCHER:-torchrun} nodes
  if [ "$launcher" = local ]; then
    megadomino_run torchrun --standalone --nproc_per_node "$gpus" "$@"
    return
  fi
  nodes=${SLURM_NNODES:?run under sbatch, or set SLURM_NNODES and SLURM_JOB_NODELIST}
  case "$launcher" in
    torchrun)
      local first_node
      first_node=$(megadomino_first_node)
      megadomino_run srun --nodes="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        torchrun --nnodes "$nodes" --nproc_per_node "$gpus" \
        --rdzv_id "${SLURM_JOB_ID:-megadomino}" --rdzv_backend c10d \
        --rdzv_endpoint "$first_node:${RDZV_PORT:-29500}" "$@" ;;
    srun)
      megadomino_run srun --nodes="$nodes" --ntasks-per-node="$gpus" --kill-on-bad-exit=1 \
        python3 "$@" ;;
    *)
      echo "LAUNCHER=$launcher is unknown: use torchrun, srun or local" >&2
      return 2 ;;
  esac
}
