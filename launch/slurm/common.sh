# Shared by the sbatch scripts in this folder (sourced, not run). Bash only.
#
# What it does, in order, from inside an sbatch allocation:
#   megarl_home        find the checkout (MEGARL_HOME, else the submit dir, else the installed package)
#   megarl_cluster_env the environment users set on GPU clusters (each variable explained below)
#   megarl_ray_up      Ray head on the first node, one Ray worker per other node (srun steps),
#                      then wait until every node has joined
#   megarl_run CMD...  run the driver on the head node in the background, forwarding
#                      SIGTERM/SIGINT/SIGUSR1, requeue the job on the watchdog's exit code 75
#                      and after a time-limit stop (SIGUSR1, exit 0)
#                      (megarl_requeue_on), and return the driver's exit code
#   megarl_ray_down    SIGTERM to the Ray steps (each `ray start --block` stops its own node),
#                      installed as an EXIT trap, so it runs on success, failure and `scancel`
#
# sbatch copies the script itself into slurmd's spool dir, so the repo is found from
# SLURM_SUBMIT_DIR (submit from the repo root) or MEGARL_HOME, never from $0.

megarl_log() { echo "[megarl $(date +%H:%M:%S)] $*" >&2; }

megarl_home() {
  if [[ -n "${MEGARL_HOME:-}" ]]; then :
  elif [[ -f "${SLURM_SUBMIT_DIR:-.}/launch/ray_bootstrap.sh" ]]; then MEGARL_HOME=$SLURM_SUBMIT_DIR
  else
    MEGARL_HOME=$("${PYTHON:-python3}" -c 'import megarl, os; print(os.path.dirname(os.path.dirname(megarl.__file__)))' 2>/dev/null || true)
  fi
  if [[ ! -f "${MEGARL_HOME:-}/launch/ray_bootstrap.sh" ]]; then
    megarl_log "cannot find the megarl checkout: set MEGARL_HOME or submit from the repo root"
    exit 2
  fi
  export MEGARL_HOME
  MEGARL=${MEGARL:-"${PYTHON:-python3} -m megarl"}
}

megarl_cluster_env() {
  # --- NCCL -------------------------------------------------------------------------------
  # Fail a hung collective instead of waiting forever, and report why (megarl also sets its own
  # collective deadlines). ASYNC_ERROR_HANDLING is the pre-2.2 name of the same switch.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  # WARN shows transport choices and errors without flooding logs; INFO when debugging the fabric.
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  # InfiniBand/RoCE: which HCAs and which GID (RoCE v2 usually 3). Leave unset to let NCCL pick;
  # set per cluster, e.g. NCCL_IB_HCA=mlx5_0,mlx5_1,... NCCL_IB_GID_INDEX=3.
  # NCCL_SOCKET_IFNAME: interface for NCCL's bootstrap/TCP fallback (e.g. ib0, bond0, ^lo,docker).
  # Without it NCCL may pick a docker bridge and hang at init on multi-node jobs.
  [[ -n "${MEGARL_NCCL_IFNAME:-}" ]] && export NCCL_SOCKET_IFNAME=$MEGARL_NCCL_IFNAME GLOO_SOCKET_IFNAME=$MEGARL_NCCL_IFNAME
  # NVLS (NVLink SHARP multicast) needs fabric-manager support that many H100/H200 hosts lack;
  # it fails at communicator creation. Off unless the cluster is known to support it.
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  # Weight sync opens extra communicators next to the training ones: keep NCCL's per-communicator
  # memory modest (buffsize in bytes; NCCL's default is 4 MiB per channel-peer).
  export NCCL_BUFFSIZE=${NCCL_BUFFSIZE:-8388608}
  # --- CUDA -------------------------------------------------------------------------------
  # Megatron needs one hardware work queue so TP/SP communication kernels are scheduled in
  # issue order and overlap with compute (megatron asserts this with sequence parallel).
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  # Fewer fragmentation OOMs on long rollouts/variable-length micro-batches.
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  # --- caches -----------------------------------------------------------------------------
  # HF caches on shared storage so 24 nodes do not download the same 1.3 TB, and offline mode
  # so a compute node without internet fails fast instead of retrying the hub.
  export HF_HOME=${HF_HOME:-${MEGARL_SHARED:-$HOME}/.cache/huggingface}
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
  # Triton/torch.compile kernel caches are per node (node-local /tmp): a shared FS cache races.
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_${USER:-u}_${SLURM_JOB_ID:-0}}
  # Ray: no usage stats from compute nodes; do not let Ray dedup identical log lines across
  # ranks (hides which rank printed); Ray's own OOM killer off, SLURM/cgroups own memory.
  export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=${RAY_DEDUP_LOGS:-0}
  export RAY_memory_monitor_refresh_ms=${RAY_memory_monitor_refresh_ms:-0}
  # Python: unbuffered logs so `tail -f slurm-*.out` is live; no .pyc writes on a shared FS.
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  # --- containers -------------------------------------------------------------------------
  # pyxis/enroot clusters: set MEGARL_CONTAINER=/path/image.sqsh (or docker://...) and every srun
  # step runs in it with the repo mounted; MEGARL_CONTAINER_MOUNTS adds more (src:dst,...).
  # The batch step (the driver) runs where sbatch put it: submit the sbatch itself from inside
  # the container image, or set MEGARL_DRIVER_IN_CONTAINER=1 to run the driver as an srun step.
  MEGARL_SRUN_CONTAINER=()
  if [[ -n "${MEGARL_CONTAINER:-}" ]]; then
    MEGARL_SRUN_CONTAINER=(--container-image="$MEGARL_CONTAINER"
                           --container-mounts="$MEGARL_HOME:$MEGARL_HOME${MEGARL_CONTAINER_MOUNTS:+,$MEGARL_CONTAINER_MOUNTS}"
                           --container-workdir="$MEGARL_HOME")
  fi
  # Site hook: a file of exports/module loads sourced last (e.g. `module load cuda/12.4`).
  if [[ -n "${MEGARL_ENV_HOOK:-}" ]]; then
    # shellcheck disable=SC1090
    source "$MEGARL_ENV_HOOK"
  fi
}

