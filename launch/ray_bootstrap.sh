#!/usr/bin/env bash
# Start one Ray node (head or worker) in the foreground, sized from what SLURM (or the machine)
# gives this node. Meant to run as one task per node under `srun` (see launch/slurm/common.sh),
# but works by hand too:
#
#   launch/ray_bootstrap.sh head   PORT               # prints nothing, blocks until SIGTERM
#   launch/ray_bootstrap.sh worker HEAD_IP:PORT
#
# It runs `ray start --block` and, on SIGTERM, lets it stop exactly the processes it started on
# this node (raylet, GCS, agents, workers). `scancel` sends SIGTERM to every process of every
# step; the sbatch trap does the same for the Ray steps only (`scancel --signal=TERM JOB.STEP`).
# Not `kill srun`: srun turns a SIGTERM it receives into a SIGKILL of the step, and forwards other
# signals to every process of the task, where Python's default action kills `ray start` unclean.
# We never call `ray stop`: it kills every Ray process on the host, including other jobs' on a
# shared node (and other test sessions on a CI box).
#
# Sizing (override any of them through the environment):
#   MEGARL_RAY_NUM_CPUS   default SLURM_CPUS_ON_NODE, else nproc
#   MEGARL_RAY_NUM_GPUS   default SLURM_GPUS_ON_NODE, else the count in CUDA_VISIBLE_DEVICES, else 0
#   MEGARL_RAY_OBJECT_STORE_MB   object store per node (default: Ray's, 30% of RAM); Ray's minimum
#                         is ~75 MB, CI uses 100
#   MEGARL_RAY_POOL       train | rollout: adds the custom resource {"megarl_<pool>": GPUs of this
#                         node} (the disaggregated sbatch marks its pools this way)
#   MEGARL_RAY_RESOURCES  JSON custom resources of this node (replaces the pool resource)
#   MEGARL_RAY_TMPDIR     Ray's --temp-dir (default /tmp/ray_$SLURM_JOB_ID): one per job so two
#                         jobs on one node never share sockets or session logs. Ray's unix socket
#                         paths must stay under 107 characters: keep it short.
#   MEGARL_RAY_DASHBOARD  1 (default) starts the dashboard on the head (needed by `ray job submit`)
set -euo pipefail

role=${1:?usage: ray_bootstrap.sh head PORT | worker HEAD_IP:PORT}
target=${2:?usage: ray_bootstrap.sh head PORT | worker HEAD_IP:PORT}
PY=${PYTHON:-python3}
RAY=${RAY:-ray}

count_visible() {  # "0,1,2" -> 3 ; "" -> 0
  local v=${1:-}
  [[ -z "$v" || "$v" == "NoDevFiles" ]] && { echo 0; return; }
  awk -F, '{print NF}' <<<"$v"
}

cpus=${MEGARL_RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
gpus=${MEGARL_RAY_NUM_GPUS:-${SLURM_GPUS_ON_NODE:-$(count_visible "${CUDA_VISIBLE_DEVICES:-}")}}
tmpdir=${MEGARL_RAY_TMPDIR:-/tmp/ray_${SLURM_JOB_ID:-$$}}
mkdir -p "$tmpdir"

# Ports of the per-node agents are fixed by default in Ray (52365, 8080, ...): two Ray nodes on
# one host (two jobs on a shared node, or the two fake slurmd nodes in CI) would collide, and the
# `--block` monitor then tears the whole node down. Pick free ones on this node instead.
read -r p_agent p_grpc p_metrics p_renv p_client p_dash < <("$PY" - <<'EOF'
import socket
socks = []
for _ in range(6):
    s = socket.socket(); s.bind(("", 0)); socks.append(s)
print(*[s.getsockname()[1] for s in socks])
EOF
)

args=(--block --disable-usage-stats --num-cpus="$cpus" --num-gpus="$gpus"
      --dashboard-agent-listen-port="$p_agent" --dashboard-agent-grpc-port="$p_grpc"
      --metrics-export-port="$p_metrics" --runtime-env-agent-port="$p_renv")
[[ -n "${MEGARL_RAY_OBJECT_STORE_MB:-}" ]] && args+=(--object-store-memory=$((MEGARL_RAY_OBJECT_STORE_MB * 1024 * 1024)))
if [[ -n "${MEGARL_RAY_RESOURCES:-}" ]]; then
  args+=(--resources="$MEGARL_RAY_RESOURCES")
elif [[ -n "${MEGARL_RAY_POOL:-}" ]]; then
  args+=(--resources="{\"megarl_${MEGARL_RAY_POOL}\": $((gpus > 0 ? gpus : cpus))}")
fi
[[ -n "${MEGARL_RAY_NODE_IP:-}" ]] && args+=(--node-ip-address="$MEGARL_RAY_NODE_IP")

# On SIGTERM, Ray >= 2.5x first "drains" the node (for Serve) for up to this many seconds before
# stopping; an RL job has nothing to drain, and the wait would eat SLURM's KillWait.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}

run_ray() {
  "$RAY" start "$@" &
  RAY_PID=$!
  STOPPING=0
  trap 'STOPPING=1; kill -TERM $RAY_PID 2>/dev/null' TERM INT
  local rc
  while true; do
    wait "$RAY_PID" && rc=0 || rc=$?
    kill -0 "$RAY_PID" 2>/dev/null || break
  done
  echo "[ray_bootstrap] ${SLURMD_NODENAME:-$(hostname)}: ray exited ($rc)" >&2
  # Ray's SIGTERM handler exits 1 after stopping its processes: a stop we asked for is clean.
  [[ $STOPPING == 1 ]] && rc=0
  return "$rc"
}

echo "[ray_bootstrap] $(hostname) slurm-node=${SLURMD_NODENAME:-?} role=$role${MEGARL_RAY_POOL:+ pool=$MEGARL_RAY_POOL} cpus=$cpus gpus=$gpus tmp=$tmpdir" >&2
case "$role" in
  head)
    if [[ "${MEGARL_RAY_DASHBOARD:-1}" == 1 ]]; then
      args+=(--include-dashboard=true --dashboard-host=0.0.0.0 --dashboard-port="${MEGARL_RAY_DASHBOARD_PORT:-$p_dash}")
    else
      args+=(--include-dashboard=false)
    fi
    run_ray --head --port="$target" --temp-dir="$tmpdir" --ray-client-server-port="$p_client" "${args[@]}"
    ;;
  worker)
    run_ray --address="$target" --temp-dir="$tmpdir" "${args[@]}"
    ;;
  *)
    echo "ray_bootstrap.sh: role must be head or worker, got '$role'" >&2
    exit 2
    ;;
esac
