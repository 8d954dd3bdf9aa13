"""Shared set-up for end-to-end trainer tests: a tiny chat model and the default recipe shrunk."""
from __future__ import annotations

from pathlib import Path

from megarl.config import load_config
from tests.helpers.models import make_tiny_chat_model

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml"
ARCH_FROM_CONFIG_JSON = [f"model.arch.{k}=0" for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                        "num_attention_heads", "num_kv_heads", "vocab_size")] + [
    "model.arch.tie_word_embeddings=false"]


def tiny_model(tmp_root: Path) -> Path:
    return make_tiny_chat_model(tmp_root / "tinychat")


def tiny_overrides(model: Path, out: Path, *overrides: str) -> list[str]:
    """The dotted overrides that shrink the default recipe to the tiny model (also for a
    ``megarl train`` subprocess: ``python -m megarl train DEFAULT *tiny_overrides(...)``)."""
    base = [f"model.hf_path={model}", f"output_dir={out}", "trainer.total_steps=3", "data.num_train=64",
            "data.num_eval=8", "rollout.sampling.max_new_tokens=12", "batch.prompts_per_step=4",
            "batch.global_batch_size=8", "checkpoint.resume=none", "checkpoint.interval=0",
            "reward.kind=function", "data.source=reasoning_gym",
            "reward.function=tests.helpers.rewards:distinct_token_reward", "cluster.backend=local",
            "actor.optim.lr=1e-3"]
    return base + ARCH_FROM_CONFIG_JSON + list(overrides)


def tiny_agent_overrides(model: Path, out: Path, *overrides: str) -> list[str]:
    """An agent recipe shrunk to the tiny model: two prompts of four short multi-turn samples, the
    tests' tool parser (calls from a random model's turns)."""
    return [f"model.hf_path={model}", f"output_dir={out}", "data.num_train=32", "data.num_eval=4",
            "rollout.sampling.max_new_tokens=6", "batch.prompts_per_step=2", "rollout.n_per_prompt=4",
            "batch.global_batch_size=8", "checkpoint.resume=none", "checkpoint.interval=0", "checkpoint.export_hf=false",
            "cluster.backend=local", "actor.optim.lr=1e-3", "trainer.eval_before_after=false",
            "agent.tool_parser=tests.helpers.agent:mostly_call", "agent.max_response_tokens=120",
            *ARCH_FROM_CONFIG_JSON, *overrides]


def tiny_run_config(model: Path, out: Path, *overrides: str):
    return load_config(DEFAULT, tiny_overrides(model, out, *overrides))
