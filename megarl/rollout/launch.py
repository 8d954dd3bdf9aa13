"""Start the rollout servers a run asks for: embedded servers (child processes) or SGLang.

Both speak the same HTTP API, so everything after start-up is engine-agnostic. SGLang servers
are launched with the flags RL trainers rely on (weights updated in place and pushed at start so
`--load-format dummy`, no radix cache so a new policy never reuses the old policy's KV, token ids
in and out, the run's API key through a 0600 `--config` file rather than argv), and with SGLang's
multi-node flags when one server's TP group spans nodes (`rollout.tp > cluster.gpus_per_node`).

Addresses: a server binds loopback unless a peer on another node must reach it (a multi-node Ray
cluster); then it binds its node's address as Ray reports it, and that is the URL peers dial.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megarl.config.colocation import adapter_push, released_weights_resume_unpushed
from megarl.config.loader import ConfigError
from megarl.config.served import served_quant_method
from megarl.config.validate import api_key_env_problem, max_sequence_len
from megarl.rollout.client import ServerDown

API_KEY_ENV = "MEGARL_API_KEY"  # what the embedded server reads its key from (never argv)
# read by SGLang's tokenizer manager: on SIGTERM, exit at once instead of finishing every request
SGLANG_FORCE_SHUTDOWN_ENV = "SGL_FORCE_SHUTDOWN"


def _set_parent_death_signal() -> None:
    """In the child, before exec: SIGTERM when the thread that started it dies (Linux), so a
    killed driver or Ray actor does not leave servers behind. The signal follows the spawning
    THREAD, not the process: servers are therefore always started from `_SPAWNER`'s one thread,
    which lives as long as this process (a restart from a short-lived worker thread would
    otherwise get its server killed when that thread ends)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the process-group kill in stop() still applies
        pass


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread every server process of this process is started from (see above)."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-server-spawner")
        return _SPAWNER


_SPAWNER: Optional[concurrent.futures.ThreadPoolExecutor] = None
_SPAWNER_LOCK = threading.Lock()


# Servers given by rollout.server_urls already run (nothing of theirs to wait for): one that does
# not answer /health within this grace is unreachable, a user error naming it.
EXTERNAL_HEALTH_S = 10.0


def answers_health(url: str, timeout_s: float = 2.0) -> bool:
    """Does the server at ``url`` answer ``/health`` with 200 now (no auth needed: SGLang leaves it open)?"""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


class PortTaken(RuntimeError):
    """The server could not bind its port: another process took the free port between
    `free_port` and the server's bind (the kernel hands the same ephemeral ports to any process)."""


def port_taken(log_tail: str, port: int) -> bool:
    """Does the log say the HTTP server could not bind ``port``? uvicorn (SGLang's and megarl's
    server) logs ``[Errno 98] error while attempting to bind on address ('h', port): address
    already in use`` -- and SGLang then hangs instead of exiting (its scheduler processes live on),
    so waiting for /health would wait for nothing until the timeout."""
    return any("address already in use" in line and str(port) in line for line in log_tail.splitlines())


def _url_port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


