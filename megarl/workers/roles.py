"""The Megatron roles of a run, started from the config: which exist, what each trains.

Why here: the trainer only names the roles it uses; what a role is made of (trainable or frozen,
with a value head or an LM head) and where its ranks go is decided once, from the config and the
run's placement.
"""
from __future__ import annotations

from typing import Any

from megarl.metrics_log import note
from megarl.workers.group import WorkerGroup

# role -> (trainable, value head); the teacher (on-policy distillation) is a frozen LM of its own
# network (teacher.model_path), scored like the reference
ROLES = {"actor": (True, False), "ref": (False, False), "critic": (True, True), "reward_model": (False, True),
         "teacher": (False, False)}


class BaseReference:
    """The reference role of a LoRA run: the actor's own ranks with the adapters off (no second
    copy of the model). Answers the one call the trainer makes of a reference."""

    role = "ref"

    def __init__(self, actor: WorkerGroup):
        self.actor = actor

    def forward(self, method: str, batch: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if method != "compute_logprobs":
            raise ValueError(f"the LoRA reference answers compute_logprobs only, not {method!r}")
        return self.actor.forward("compute_ref_logprobs", batch, *args, **kwargs)

    def shutdown(self) -> None:
        """Nothing of its own to stop: the actor group owns the ranks."""


def start_roles(cfg: Any, placement: Any) -> dict[str, Any]:
    """Every enabled role's ranks, set up (model built and loaded, optimizer for trainable roles).
    With LoRA (``actor.lora.rank > 0``) the reference is :class:`BaseReference` over the actor."""
    groups: dict[str, Any] = {}
    for role, (trainable, value_head) in ROLES.items():
        if role not in cfg.megatron_roles:
            continue
        pg, share = placement.role(role)
        group = WorkerGroup(role, cfg, backend=cfg.cluster.backend, trainable=trainable, value_head=value_head,
                            placement_group=pg, share=share)
        info = group.call("setup")
        split = check_pipeline_split(role, getattr(cfg, role).parallel, info)
        note(f"{role}: {role_layout(getattr(cfg, role))}, {info[0]['params'] / 1e6:.1f}M params on rank 0"
             + (f" ({info[0]['trainable'] / 1e6:.3f}M trainable)" if trainable else "")
             + (f", layers per pipeline rank {split}" if getattr(cfg, role).parallel.pp > 1 else ""))
        groups[role] = group
    if cfg.ref.enabled and "ref" not in groups:
        groups["ref"] = BaseReference(groups["actor"])
        note("ref: the actor's base model with its LoRA adapters off (no reference role built)")
    return groups


def check_pipeline_split(role: str, parallel: Any, info: list[dict[str, Any]]) -> str:
    """Every rank built the layers the plan puts on its pipeline rank (``planning.params.stage_chunks``,
    which validation and ``megarl plan`` use), chunk by chunk; otherwise the run stops here, before any
    step, naming role, rank and both splits. Returns the split as ``"14/16"``."""
    from megarl.planning.params import stage_chunks

    planned = stage_chunks(int(info[0]["num_layers"]), parallel)
    for rank_info in info:
        want = [list(c) for c in planned[rank_info["pp_rank"]]]
        if rank_info["layers"] != want:
            raise RuntimeError(f"{role} rank {rank_info['rank']} (pipeline rank {rank_info['pp_rank']}) built layers "
                               f"{_spans(rank_info['layers'])}, the plan puts {_spans(want)} there")
    return "/".join(str(sum(len(c) for c in chunks)) for chunks in planned)


def _spans(chunks: list[list[int]]) -> str:
    return " + ".join(f"{c[0]}-{c[-1]}" if c else "none" for c in chunks)


def role_layout(role_cfg: Any) -> str:
    p = role_cfg.parallel
    return f"{role_cfg.gpus} rank(s) tp{p.tp} pp{p.pp}" + (f" cp{p.cp}" if p.cp > 1 else "") + (f" ep{p.ep}" if p.ep > 1 else "")
