"""The phases a step has and what ``watchdog:`` may say about them.

Why here: the phase names are shared by the trainer (which times them), the watchdog (which bounds
them) and validation (which refuses an override naming no phase); config/ is what all three import.
"""
from __future__ import annotations

from typing import Any

# every phase the trainer times, in step order, plus the two that run between steps
PHASES = ("rollout", "release", "old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "train", "sync",
          "checkpoint", "eval")


def watchdog_problems(cfg: Any) -> list[str]:
    """One line per wrong ``watchdog.*`` or ``cluster.collective_timeout_s`` field."""
    w, problems = cfg.watchdog, []
    if w.factor < 1:
        problems.append(f"watchdog.factor: {w.factor} < 1 would expire a phase faster than it ran before")
    for name in ("first_step_s", "min_s"):
        if getattr(w, name) <= 0:
            problems.append(f"watchdog.{name}: {getattr(w, name)} must be > 0 seconds")
    for phase, seconds in w.phase_s.items():
        if phase not in PHASES:
            problems.append(f"watchdog.phase_s: no phase {phase!r}; phases are {', '.join(PHASES)}")
        elif isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            problems.append(f"watchdog.phase_s.{phase}: {seconds!r} must be a number of seconds > 0")
    if cfg.cluster.collective_timeout_s <= 0:
        problems.append(f"cluster.collective_timeout_s: {cfg.cluster.collective_timeout_s} must be > 0 seconds")
    return problems
