"""Role pools and their Ray placement groups.

Colocated: every Megatron role (and the rollout servers on GPU) shares one pool of bundles, one
bundle per rank; each role's rank ``i`` lands on bundle ``i`` with a fraction of its resources so
that several roles fit on the same GPU, as in verl's colocated layout. Disaggregated: the actor's
pool, the critic's pool and the rollout pool are separate placement groups, so rollout nodes never
hold trainer ranks; the reference, reward model and distillation teacher share the actor's pool
(they run in phases when the actor is idle).

Node resources: ``launch/slurm/train_disagg.sbatch`` (and ``ray start --resources`` on any Ray
cluster) marks trainer nodes with ``megarl_train`` and rollout nodes with ``megarl_rollout``. In a
disaggregated run each bundle of the trainer pools asks for one unit of ``megarl_train`` and each
rollout bundle for one of ``megarl_rollout`` when the cluster offers them, so Ray can only put the
pools on their own nodes. Without them on a cluster of several nodes the pools may share nodes:
the run still works (placement groups never share a GPU) and says in one line what to add.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

ROLES = ("actor", "critic", "ref", "reward_model", "teacher")
TRAIN_RESOURCE = "megarl_train"
ROLLOUT_RESOURCE = "megarl_rollout"


class PlacementError(RuntimeError):
    """The cluster cannot hold a pool as the run asks; the message names the pool and the resource."""


@dataclass
class Pool:
    name: str
    bundles: int
    roles: list[str] = field(default_factory=list)
    gpus_per_bundle: float = 0.0
    cpus_per_bundle: float = 1.0
    node_resource: Optional[str] = None  # Ray node resource each bundle asks for when the cluster has it


def plan_pools(cfg: Any) -> dict[str, Pool]:
    """Pools by name and which roles use them (pure: no Ray)."""
    gpu = 1.0 if cfg.cluster.device == "cuda" else 0.0
    cpus = cfg.cluster.cpus_per_rank
    enabled = [r for r in ROLES if r in cfg.megatron_roles]   # a LoRA run builds no reference role
    if cfg.placement.mode == "colocated":
        return {"shared": Pool("shared", cfg.actor.gpus, enabled, gpu, cpus)}
    pools = {"actor": Pool("actor", cfg.actor.gpus, [r for r in enabled if r != "critic"], gpu, cpus, TRAIN_RESOURCE)}
    if cfg.critic.enabled:
        pools["critic"] = Pool("critic", cfg.critic.gpus, ["critic"], gpu, cpus, TRAIN_RESOURCE)
    if cfg.rollout.gpus:
        pools["rollout"] = Pool("rollout", cfg.rollout.gpus, [], gpu, cpus, ROLLOUT_RESOURCE)
    return pools


def node_resource_requests(pools: dict[str, Pool], cluster_resources: dict[str, float],
                           alive_nodes: int) -> tuple[dict[str, Optional[str]], list[str]]:
    """Which node resource each pool's bundles ask for (pure: no Ray), and one-line warnings.

    A pool asks for its resource when the cluster offers it; it fails at once, naming the pools
    and the amounts, when the marked nodes cannot hold the pools that share the resource (Ray would
    otherwise wait for them until the placement timeout). A pool whose resource no node offers
    gets a warning on a cluster of several nodes (nothing to separate on one node).
    """
    requests: dict[str, Optional[str]] = {}
    warnings: list[str] = []
    need: dict[str, list[Pool]] = {}
    for name, pool in pools.items():
        resource = pool.node_resource
        if resource is None:
            requests[name] = None
        elif cluster_resources.get(resource, 0) > 0:
            requests[name] = resource
            need.setdefault(resource, []).append(pool)
        else:
            requests[name] = None
            if alive_nodes > 1:
                warnings.append(
                    f"pool {name!r} ({pool.bundles} bundle(s)): no node of this {alive_nodes}-node Ray cluster offers "
                    f"resource {resource!r}, so the trainer and rollout pools may share nodes; start its nodes with "
                    f"`ray start --resources='{{\"{resource}\": GPUS}}'` (launch/slurm/train_disagg.sbatch does)")
    for resource, users in need.items():
        wanted = sum(p.bundles for p in users)
        have = cluster_resources.get(resource, 0)
        if wanted > have:
            names = " + ".join(f"{p.name!r} ({p.bundles})" for p in users)
            raise PlacementError(f"pools {names} need {wanted} bundle(s) on nodes with resource {resource!r}; "
                                 f"the cluster's {resource} nodes offer {have:g}")
    return requests, warnings


def pool_of(pools: dict[str, Pool], role: str) -> Pool:
    for pool in pools.values():
        if role in pool.roles:
            return pool
    raise KeyError(f"role {role!r} is in no pool")


def create_placement_groups(pools: dict[str, Pool], timeout_s: float = 120.0) -> dict[str, Any]:
    """One Ray placement group per pool (PACK strategy keeps a role's ranks on few nodes), each
    bundle on a node carrying the pool's node resource when the cluster has it (see
    :func:`node_resource_requests`); fails with the pool's name and its request when the cluster
    cannot hold it."""
    import ray
    from ray.util.placement_group import placement_group

    from megarl.metrics_log import note

    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    requests, warnings = node_resource_requests(pools, ray.cluster_resources(), alive)
    for warning in warnings:
        note(warning)
    groups = {}
    for name, pool in pools.items():
        bundle = {"CPU": pool.cpus_per_bundle}
        if pool.gpus_per_bundle:
            bundle["GPU"] = pool.gpus_per_bundle
        if requests[name]:
            bundle[requests[name]] = 1.0
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


class RunPlacement:
    """Where a run's processes go: under Ray one placement group per pool (made here), locally
    nowhere in particular. Roles share a bundle with a rollout server when colocated, so each
    role of a pool takes an equal part of 90% of the bundle (the rest is the server's)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.groups: dict[str, Any] = {}
        self.pools: dict[str, Pool] = {}
        if cfg.cluster.backend == "ray":
            init_ray(cfg)
            self.pools = plan_pools(cfg)
            self.groups = create_placement_groups(self.pools)

    def role(self, role: str) -> tuple[Any, float]:
        """(placement group, share of each bundle) of ``role``'s ranks; (None, 1.0) locally."""
        if not self.groups:
            return None, 1.0
        pool = pool_of(self.pools, role)
        return self.groups[pool.name], 0.9 / len(pool.roles)

    def servers(self) -> Optional[tuple[Any, int]]:
        """(placement group, first bundle) of the rollout servers: the rollout pool
        (disaggregated) or the shared one (colocated); None locally."""
        pg = self.groups.get("rollout") or self.groups.get("shared")
        return (pg, 0) if pg else None

    @staticmethod
    def shutdown(cfg: Any) -> None:
        """Stop the Ray instance this run started (one it joined, ``cluster.ray_address``, stays)."""
        if cfg.cluster.backend == "ray" and not cfg.cluster.ray_address:
            import ray

            if ray.is_initialized():
                ray.shutdown()
