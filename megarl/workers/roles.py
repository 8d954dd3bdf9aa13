"""The Megatron roles of a run, started from the config: which exist, what each trains.

Why here: the trainer only names the roles it uses; what a role is made of (trainable or frozen,
with a value head or an LM head) and where its ranks go is decided once, from the config and the
run's placement.
"""
from __future__ import annotations

from typing import Any

from megarl.metrics_log import note
from megarl.workers.group import WorkerGroup

# role -> (trainable, value head)
ROLES = {"actor": (True, False), "ref": (False, False), "critic": (True, True), "reward_model": (False, True)}


def start_roles(cfg: Any, placement: Any) -> dict[str, WorkerGroup]:
    """Every enabled role's ranks, set up (model built and loaded, optimizer for trainable roles)."""
    groups: dict[str, WorkerGroup] = {}
    for role, (trainable, value_head) in ROLES.items():
        if not getattr(cfg, role).enabled:
            continue
        pg, share = placement.role(role)
        group = WorkerGroup(role, cfg, backend=cfg.cluster.backend, trainable=trainable, value_head=value_head,
                            placement_group=pg, share=share)
        info = group.call("setup")
        note(f"{role}: {role_layout(getattr(cfg, role))}, {info[0]['params'] / 1e6:.1f}M params on rank 0")
        groups[role] = group
    return groups


def role_layout(role_cfg: Any) -> str:
    p = role_cfg.parallel
    return f"{role_cfg.gpus} rank(s) tp{p.tp} pp{p.pp}" + (f" ep{p.ep}" if p.ep > 1 else "")