# "8(x2),4" -> "8 8 4"
megarl_expand_counts() {
  local item out=() n c
  IFS=, read -ra items <<<"$1"
  for item in "${items[@]}"; do
    if [[ $item =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      c=${BASH_REMATCH[1]}; n=${BASH_REMATCH[2]}
      for ((i = 0; i < n; i++)); do out+=("$c"); done
    else
      out+=("$item")
    fi
  done
  echo "${out[@]}"
}

megarl_node_ip() {
  # The address other nodes reach this one at. `hostname --ip-address` gives 127.0.x.1 on many
  # Debian/Ubuntu images (hostname mapped in /etc/hosts); ask the routing table instead.
  "${PYTHON:-python3}" - <<'EOF'
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.connect(("10.255.255.255", 1)); print(s.getsockname()[0])
except OSError:
    print(socket.gethostbyname(socket.gethostname()))
EOF
}

megarl_free_port() {
  "${PYTHON:-python3}" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'
}

MEGARL_RAY_STEPS=()

# Ray >= 2.5x authenticates GCS clients with a token once ~/.ray/auth_token exists (any local
# `ray.init()` creates it), and a head, its workers and the driver that disagree about the mode
# fail with "InvalidAuthToken". Pin the mode for every process of the job: token auth with a
# fresh per-job token, passed to all srun steps and the driver through the environment (srun
# exports it), so nobody else on the network can submit work to this job's Ray cluster.
# MEGARL_RAY_AUTH=disabled opts out; a RAY_AUTH_TOKEN already set is kept.
megarl_ray_auth() {
  if [[ "${MEGARL_RAY_AUTH:-token}" == disabled ]]; then
    export RAY_AUTH_MODE=disabled
    unset RAY_AUTH_TOKEN
    return
  fi
  export RAY_AUTH_MODE=token
  if [[ -z "${RAY_AUTH_TOKEN:-}" ]]; then
    RAY_AUTH_TOKEN=$("${PYTHON:-python3}" -c 'import secrets; print(secrets.token_hex(32))')
    export RAY_AUTH_TOKEN
  fi
  unset RAY_AUTH_TOKEN_PATH
}

# megarl_ray_up INFO_JSON [NODE_POOL_FN]
#   INFO_JSON receives one JSON line once every node joined (address, nodes, CPUs, GPUs, resources).
#   NODE_POOL_FN, if given, is called with the node index and prints that node's pool name
#   (train | rollout): the node gets the Ray resource {"megarl_<pool>": its GPUs}.
megarl_ray_up() {
  local info=${1:?megarl_ray_up INFO_JSON [NODE_POOL_FN]} pool_fn=${2:-}
  mapfile -t MEGARL_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  read -ra cpus_per_node <<<"$(megarl_expand_counts "${SLURM_JOB_CPUS_PER_NODE:-1}")"
  local nnodes=${#MEGARL_NODES[@]} head=${MEGARL_NODES[0]}
  if [[ "${SLURMD_NODENAME:-$head}" != "$head" ]]; then
    megarl_log "batch step runs on $SLURMD_NODENAME but the first node is $head"
  fi
  MEGARL_HEAD_IP=${MEGARL_RAY_HEAD_IP:-$(megarl_node_ip)}
  MEGARL_RAY_PORT=${MEGARL_RAY_PORT:-$(megarl_free_port)}
  export MEGARL_RAY_DASHBOARD_PORT=${MEGARL_RAY_DASHBOARD_PORT:-$(megarl_free_port)}
  export MEGARL_RAY_TMPDIR=${MEGARL_RAY_TMPDIR:-/tmp/ray_${SLURM_JOB_ID}}
  export RAY_ADDRESS="$MEGARL_HEAD_IP:$MEGARL_RAY_PORT"
  megarl_ray_auth
  megarl_log "Ray head on $head ($RAY_ADDRESS), $((nnodes - 1)) worker node(s): ${MEGARL_NODES[*]}"
  trap megarl_ray_down EXIT
  local i node role target pool
  for ((i = 0; i < nnodes; i++)); do
    node=${MEGARL_NODES[$i]}
    if ((i == 0)); then role=head target=$MEGARL_RAY_PORT; else role=worker target=$RAY_ADDRESS; fi
    pool=""
    [[ -n "$pool_fn" ]] && pool=$($pool_fn "$i")
    # --overlap: the step shares CPUs/GPUs with the driver and later steps (Ray hands them out);
    # one task per node, with every CPU of that node so SLURM_CPUS_ON_NODE is right inside.
    MEGARL_RAY_POOL="$pool" srun --overlap --nodes=1 --ntasks=1 --cpus-per-task="${cpus_per_node[$i]:-${cpus_per_node[0]}}" \
      -w "$node" --job-name="megarl-ray-$role-$i" --kill-on-bad-exit=1 "${MEGARL_SRUN_CONTAINER[@]}" \
      bash "$MEGARL_HOME/launch/ray_bootstrap.sh" "$role" "$target" &
    MEGARL_RAY_STEPS+=($!)
    if ((i == 0)); then
      megarl_wait_nodes 1 >/dev/null || return 1   # workers need a live GCS to join
    fi
  done
  megarl_wait_nodes "$nnodes" >"$info"
}

megarl_wait_nodes() {
  local want=$1 timeout=${MEGARL_RAY_WAIT_S:-300}
  "${PYTHON:-python3}" - "$want" "$timeout" <<'EOF' || { megarl_log "Ray cluster did not come up"; return 1; }
import json, os, sys, time
want, timeout = int(sys.argv[1]), float(sys.argv[2])
deadline = time.time() + timeout
import ray
last = None
while time.time() < deadline:
    try:
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
        try:
            while time.time() < deadline:
                alive = [n for n in ray.nodes() if n["Alive"]]
                if len(alive) != last:
                    last = len(alive)
                    print(f"[megarl] Ray nodes alive: {last}/{want}", file=sys.stderr, flush=True)
                if len(alive) >= want:
                    res = ray.cluster_resources()
                    info = {"address": os.environ["RAY_ADDRESS"], "nodes": len(alive),
                            "cpus": res.get("CPU", 0), "gpus": res.get("GPU", 0),
                            "resources": {k: v for k, v in res.items() if not k.startswith("node:") and "memory" not in k},
                            "node_ips": sorted(n["NodeManagerAddress"] for n in alive)}
                    print(json.dumps(info), flush=True)
                    sys.exit(0)
                time.sleep(1)
        finally:
            ray.shutdown()
    except (ConnectionError, RuntimeError) as err:  # GCS not listening yet
        time.sleep(1)
sys.exit(1)
EOF
}

megarl_ray_down() {
  local rc=$?
  trap - EXIT
  if ((${#MEGARL_RAY_STEPS[@]})); then
    megarl_log "stopping Ray on ${#MEGARL_NODES[@]} node(s)"
    # SIGTERM to every process of the Ray steps (named megarl-ray-*): `ray start --block` stops
    # the processes it started (raylet, GCS, agents, workers) and exits, then srun returns.
    # (kill on srun would not do: srun turns SIGTERM into SIGKILL of the step.)
    local step
    for step in $(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2>/dev/null | awk '$2 ~ /^megarl-ray/ {print $1}'); do
      scancel --signal=TERM "$step" 2>/dev/null || true
    done
    local deadline=$((SECONDS + ${MEGARL_RAY_STOP_S:-30}))
    for pid in "${MEGARL_RAY_STEPS[@]}"; do
      while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
      kill -KILL "$pid" 2>/dev/null || true
    done
    MEGARL_RAY_STEPS=()
    megarl_log "Ray stopped"
  fi
  exit "$rc"
}

# megarl_preflight RECIPE [overrides...]: read the recipe's output_dir and pool sizes
# (MEGARL_OUTPUT_DIR, MEGARL_NODES, MEGARL_TRAIN_NODES, MEGARL_ROLLOUT_NODES, ...), check the
# allocation has enough nodes, and run `megarl plan` (exit 1 = does not fit; MEGARL_SKIP_PLAN=1
# skips it). All of this runs before any Ray process starts, so a wrong recipe costs seconds.
megarl_preflight() {
  local vars
  vars=$("${PYTHON:-python3}" -m megarl.planning.launch_info "$@") || exit 2
  eval "$vars"
  if ((SLURM_JOB_NUM_NODES < MEGARL_NODES)); then
    megarl_log "the recipe asks for cluster.nodes=$MEGARL_NODES but the job has $SLURM_JOB_NUM_NODES node(s): sbatch -N $MEGARL_NODES ..."
    exit 2
  fi
  if [[ "${MEGARL_SKIP_PLAN:-0}" != 1 ]]; then
    $MEGARL plan "$@" || { megarl_log "megarl plan: the recipe does not fit (MEGARL_SKIP_PLAN=1 launches anyway)"; exit 1; }
  fi
  mkdir -p "$MEGARL_OUTPUT_DIR"
}

# megarl_run CMD...: run the driver in the background so that signals (scancel sends SIGTERM to
# the batch shell; `#SBATCH --signal=B:USR1@300` sends USR1 before the time limit) reach the
# trap right away and are forwarded; bash would otherwise wait for the foreground child.
megarl_run() {
  megarl_log "driver: $*"
  "$@" &
  MEGARL_DRIVER=$!
  trap 'megarl_log "SIGTERM: stopping driver"; kill -TERM $MEGARL_DRIVER 2>/dev/null' TERM
  trap 'kill -INT $MEGARL_DRIVER 2>/dev/null' INT
  # SIGUSR1 (sent by `#SBATCH --signal=B:USR1@300` before the time limit) goes on to the driver:
  # `megarl train` checkpoints after the current step and exits 0. MEGARL_FORWARD_USR1=0 keeps it
  # (for MEGARL_CMD commands that do not handle USR1: Python's default action for it is to exit).
  # After such a stop (exit 0) the job is requeued to go on from that checkpoint (megarl_requeue_on).
  MEGARL_TIME_LIMIT_SEEN=0
  trap 'megarl_log "SIGUSR1: time limit near"; MEGARL_TIME_LIMIT_SEEN=1; [[ "${MEGARL_FORWARD_USR1:-1}" == 1 ]] && kill -USR1 $MEGARL_DRIVER 2>/dev/null' USR1
  local rc
  while true; do
    wait "$MEGARL_DRIVER" && rc=0 || rc=$?
    # wait returns >128 when a trapped signal interrupted it; the driver may still be running.
    kill -0 "$MEGARL_DRIVER" 2>/dev/null || break
  done
  trap - TERM INT USR1
  megarl_log "driver exited with $rc"
  megarl_requeue_on "$rc" "$MEGARL_TIME_LIMIT_SEEN"
  return "$rc"
}

# megarl_requeue_on RC: exit code 75 is the watchdog's (megarl/watchdog.py::REQUEUE_EXIT: a phase
# passed its deadline; stacks and the hung rank in OUTPUT_DIR/watchdog/). The job goes back to the
# queue and resumes from its last checkpoint (checkpoint.resume=auto), at most MEGARL_MAX_REQUEUES
# times (default 3; SLURM counts them in SLURM_RESTART_COUNT), so a hang that comes back every time
# ends the job instead of looping. Needs a requeueable job (#SBATCH --requeue in the train scripts).
# With TIME_LIMIT=1 (the driver stopped at SIGUSR1, before the time limit) an exit 0 is requeued too,
# without a cap: each such job makes progress, and a requeued run that has already finished ends
# at once without being requeued again.
megarl_requeue_on() {
  local rc=$1 time_limit=${2:-0} max=${MEGARL_MAX_REQUEUES:-3} done=${SLURM_RESTART_COUNT:-0}
  [[ -n "${SLURM_JOB_ID:-}" ]] || return 0
  if [[ "$rc" == 0 && "$time_limit" == 1 ]]; then
    megarl_log "stopped at the time limit: requeueing job $SLURM_JOB_ID to go on from its checkpoint"
    scontrol requeue "$SLURM_JOB_ID" || megarl_log "scontrol requeue $SLURM_JOB_ID failed"
    return 0
  fi
  [[ "$rc" == 75 ]] || return 0
  if ((done >= max)); then
    megarl_log "watchdog exit ($rc), job already requeued $done time(s) (MEGARL_MAX_REQUEUES=$max): not again"
    return 0
  fi
  megarl_log "watchdog exit ($rc): requeueing job $SLURM_JOB_ID ($((done + 1))/$max)"
  scontrol requeue "$SLURM_JOB_ID" || megarl_log "scontrol requeue $SLURM_JOB_ID failed"
}
