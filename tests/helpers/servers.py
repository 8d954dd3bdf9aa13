"""Helpers to run embedded rollout servers as real processes (tests, benchmarks, CPU runs)."""
from __future__ import annotations

import os
import sys
from typing import List, Optional

from megarl.wire.addresses import free_port

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def make_tiny_hf_model(path: str, family: str = "llama", seed: int = 0, std: float = 0.15, **overrides):
    """Save a random tiny HF model (hidden 64, 2 layers) of `family` to `path`; returns the HF model."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
    kw = dict(TINY, **overrides)
    if family == "llama":
        cfg = LlamaConfig(**kw)
    elif family == "qwen2":
        cfg = Qwen2Config(**kw)
    elif family == "qwen3":
        cfg = Qwen3Config(**{"head_dim": 16, **kw})
    elif family == "qwen3_moe":
        kw.setdefault("moe_intermediate_size", 32)
        kw.setdefault("num_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("norm_topk_prob", True)
        cfg = Qwen3MoeConfig(**{"head_dim": 16, **kw})
    else:
        raise ValueError(family)
    cfg.eos_token_id = kw.get("eos_token_id", None)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, std)
    m.save_pretrained(path)
    return m


class ServerProcess:
    """`python -m megarl.engine MODEL --port P` as a child process (a ``ServerHost``)."""

    def __init__(self, model: str, port: Optional[int] = None, extra: Optional[List[str]] = None,
                 threads: int = 1, env: Optional[dict] = None, log_path: Optional[str] = None):
        import tempfile

        from megarl.rollout.launch import ServerHost

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        e = dict(os.environ)
        e.setdefault("OMP_NUM_THREADS", str(threads))
        e["HF_HUB_OFFLINE"] = "1"
        e.update(env or {})
        cmd = [sys.executable, "-m", "megarl.engine", model, "--port", str(self.port),
               "--num-threads", str(threads)] + list(extra or [])
        self.host = ServerHost()
        self.host.start(cmd, e, log_path or tempfile.mktemp(prefix="megarl_server_", suffix=".log"))
        self.proc = self.host.proc

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        self.host.wait_healthy(self.url, timeout, poll_s=0.1)
        return self

    def stop(self):
        self.host.stop()

    def __enter__(self):
        return self.wait_ready()

    def __exit__(self, *exc):
        self.stop()
