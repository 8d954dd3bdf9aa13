"""Ray placement of role pools: colocated (roles share bundles) or disaggregated (own GPUs, own
nodes when the cluster marks them), and the node addresses peers dial."""
from megarl.wire.addresses import NoRoute, gloo_interface, node_address
from megarl.placement.pools import (Pool, PlacementError, RunPlacement, create_placement_groups, init_ray,
                                    node_resource_requests, plan_pools, pool_of)

__all__ = ["NoRoute", "Pool", "PlacementError", "RunPlacement", "create_placement_groups", "gloo_interface", "init_ray",
           "node_address", "node_resource_requests", "plan_pools", "pool_of"]
