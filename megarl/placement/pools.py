"""Role pools and their Ray placement groups.

Colocated: every Megatron role (and the rollout servers on GPU) shares one pool of bundles, one
bundle per rank; each role's rank ``i`` lands on bundle ``i`` with a fraction of its resources so
that several roles fit on the same GPU, as in verl's colocated layout. Disaggregated: the actor's
pool, the critic's pool and the rollout pool are separate placement groups, so rollout nodes never
hold trainer ranks; the reference and reward model share the actor's pool (they run in phases
when the actor is idle).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("actor", "critic", "ref", "reward_model")


@dataclass
class Pool:
    name: str
    bundles: int
    roles: list[str] = field(default_factory=list)
    gpus_per_bundle: float = 0.0
    cpus_per_bundle: float = 1.0


def plan_pools(cfg: Any) -> dict[str, Pool]:
    """Pools by name and which roles use them (pure: no Ray)."""
    gpu = 1.0 if cfg.cluster.device == "cuda" else 0.0
    cpus = cfg.cluster.cpus_per_rank
    enabled = [r for r in ROLES if getattr(cfg, r).enabled]
    if cfg.placement.mode == "colocated":
        return {"shared": Pool("shared", cfg.actor.gpus, enabled, gpu, cpus)}
    pools = {"actor": Pool("actor", cfg.actor.gpus, [r for r in enabled if r != "critic"], gpu, cpus)}
    if cfg.critic.enabled:
        pools["critic"] = Pool("critic", cfg.critic.gpus, ["critic"], gpu, cpus)
    if cfg.rollout.gpus:
        pools["rollout"] = Pool("rollout", cfg.rollout.gpus, [], gpu, cpus)
    return pools


def pool_of(pools: dict[str, Pool], role: str) -> Pool:
    for pool in pools.values():
        if role in pool.roles:
            return pool
    raise KeyError(f"role {role!r} is in no pool")


def create_placement_groups(pools: dict[str, Pool], timeout_s: float = 120.0) -> dict[str, Any]:
    """One Ray placement group per pool (PACK strategy keeps a role's ranks on few nodes);
    fails with the pool's name and its request when the cluster cannot hold it."""
    import ray
    from ray.util.placement_group import placement_group

    groups = {}
    for name, pool in pools.items():
        bundle = {"CPU": pool.cpus_per_bundle}
        if pool.gpus_per_bundle:
            bundle["GPU"] = pool.gpus_per_bundle
        pg = placement_group([dict(bundle) for _ in range(pool.bundles)], strategy="PACK", name=f"megarl_{name}")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(f"placement group for pool {name!r} ({pool.bundles} x {bundle}) could not be placed "
                               f"within {timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}")
        groups[name] = pg
    return groups


def init_ray(cfg: Any) -> None:
    """Join ``cluster.ray_address`` or start a small local Ray (object store capped for laptops/CI)."""
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}}
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address, runtime_env=env, log_to_driver=True)
        return
    gpus = cfg.cluster.gpus_per_node if cfg.cluster.device == "cuda" else 0
    needed = max(pool.bundles * pool.cpus_per_bundle for pool in plan_pools(cfg).values())
    import os

    ray.init(num_cpus=max(needed, os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False,
             object_store_memory=cfg.cluster.object_store_mb * 1024 * 1024, runtime_env=env,
             log_to_driver=True, configure_logging=False)
