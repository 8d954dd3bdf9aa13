"""What colocated rollout servers must keep while they lend their GPU memory to the trainer.

Why here: the launcher (which flags the servers get) and the memory planner (what the host must
hold) answer the same question from the config, and must answer it alike.
"""
from __future__ import annotations

from typing import Any


def adapter_push(cfg: Any) -> bool:
    """Does the trainer push LoRA adapters only (``actor.lora.push: adapter``)?"""
    return bool(cfg.actor.lora.rank) and cfg.actor.lora.push == "adapter"


def released_weights_resume_unpushed(cfg: Any) -> bool:
    """Do colocated servers take released weights back without a push in between? Then they must
    keep a host copy (``--enable-weights-cpu-backup``): a server drops released weights otherwise
    (SGLang's memory saver; the embedded engine alike). Adapter-only pushes never restore the
    base, and a reward model scoring a round releases the servers inside the rollout, whose next
    dynamic-sampling round resumes them unpushed. Every other release is followed by the step's
    full push before the next generation."""
    return (cfg.placement.mode == "colocated" and cfg.cluster.device == "cuda"
            and (adapter_push(cfg) or cfg.reward.kind == "model"))
