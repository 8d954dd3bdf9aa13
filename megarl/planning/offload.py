"""Which offload switches a colocated layout needs, from the memory plan.

Why a search: the switches trade host memory and copy time for GPU memory, in a known order of
cost. Optimizer states are touched once per mini-batch, gradients are only released (no copy),
parameters are needed by every pass, and the CPU optimizer moves the update itself to the host.
The first combination in that order whose plan fits is the one to use; ``megarl plan`` names it
and ``megarl train`` switches it on where the recipe left the switches unset (null).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

ROLES = ("actor", "critic", "ref", "reward_model", "teacher")
# cheapest first, by bytes copied per step: gradients are released (nothing copied), parameters
# are 2 bytes per parameter, the optimizer 12
KIND_ORDER = ((), ("grads",), ("params",), ("grads", "params"), ("optimizer",), ("grads", "optimizer"),
              ("params", "optimizer"), ("grads", "params", "optimizer"))
CPU_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


@dataclass
class OffloadChoice:
    switches: dict[str, tuple[str, ...]]               # role -> kinds switched on
    cpu_fraction: dict[str, float] = field(default_factory=dict)

    def apply(self, cfg: Any) -> None:
        for role, kinds in self.switches.items():
            for k in kinds:
                setattr(getattr(cfg, role).offload, k, True)
        for role, f in self.cpu_fraction.items():
            getattr(cfg, role).optim.cpu_offload_fraction = f

    def describe(self) -> str:
        parts = [f"{r}.offload.{k}=true" for r, kinds in self.switches.items() for k in kinds]
        parts += [f"{r}.optim.cpu_offload_fraction={f:g}" for r, f in self.cpu_fraction.items()]
        return " ".join(parts)


def _candidates(cfg: Any, only_unset: bool) -> list[OffloadChoice]:
    """Switch combinations, cheapest first: without a new CPU-optimizer fraction, then with each
    larger fraction (GPU bf16 runs); within each, by bytes copied. Frozen roles offload their
    parameters whenever trained roles do."""
    roles = [r for r in ROLES if r in cfg.megatron_roles]   # (a served teacher, a LoRA run's ref: no role)
    trained = [r for r in roles if r in cfg.trained_roles]

    def free(role: str, kind: str) -> bool:
        return not only_unset or getattr(getattr(cfg, role).offload, kind) is None

    fractions: list[dict[str, float]] = [{}]
    if cfg.cluster.device == "cuda" and cfg.model.dtype == "bfloat16":
        for f in CPU_FRACTIONS:
            more = {r: f for r in trained if getattr(cfg, r).optim.cpu_offload_fraction < f}
            if more:
                fractions.append(more)
    out = []
    for fraction in fractions:
        for kinds in KIND_ORDER:
            sw = {r: tuple(k for k in (kinds if r in trained else ("params",) if "params" in kinds else ())
                           if free(r, k)) for r in roles}
            out.append(OffloadChoice({r: k for r, k in sw.items() if k}, dict(fraction)))
    return out


def _fits(plan: Any) -> bool:
    """Memory fits (the node count is a separate question, answered by the plan itself)."""
    return not [p for p in plan.problems if not p.startswith("cluster.nodes")]


def offload_that_fits(cfg: Any, plan_fn: Callable[[Any], Any], only_unset: bool = False) -> Optional[OffloadChoice]:
    """The cheapest switch combination whose plan fits a colocated GPU layout, or None."""
    if cfg.placement.mode != "colocated" or cfg.cluster.device != "cuda":
        return None
    for choice in _candidates(cfg, only_unset):
        trial = copy.deepcopy(cfg)
        choice.apply(trial)
        _unset_to_off(trial)
        if _fits(plan_fn(trial)):
            return choice
    return None


def _unset_to_off(cfg: Any) -> None:
    for role in ROLES:
        o = getattr(cfg, role).offload
        for k in ("params", "grads", "optimizer"):
            if getattr(o, k) is None:
                setattr(o, k, False)


def resolve_offload(cfg: Any, plan_fn: Callable[[Any], Any]) -> Optional[str]:
    """Switches left null: on where the colocated layout needs them (the plan without them does
    not fit, with them it does), off otherwise. Returns the one line to print when it turned
    some on. Explicit true/false settings are kept."""
    unset = any(getattr(getattr(cfg, r).offload, k) is None
                for r in ROLES for k in ("params", "grads", "optimizer"))
    if not unset:
        return None
    trial = copy.deepcopy(cfg)
    _unset_to_off(trial)
    choice = None
    if cfg.placement.mode == "colocated" and cfg.cluster.device == "cuda" and not _fits(plan_fn(trial)):
        choice = offload_that_fits(cfg, plan_fn, only_unset=True)
    if choice is not None:
        choice.apply(cfg)
    _unset_to_off(cfg)
    if choice is None:
        return None
    return f"offload: the colocated layout needs it, switched on {choice.describe()} (set them to false to refuse)"
