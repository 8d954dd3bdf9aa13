"""A judge model megarl serves itself (``reward.judge.model_path`` without ``server_url``).

Why: a judge is one more inference server, and the rollout's launcher already knows how to start
one as a child process that dies with the driver (``ServerHost``), with the API key kept out of
argv. The judge differs from a rollout server in what it loads and keeps: its own checkpoint, read
at start (no ``--load-format dummy``, no weight pushes), token ids in and out (the client
tokenizes with the judge's tokenizer), its own fresh API key. CPU runs serve it on the CPU; GPU
runs name its GPUs (``reward.judge.devices``), which the run's pools must not use.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from megarl.rollout.launch import (API_KEY_ENV, SGLANG_FORCE_SHUTDOWN_ENV, ServerHost, default_command,
                                   sglang_key_file_text)


def judge_engine(cfg: Any) -> str:
    """``reward.judge.engine``: ``auto`` serves the judge with the rollout's engine."""
    engine = cfg.reward.judge.engine
    return cfg.rollout.engine if engine == "auto" else engine


def judge_server_args(cfg: Any, model_dir: str, host: str, port: int, key_file: str | None) -> list[str]:
    """The judge server's flags: SGLang's ``launch_server`` or ``megarl serve`` (the embedded
    engine reads its key from ``MEGARL_API_KEY``; SGLang from the 0600 ``key_file``)."""
    j = cfg.reward.judge
    cpu = cfg.cluster.device == "cpu"
    tp = max(1, len(j.devices))
    if judge_engine(cfg) == "sglang":
        args = ["--model-path", model_dir, "--host", host, "--port", str(port), "--tp-size", str(tp),
                "--context-length", str(j.context_length), "--max-running-requests", str(j.max_concurrency * j.batch_size),
                "--skip-tokenizer-init", "--random-seed", str(cfg.seed)]
        if key_file:
            args += ["--config", key_file]
        return args + (["--device", "cpu"] if cpu else [])
    args = [model_dir, "--host", host, "--port", str(port), "--context-length", str(j.context_length),
            "--max-running-requests", str(j.max_concurrency * j.batch_size), "--skip-tokenizer-init",
            "--random-seed", str(cfg.seed), "--device", "cpu" if cpu else "cuda"]
    if tp > 1:
        args += ["--tp-size", str(tp)]
    return args + (["--num-threads", "2"] if cpu else [])


class JudgeServer:
    """One judge server process: ``url`` and ``api_key`` for the client, ``wait_healthy``, ``stop``."""

    def __init__(self, cfg: Any, model_dir: str, log_dir: Path):
        self.host = ServerHost()
        address, port = self.host.address(False)   # the driver talks to it: loopback
        self.api_key = secrets.token_hex(32)
        self.log = log_dir / "judge_server.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS="1" if cfg.cluster.device == "cpu" else os.environ.get("OMP_NUM_THREADS", "4"))
        devices = cfg.reward.judge.devices
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        private: dict[str, str] = {}
        key_file = None
        if judge_engine(cfg) == "sglang":
            env.setdefault(SGLANG_FORCE_SHUTDOWN_ENV, "1")
            key_file = str(log_dir / "judge_server.yaml")
            private[key_file] = sglang_key_file_text(self.api_key)
        else:
            env[API_KEY_ENV] = self.api_key
        command = default_command(judge_engine(cfg)) + judge_server_args(cfg, model_dir, address, port, key_file)
        self.host.start(command, env, str(self.log), private)
        self.url = f"http://{address}:{port}"

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Until it answers /health; a server that exits first raises with its log's tail."""
        self.host.wait_healthy(self.url, timeout_s)

    def stop(self) -> None:
        self.host.stop()