class ServerHost:
    """Runs one server process on the node where it lives. Used in-process for local runs, and as
    a Ray actor inside the rollout pool's placement group so servers land on rollout GPUs/nodes.
    The server gets its own process group: `stop` ends it with all its children (SGLang's
    scheduler and detokenizer processes)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def address(self, routable: bool) -> tuple[str, int]:
        """(address to bind and dial, a free port on it): this node's address as Ray reports it
        when peers on other nodes must reach the server, else loopback."""
        from megarl.wire.addresses import free_port
        from megarl.wire.addresses import node_address

        host = node_address() if routable else "127.0.0.1"
        return host, free_port(host)

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def node_id(self) -> str:
        """The Ray node this host runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def start(self, cmd: list[str], env: dict[str, str], log_path: str,
              private_files: Optional[dict[str, str]] = None) -> None:
        """Start `cmd`; `private_files` (path -> text) are written first with mode 0600 (the API
        key's `--config` file: on this node, readable by this user only)."""
        self.stop()
        for path, text in (private_files or {}).items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.proc = _spawner().submit(
                subprocess.Popen, cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_set_parent_death_signal).result()

    def pid(self) -> int | None:
        """The server's leader process (its process group's id), None when none was started."""
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def wait_healthy(self, url: str, timeout_s: float = 120.0, poll_s: float = 0.2) -> None:
        """Until `url`/health answers 200; raises with the log's tail if the process exits first,
        `PortTaken` as soon as its log says its port was taken (the caller starts it on another)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.poll() is not None:
                raise RuntimeError(f"server {url} exited with {self.poll()}:\n{self.log_tail(4000)}")
            if answers_health(url):
                return
            if port_taken(self.log_tail(4000), _url_port(url)):
                raise PortTaken(f"server {url}: its port was taken before it bound it:\n{self.log_tail(2000)}")
            time.sleep(poll_s)
        raise TimeoutError(f"server {url} not healthy after {timeout_s:.0f}s:\n{self.log_tail(4000)}")

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path and self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        group = self.proc.pid
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(group, sig)
                if sig == signal.SIGTERM:
                    os.killpg(group, signal.SIGCONT)  # a stopped (hung) server must run to handle SIGTERM
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                # the leader is gone; its children may linger a moment: clean the group too
                os.killpg(group, signal.SIGKILL)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                continue
            break
        self.proc = None


@dataclass(frozen=True)
class LaunchSpec:
    """Everything one server process of a run needs that differs between servers/nodes."""

    index: int                  # server number
    host: str                   # bind address (also what peers dial)
    port: int
    api_key_file: Optional[str] = None   # SGLang: the 0600 --config file holding the key
    node_rank: int = 0          # SGLang multi-node TP: which node of the server this process is
    nnodes: int = 1
    dist_init_addr: Optional[str] = None  # "host:port" of node rank 0 (nnodes > 1)
    tp_size: int = 0            # this server's TP size (0: rollout.tp)


def sglang_args(cfg: Any, model_dir: Path, spec: LaunchSpec) -> list[str]:
    """`sglang.launch_server` flags for one process of server `spec.index` (tested against
    SGLang 0.5.23's own argument parser: tests/test_sglang_conformance.py)."""
    r = cfg.rollout
    context = max_sequence_len(cfg)
    tp = spec.tp_size or r.tp
    args = ["--model-path", str(model_dir), "--host", spec.host, "--port", str(spec.port), "--tp-size", str(tp),
            "--mem-fraction-static", str(r.mem_fraction), "--max-running-requests", str(r.max_running_requests),
            "--context-length", str(context), "--dtype", rollout_dtype(cfg),
            # KV computed under older weights must never be reused by a newer policy
            "--disable-radix-cache",
            "--skip-tokenizer-init", "--random-seed", str(cfg.seed + spec.index)]
    # the trainer pushes its weights before the first rollout: no checkpoint read at start -- unless
    # only adapters are pushed, which then run on the base the server loads itself
    args += lora_server_args(cfg) or ["--load-format", "dummy"]
    if spec.api_key_file:
        args += ["--config", spec.api_key_file]
    if cfg.cluster.device == "cpu":
        args += ["--device", "cpu"]  # SGLang's CPU backend (and the CPU conformance harness)
    elif cfg.placement.mode == "colocated":
        args.append("--enable-memory-saver")  # /release_memory_occupation while the trainer trains
        if released_weights_resume_unpushed(cfg):
            args.append("--enable-weights-cpu-backup")
    if r.deterministic:
        args.append("--enable-deterministic-inference")  # sampling_seed honoured (batch-invariant kernels)
    if r.fp32_lm_head:
        args.append("--enable-fp32-lm-head")
    if wants_routed_experts(cfg):
        args.append("--enable-return-routed-experts")  # R3: meta_info.routed_experts per request
    quantization = served_quant_method(cfg, str(model_dir))
    if quantization:
        args += ["--quantization", quantization]   # the served checkpoint's own (block FP8: "fp8")
    if spec.nnodes > 1:
        args += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                 "--dist-init-addr", str(spec.dist_init_addr)]
    return args


def embedded_args(cfg: Any, model_dir: Path, spec: LaunchSpec, weights_dir: Path) -> list[str]:
    """`megarl.engine` flags for server `spec.index` (the API key travels in the
    environment, `MEGARL_API_KEY`)."""
    r = cfg.rollout
    cpu = cfg.cluster.device == "cpu"
    args = [str(model_dir), "--host", spec.host, "--port", str(spec.port),
            "--max-running-requests", str(r.max_running_requests),
            "--context-length", str(max_sequence_len(cfg)),
            "--random-seed", str(cfg.seed + spec.index), "--skip-tokenizer-init",
            "--device", "cpu" if cpu else "cuda", "--dtype", rollout_dtype(cfg),
            "--weights-dir", str(weights_dir)]
    tp = spec.tp_size or r.tp
    if tp > 1:
        args += ["--tp-size", str(tp)]
    if r.fp32_lm_head:
        args.append("--enable-fp32-lm-head")
    if wants_routed_experts(cfg):
        args.append("--enable-return-routed-experts")
    if adapter_push(cfg):
        args.append("--enable-lora")   # the base is the checkpoint the embedded server loads anyway
    if released_weights_resume_unpushed(cfg):   # (GPU runs only)
        args.append("--enable-weights-cpu-backup")
    if cpu:
        args += ["--num-threads", "2"]
    return args


