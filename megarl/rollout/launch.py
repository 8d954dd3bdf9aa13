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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RolloutServers:
    """Owns the server processes of a run; ``urls`` is what the rollout client talks to."""

    def __init__(self, cfg: Any, model_dir: Path, log_dir: Path):
        r = cfg.rollout
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        if r.server_urls:
            self.urls = list(r.server_urls)
            return
        self.urls = []
        log_dir.mkdir(parents=True, exist_ok=True)
        self._cfg = cfg
        self._model_dir = model_dir
        for i in range(r.num_servers):
            log_path = log_dir / f"rollout_server_{i}.log"
            self.logs.append(log_path)
            self.procs.append(None)  # type: ignore[arg-type]
            self.urls.append("")
            self._start(i)

    def _command(self, i: int, port: int) -> tuple[list[str], str]:
        cfg, r, model_dir = self._cfg, self._cfg.rollout, self._model_dir
        context = r.max_prompt_len + r.sampling.max_new_tokens
        if r.engine == "embedded":
            cmd = [sys.executable, "-m", "megarl.rollout.server", str(model_dir), "--port", str(port),
                   "--max-running-requests", str(r.max_running_requests), "--context-length", str(context),
                   "--random-seed", str(cfg.seed + i), "--skip-tokenizer-init",
                   "--device", "cpu" if cfg.cluster.device == "cpu" else "cuda",
                   "--dtype", "float32" if cfg.cluster.device == "cpu" else "bfloat16"]
            if cfg.cluster.device == "cpu":
                return cmd + ["--num-threads", "2"], "1"
            return cmd, os.environ.get("OMP_NUM_THREADS", "4")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
               "--port", str(port), "--tp-size", str(r.tp), "--mem-fraction-static", str(r.mem_fraction),
               "--max-running-requests", str(r.max_running_requests), "--context-length", str(context),
               "--disable-radix-cache", "--skip-tokenizer-init", "--random-seed", str(cfg.seed + i)]
        if cfg.placement.mode == "colocated":
            cmd.append("--enable-memory-saver")
        return cmd, os.environ.get("OMP_NUM_THREADS", "4")

    def _start(self, i: int) -> None:
        port = _free_port()
        cmd, threads = self._command(i, port)
        env = dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.procs[i] = subprocess.Popen(cmd, env=env, stdout=self.logs[i].open("w"), stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.urls[i] = f"http://127.0.0.1:{port}"

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.time() + timeout_s
        restarts = 0
        for i in range(len(self.urls)):
            while True:
                url = self.urls[i]
                if self.procs and self.procs[i].poll() is not None:
                    tail = self.logs[i].read_text()[-2000:] if self.logs[i].exists() else ""
                    if "address already in use" in tail and restarts < 3:
                        restarts += 1  # the free port was taken before the server bound it
                        self._start(i)
                        continue
                    raise RuntimeError(f"rollout server {i} exited with code {self.procs[i].returncode}; "
                                       f"log {self.logs[i]}:\n{tail}")
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
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs = []
