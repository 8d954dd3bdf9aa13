"""Placement without a cluster: which node resources pools ask for, and the address helpers on this
host (the multi-node behaviour is tested over namespaces in tests/test_cluster_box.py)."""
from __future__ import annotations

import pytest

from megarl.config import load_config
from megarl.placement import PlacementError, node_resource_requests, plan_pools
from megarl.wire.addresses import gloo_interface, interface_of, is_loopback, node_address, route_address
from tests.helpers.runs import DEFAULT


def _pools(*overrides: str):
    return plan_pools(load_config(DEFAULT, ["cluster.backend=ray", *overrides]))


def test_only_disaggregated_pools_name_node_resources():
    assert {p.node_resource for p in _pools().values()} == {None}
    pools = _pools("placement.mode=disaggregated", "cluster.device=cuda", "cluster.gpus_per_node=8",
                   "cluster.nodes=2", "actor.gpus=8", "rollout.gpus=8", "rollout.num_servers=8",
                   "batch.global_batch_size=32")
    assert {n: p.node_resource for n, p in pools.items()} == {"actor": "megarl_train", "rollout": "megarl_rollout"}


def test_node_resources_requested_when_offered_warned_when_missing_refused_when_short():
    pools = _pools("placement.mode=disaggregated", "cluster.device=cuda", "cluster.gpus_per_node=8",
                   "cluster.nodes=2", "actor.gpus=8", "rollout.gpus=8", "rollout.num_servers=8",
                   "batch.global_batch_size=32")
    marked = {"GPU": 16, "megarl_train": 8, "megarl_rollout": 8}
    assert node_resource_requests(pools, marked, alive_nodes=2) == (
        {"actor": "megarl_train", "rollout": "megarl_rollout"}, [])
    requests, warnings = node_resource_requests(pools, {"GPU": 16}, alive_nodes=2)
    assert requests == {"actor": None, "rollout": None} and len(warnings) == 2
    assert "'megarl_rollout'" in warnings[1] and "2-node Ray cluster" in warnings[1] and "\n" not in warnings[1]
    assert node_resource_requests(pools, {"GPU": 16}, alive_nodes=1) == ({"actor": None, "rollout": None}, [])
    with pytest.raises(PlacementError, match=r"pools 'actor' \(8\) need 8 bundle\(s\) on nodes with resource "
                                             r"'megarl_train'; the cluster's megarl_train nodes offer 4$"):
        node_resource_requests(pools, dict(marked, megarl_train=4), alive_nodes=2)


def test_addresses_on_this_host(monkeypatch):
    monkeypatch.delenv("MEGARL_NODE_IP", raising=False)
    assert route_address("127.0.0.1") == "127.0.0.1" and node_address(peer="127.0.0.1") == "127.0.0.1"
    assert is_loopback("localhost") and is_loopback("127.0.1.1") and not is_loopback("10.0.0.1")
    assert interface_of("127.0.0.1") == "lo" and gloo_interface("127.0.0.1") is None
    own = node_address()          # the route out of this host, never loopback
    assert not is_loopback(own) and interface_of(own) not in (None, "lo")
    assert gloo_interface(own) == interface_of(own)
    monkeypatch.setenv("MEGARL_NODE_IP", "10.9.8.7")
    assert node_address() == "10.9.8.7" and node_address(peer="127.0.0.1") == "10.9.8.7"
