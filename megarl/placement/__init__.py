"""Ray placement of role pools: colocated (roles share bundles) or disaggregated (own GPUs)."""
from megarl.placement.pools import Pool, create_placement_groups, init_ray, plan_pools, pool_of

__all__ = ["Pool", "create_placement_groups", "init_ray", "plan_pools", "pool_of"]
