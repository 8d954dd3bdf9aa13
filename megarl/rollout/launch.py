"""Start the rollout servers a run asks for: embedded servers (child processes) or SGLang.

Both speak the same HTTP API, so everything after start-up is engine-agnostic. SGLang servers
are launched with the flags RL trainers rely on (weights updated in place, no radix cache so a
new policy never reuses the old policy's KV, token ids in and out).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from megarl.parallel.launcher import free_port


class ServerHost:
    """Runs one server process on the node where it lives. Used in-process for local runs, and as
    a Ray actor inside the rollout pool's placement group so servers land on rollout GPUs/nodes."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def address(self) -> tuple[str, int]:
        """(this node's IP, a free port on it)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return socket.gethostbyname(socket.gethostname()), port

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def start(self, cmd: list[str], env: dict[str, str], log_path: str) -> None:
        self.stop()
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path and self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


class RolloutServers:
    """Owns the server processes of a run; ``urls`` is what the rollout client talks to.

    ``placement=(placement_group, first_bundle)`` starts server ``i`` through a Ray actor on bundle
    ``first_bundle + i * rollout.tp`` with the GPUs of its ``tp`` bundles made visible to it (rollout
    nodes in a disaggregated run, the shared GPUs in a colocated one); without it servers are
    child processes of the driver (local runs, CPU)."""

    def __init__(self, cfg: Any, model_dir: Path, log_dir: Path, placement: tuple[Any, int] | None = None):
        r = cfg.rollout
        self.hosts: list[Any] = []
        self.logs: list[Path] = []
        self._ray = placement is not None
        if r.server_urls:
            self.urls = list(r.server_urls)
            return
        self.urls = []
        log_dir.mkdir(parents=True, exist_ok=True)
        self._cfg = cfg
        self._model_dir = model_dir
        self._gpus: list[list[str]] = []
        for i in range(r.num_servers):
            self.logs.append(log_dir / f"rollout_server_{i}.log")
            self.urls.append("")
            host, gpus = self._make_host(i, placement)
            self.hosts.append(host)
            self._gpus.append(gpus)
            self._start(i)

    def _make_host(self, i: int, placement: tuple[Any, int] | None) -> tuple[Any, list[str]]:
        if placement is None:
            return ServerHost(), []
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, first = placement
        tp = self._cfg.rollout.tp
        gpu = 0.01 if self._cfg.cluster.device == "cuda" else 0
        remote = ray.remote(ServerHost)

        def on_bundle(b: int):
            index = first + i * tp + b
            if index >= pg.bundle_count:  # more servers than the pool has bundles (CPU runs): anywhere
                return remote.options(num_cpus=0.01)
            return remote.options(num_cpus=0.01, num_gpus=gpu, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index))

        probes = [on_bundle(b).remote() for b in range(1, tp)]
        gpus = [g for p in probes for g in ray.get(p.gpu_ids.remote())]
        for p in probes:
            ray.kill(p)
        host = on_bundle(0).remote()
        return host, ray.get(host.gpu_ids.remote()) + gpus

    def _do(self, i: int, method: str, *args):
        host = self.hosts[i]
        if self._ray:
            import ray

            return ray.get(getattr(host, method).remote(*args))
        return getattr(host, method)(*args)

    def _command(self, i: int, host: str, port: int) -> tuple[list[str], str]:
        cfg, r, model_dir = self._cfg, self._cfg.rollout, self._model_dir
        context = r.max_prompt_len + r.sampling.max_new_tokens
        if r.engine == "embedded":
            cmd = [sys.executable, "-m", "megarl.rollout.server", str(model_dir), "--host", host, "--port", str(port),
                   "--max-running-requests", str(r.max_running_requests), "--context-length", str(context),
                   "--random-seed", str(cfg.seed + i), "--skip-tokenizer-init",
                   "--device", "cpu" if cfg.cluster.device == "cpu" else "cuda",
                   "--dtype", "float32" if cfg.cluster.device == "cpu" else "bfloat16"]
            if cfg.cluster.device == "cpu":
                return cmd + ["--num-threads", "2"], "1"
            return cmd, os.environ.get("OMP_NUM_THREADS", "4")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", host,
               "--port", str(port), "--tp-size", str(r.tp), "--mem-fraction-static", str(r.mem_fraction),
               "--max-running-requests", str(r.max_running_requests), "--context-length", str(context),
               "--disable-radix-cache", "--skip-tokenizer-init", "--random-seed", str(cfg.seed + i)]
        if cfg.placement.mode == "colocated":
            cmd.append("--enable-memory-saver")
        return cmd, os.environ.get("OMP_NUM_THREADS", "4")

    def _start(self, i: int) -> None:
        host, port = self._do(i, "address") if self._ray else ("127.0.0.1", free_port())
        cmd, threads = self._command(i, host, port)
        env = dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        if self._gpus and self._gpus[i]:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self._gpus[i])
        self._do(i, "start", cmd, env, str(self.logs[i]))
        self.urls[i] = f"http://{host}:{port}"

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.time() + timeout_s
        restarts = 0
        for i in range(len(self.urls)):
            while True:
                url = self.urls[i]
                code = self._do(i, "poll") if self.hosts else None
                if code is not None:
                    tail = self._do(i, "log_tail")
                    if "address already in use" in tail and restarts < 3:
                        restarts += 1  # the free port was taken before the server bound it
                        self._start(i)
                        continue
                    raise RuntimeError(f"rollout server {i} exited with code {code}; log {self.logs[i]}:\n{tail}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if time.time() > deadline:
                    raise TimeoutError(f"rollout server {url} not healthy after {timeout_s:.0f}s")
                time.sleep(0.2)

    def stop(self) -> None:
        for i in range(len(self.hosts)):
            try:
                self._do(i, "stop")
            except Exception:  # noqa: BLE001 - teardown of a dead Ray actor
                pass
        if self._ray:
            import ray

            for host in self.hosts:
                ray.kill(host)
        self.hosts = []
