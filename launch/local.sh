#!/usr/bin/env bash
# megarl on one machine (laptop, workstation, one GPU node without SLURM).
#
#   launch/local.sh RECIPE [key=value ...]           plan, then `megarl train` (Ray started by megarl)
#   launch/local.sh --ray RECIPE [key=value ...]     start a Ray head here first (the same bootstrap
#                                                    the sbatch scripts use), join it, stop it after
#   launch/local.sh --plan-only RECIPE [...]         only `megarl plan`
#
# Environment: MEGARL_SKIP_PLAN=1 skips the memory plan; MEGARL_CMD replaces `megarl train` (like
# the sbatch scripts); MEGARL_RAY_OBJECT_STORE_MB / MEGARL_RAY_NUM_CPUS / MEGARL_RAY_NUM_GPUS size
# the Ray head (--ray). On GPU machines the cluster environment of launch/slurm/common.sh applies.
set -euo pipefail
cd "$(dirname "$0")/.."
export MEGARL_HOME=$PWD
PY=${PYTHON:-python3}

with_ray=0 plan_only=0
while [[ "${1:-}" == --* ]]; do
  case "$1" in
    --ray) with_ray=1 ;;
    --plan-only) plan_only=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "local.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
recipe=${1:?usage: launch/local.sh [--ray|--plan-only] RECIPE [key=value ...]}
shift

source launch/slurm/common.sh
megarl_home
if command -v nvidia-smi >/dev/null 2>&1; then megarl_cluster_env; fi

if [[ "${MEGARL_SKIP_PLAN:-0}" != 1 || $plan_only == 1 ]]; then
  $MEGARL plan "$recipe" "$@" || { rc=$?; [[ $rc == 1 ]] && megarl_log "does not fit (MEGARL_SKIP_PLAN=1 runs anyway)"; exit $rc; }
fi
((plan_only)) && exit 0

extra=()
if ((with_ray)); then
  # A Ray head of our own, on free ports, stopped on exit (never `ray stop`: other Ray clusters on
  # this machine stay untouched).
  export MEGARL_RAY_TMPDIR=${MEGARL_RAY_TMPDIR:-/tmp/ray_local_$$}
  port=$(megarl_free_port)
  export RAY_ADDRESS="$(megarl_node_ip):$port"
  megarl_ray_auth
  bash launch/ray_bootstrap.sh head "$port" &
  ray_pid=$!
  trap 'kill -TERM $ray_pid 2>/dev/null; wait $ray_pid 2>/dev/null || true' EXIT
  megarl_wait_nodes 1 >/dev/null
  megarl_log "Ray head up at $RAY_ADDRESS"
  extra=(cluster.backend=ray cluster.ray_address=auto)
fi

if [[ -n "${MEGARL_CMD:-}" ]]; then
  megarl_run bash -c "$MEGARL_CMD"
else
  megarl_run $MEGARL train "$recipe" "$@" "${extra[@]}"
fi