def lora_server_args(cfg: Any) -> list[str]:
    """SGLang 0.5.23's LoRA flags (``arg_groups/fields/lora.py``) for adapter-only pushes: adapters
    are loaded at run time (no ``--lora-paths``), so the rank and target modules must be given up
    front (SGLang sizes its adapter memory pool from them); the base weights come from the
    checkpoint (``--load-format auto``), as only adapters are ever pushed. Empty otherwise."""
    if not adapter_push(cfg):
        return []
    lo = cfg.actor.lora
    return ["--load-format", "auto", "--enable-lora", "--max-lora-rank", str(lo.rank),
            "--lora-target-modules", *sorted(lo.target_modules)]


def wants_routed_experts(cfg: Any) -> bool:
    """Do the servers record routed experts? ``rollout.return_routed_experts``; null = for MoE
    models (the trainer replays them with ``algorithm.routing_replay: rollout`` and reports its
    agreement with them either way)."""
    flag = cfg.rollout.return_routed_experts
    return bool(cfg.model.arch.num_experts) if flag is None else bool(flag)


def rollout_dtype(cfg: Any, fp8_weights: bool = False) -> str:
    """The rollout servers' dtype: fp32 on CPU (as the trainer there); the trainer's dtype on GPU.
    ``fp8_weights``: the label of the step-0 check's noise floor gains ``+fp8_block`` (block-FP8
    weights computed in that dtype; ``megarl.algos.fidelity``)."""
    dtype = "float32" if cfg.cluster.device == "cpu" else str(cfg.model.dtype)
    return dtype + "+fp8_block" if fp8_weights else dtype


def default_command(engine: str) -> list[str]:
    module = "sglang.launch_server" if engine == "sglang" else "megarl.engine"
    return [sys.executable, "-m", module]


def resolve_api_key(cfg: Any) -> Optional[str]:
    """The run's API key: the environment variable `rollout.api_key_env` names when set; else a
    fresh random key for servers megarl starts; servers given by URL get no key unless one is set
    (their operator chose it)."""
    problem = api_key_env_problem(cfg)
    if problem:
        raise ConfigError([problem])
    key = os.environ.get(cfg.rollout.api_key_env) if cfg.rollout.api_key_env else None
    if key:
        return key
    # hex: a generated key must never start with '-' (SGLang turns its --config file into argv, and
    # argparse reads "--api-key -x..." as a missing value) nor look like a YAML number or boolean
    return None if cfg.rollout.server_urls else secrets.token_hex(32)


def sglang_key_file_text(key: str) -> str:
    """The 0600 --config file SGLang reads its key from (never argv, where `ps` shows it); the
    value is a JSON string, which YAML reads back verbatim whatever characters the key has."""
    return f"api-key: {json.dumps(key)}\n"


class RolloutServers:
    """Owns the server processes of a run; ``urls`` is what the rollout client talks to,
    ``tp_sizes`` each server's TP size (``rollout.server_tp``, else ``rollout.tp``), ``api_key``
    the key every request must carry.

    ``placement=(placement_group, first_bundle)`` starts server ``i`` through Ray actors on bundles
    ``first_bundle + sum(tp_sizes[:i]) ...`` with the GPUs of its bundles made visible to it
    (rollout nodes in a disaggregated run, the shared GPUs in a colocated one), one actor per node
    when the server's TP group spans nodes; without it servers are child processes of the driver
    (local runs, CPU). ``restart(i)`` starts server ``i`` again through the same actors (same
    bundles, same node), at a fresh port."""

    def __init__(self, cfg: Any, model_dir: Path, log_dir: Path, placement: tuple[Any, int] | None = None,
                 env: Optional[dict[str, str]] = None):
        """``env``: more environment for every server process (e.g. its CUDA MPS share)."""
        from megarl.config.validate import server_tp_sizes

        r = cfg.rollout
        self.hosts: list[list[Any]] = []        # per server: one host per node of its TP group
        self.logs: list[Path] = []
        self._ray = placement is not None
        self.api_key = resolve_api_key(cfg)
        self.weights_dir = Path(cfg.output_dir) / "weights_sync"   # the disk transport's folder
        self.tp_sizes = server_tp_sizes(cfg)
        self.lora_name: Optional[str] = None   # adapter-only pushes: the adapter every /generate names
        if r.server_urls:
            self.urls = list(r.server_urls)
            return
        self.urls = []
        log_dir.mkdir(parents=True, exist_ok=True)
        self._cfg = cfg
        self._model_dir = model_dir
        self._log_dir = log_dir
        self._env = dict(env or {})
        self._gpus: list[list[list[str]]] = []
        self._routable = self._ray and _ray_nodes() > 1
        for i in range(len(self.tp_sizes)):
            self.logs.append(log_dir / f"rollout_server_{i}.log")
            self.urls.append("")
            hosts, gpus = self._make_hosts(i, placement)
            self.hosts.append(hosts)
            self._gpus.append(gpus)
            self._start(i)

    @property
    def restartable(self) -> bool:
        """Whether megarl owns the server processes (servers given by URL are someone else's)."""
        return bool(self.hosts)

    # ------------------------------------------------------------------ placement
    def _nodes_per_server(self, i: int) -> int:
        tp, per_node = self.tp_sizes[i], self._cfg.cluster.gpus_per_node
        if self._cfg.rollout.engine != "sglang" or not per_node or tp <= per_node:
            return 1
        return -(-tp // per_node)

    def _make_hosts(self, i: int, placement: tuple[Any, int] | None) -> tuple[list[Any], list[list[str]]]:
        """One host per node of server i (GPU ids of each)."""
        if placement is None:
            return [ServerHost()], [[]]
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, first = placement
        tp, nnodes = self.tp_sizes[i], self._nodes_per_server(i)
        start = first + sum(self.tp_sizes[:i])
        per_node = tp // nnodes
        gpu = 0.01 if self._cfg.cluster.device == "cuda" else 0
        remote = ray.remote(ServerHost)

        def on_bundle(b: int):
            index = start + b
            if index >= pg.bundle_count:  # more servers than the pool has bundles (CPU runs): anywhere
                return remote.options(num_cpus=0.01)
            return remote.options(num_cpus=0.01, num_gpus=gpu, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index))

        hosts, gpus = [], []
        for node in range(nnodes):
            host = on_bundle(node * per_node).remote()
            probes = [on_bundle(node * per_node + b).remote() for b in range(1, per_node)]
            ids = ray.get(host.gpu_ids.remote()) + [g for p in probes for g in ray.get(p.gpu_ids.remote())]
            where = ray.get([h.node_id.remote() for h in [host, *probes]])
            for p in probes:
                ray.kill(p)
            hosts.append(host)
            gpus.append(ids)
            if len(set(where)) > 1:
                # the server's ranks run where its first bundle is: the GPUs (and, colocated, the trainer
                # ranks whose IPC handles they open) of bundles on other nodes are not theirs
                from megarl.placement.pools import PlacementError

                for h in hosts:
                    ray.kill(h)
                first_b = start + node * per_node
                raise PlacementError(
                    f"rollout server {i} (TP {tp}): its bundles {first_b}..{first_b + per_node - 1} were placed on "
                    f"{len(set(where))} different Ray nodes; one server's ranks on a node need their bundles on that "
                    f"node (a TP size that divides the GPUs per node, or rollout.server_tp)")
        return hosts, gpus

    def _do(self, i: int, node: int, method: str, *args):
        host = self.hosts[i][node]
        if self._ray:
            import ray

            return ray.get(getattr(host, method).remote(*args))
        return getattr(host, method)(*args)

    # ------------------------------------------------------------------ start / health
    def _start(self, i: int) -> None:
        cfg, r = self._cfg, self._cfg.rollout
        nnodes = len(self.hosts[i])
        host, port = self._do(i, 0, "address", self._routable or nnodes > 1)
        dist_init = None
        if nnodes > 1:
            dist_host, dist_port = self._do(i, 0, "address", True)
            dist_init = f"{dist_host}:{dist_port}"
        command = list(r.server_command) or default_command(r.engine)
        threads = "1" if cfg.cluster.device == "cpu" else os.environ.get("OMP_NUM_THREADS", "4")
        env = dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   **self._env)
        for node in range(nnodes):
            spec_host = host if node == 0 else self._do(i, node, "address", True)[0]
            private: dict[str, str] = {}
            node_env = dict(env)
            if r.engine == "sglang":
                # SGLang drains its requests on SIGTERM before exiting (TokenizerManager.sigterm_watchdog);
                # a server megarl stops, or whose trainer died (PR_SET_PDEATHSIG), has no one to answer
                node_env.setdefault(SGLANG_FORCE_SHUTDOWN_ENV, "1")
                key_file = None
                if self.api_key:
                    key_file = str(self._log_dir / f"sglang_server_{i}_node{node}.yaml")
                    private[key_file] = sglang_key_file_text(self.api_key)
                spec = LaunchSpec(i, spec_host, port, key_file, node, nnodes, dist_init, self.tp_sizes[i])
                cmd = command + sglang_args(cfg, self._model_dir, spec)
            else:
                if self.api_key:
                    node_env[API_KEY_ENV] = self.api_key
                spec = LaunchSpec(i, spec_host, port, tp_size=self.tp_sizes[i])
                cmd = command + embedded_args(cfg, self._model_dir, spec, self.weights_dir)
            if self._gpus[i][node]:
                node_env["CUDA_VISIBLE_DEVICES"] = ",".join(self._gpus[i][node])
            log = self.logs[i] if node == 0 else self.logs[i].with_name(f"{self.logs[i].stem}_node{node}.log")
            self._do(i, node, "start", cmd, node_env, str(log), private)
        self.urls[i] = f"http://{_url_host(host)}:{port}"

    def wait_healthy(self, timeout_s: float = 300.0, only: Optional[list[int]] = None) -> None:
        """Wait until every server (or those in ``only``) answers /health; a server whose process
        exits fails at once with its log's tail. One whose free port was taken meanwhile is started
        again on another port, at most 3 times: whether it exited (the embedded server) or hangs
        after uvicorn's bind error (SGLang, whose scheduler processes keep it alive)."""
        started = time.time()
        deadline = started + timeout_s
        restarts = 0
        for i in (range(len(self.urls)) if only is None else only):
            while True:
                url = self.urls[i]
                codes = [self._do(i, n, "poll") for n in range(len(self.hosts[i]))] if self.hosts else []
                failed = next((n for n, c in enumerate(codes) if c is not None), None)
                running_tail = (self._do(i, 0, "log_tail", 4000)
                                if self.hosts and failed is None and restarts < 3 else "")
                taken = port_taken(running_tail, _url_port(url))
                if taken or failed is not None:
                    tail = running_tail if taken else self._do(i, failed, "log_tail")
                    if taken or ("address already in use" in tail and restarts < 3):
                        restarts += 1  # the free port was taken before the server bound it
                        self._stop_server(i)
                        self._start(i)
                        continue
                    raise RuntimeError(f"rollout server {i} (node {failed} of its TP group) exited with code "
                                       f"{codes[failed]}; log {self.logs[i]}:\n{tail}")
                if answers_health(url):
                    break
                if not self.hosts and time.time() > started + EXTERNAL_HEALTH_S:
                    raise ServerDown(url, f"does not answer /health within {EXTERNAL_HEALTH_S:g}s; rollout.server_urls "
                                          f"must name servers that already run")
                if time.time() > deadline:
                    raise TimeoutError(f"rollout server {url} not healthy after {timeout_s:.0f}s; log {self.logs[i]}")
                time.sleep(0.2)

    def _stop_server(self, i: int) -> None:
        """Stop server ``i`` on every node of its TP group (its whole process group, also when it hangs)."""
        for node in range(len(self.hosts[i])):
            self._do(i, node, "stop")

    def restart(self, i: int, timeout_s: float = 300.0) -> str:
        """Stop server ``i`` (its whole process group, also when it hangs) and start it again on its
        placement -- the same host actors, so the same bundles and node -- at a fresh port; returns
        its new URL once it answers /health. The restarted server holds the checkpoint's weights
        (or dummy ones for SGLang): the caller pushes the current ones."""
        if not self.restartable:
            raise RuntimeError(f"rollout server {self.urls[i]} was given by rollout.server_urls: megarl cannot restart it")
        self._stop_server(i)
        self._start(i)
        self.wait_healthy(timeout_s, only=[i])
        return self.urls[i]

    def pid(self, i: int, node: int = 0) -> Optional[int]:
        """Process id of server ``i``'s process on ``node`` of its TP group (its process group)."""
        return self._do(i, node, "pid") if self.hosts else None

    def stop(self) -> None:
        for i in range(len(self.hosts)):
            for node in range(len(self.hosts[i])):
                try:
                    self._do(i, node, "stop")
                except Exception:  # noqa: BLE001 - teardown of a dead Ray actor
                    pass
        if self._ray:
            import ray

            for hosts in self.hosts:
                for host in hosts:
                    ray.kill(host)
        self.hosts = []


def _ray_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
