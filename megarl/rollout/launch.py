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
        context = r.max_prompt_len + r.sampling.max_new_tokens
        log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(r.num_servers):
            port = _free_port()
            if r.engine == "embedded":
                cmd = [sys.executable, "-m", "megarl.rollout.server", str(model_dir), "--port", str(port),
                       "--max-running-requests", str(r.max_running_requests), "--context-length", str(context),
                       "--random-seed", str(cfg.seed + i), "--skip-tokenizer-init",
                       "--device", "cpu" if cfg.cluster.device == "cpu" else "cuda",
                       "--dtype", "float32" if cfg.cluster.device == "cpu" else "bfloat16"]
                threads = "1" if cfg.cluster.device == "cpu" else os.environ.get("OMP_NUM_THREADS", "4")
                if cfg.cluster.device == "cpu":
                    cmd += ["--num-threads", "2"]
            else:
                cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
                       "--port", str(port), "--tp-size", str(r.tp), "--mem-fraction-static", str(r.mem_fraction),
                       "--max-running-requests", str(r.max_running_requests), "--context-length", str(context),
                       "--disable-radix-cache", "--skip-tokenizer-init", "--random-seed", str(cfg.seed + i),
                       "--enable-memory-saver" if cfg.placement.mode == "colocated" else "--disable-custom-all-reduce"]
                threads = os.environ.get("OMP_NUM_THREADS", "4")
            env = dict(os.environ, OMP_NUM_THREADS=threads, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
            log_path = log_dir / f"rollout_server_{i}.log"
            self.logs.append(log_path)
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                                               start_new_session=True))
            self.urls.append(f"http://127.0.0.1:{port}")

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.time() + timeout_s
        for i, url in enumerate(self.urls):
            while True:
                if self.procs and self.procs[i].poll() is not None:
                    tail = self.logs[i].read_text()[-2000:] if self.logs[i].exists() else ""
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
