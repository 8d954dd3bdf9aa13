"""Whole training runs over two fake nodes (network namespaces with their own addresses, a real
Ray cluster over them: tests/netns_cluster.py), driven from node A as `megarl train` runs on the
head node of a job.

* disaggregated: trainer TP2 on node A (megarl_train), two embedded rollout servers of different
  TP sizes (TP1 and TP2, `rollout.server_tp`) on node B (megarl_rollout); weights go over gloo
  from node A's address (one update group for the one pipeline stage), step 0's logprob check
  passes at 1e-3, 3 steps finish -- with the TP2 server SIGKILLed in step 1 while it has
  requests in flight: it is restarted on node B, gets the current weights, the step's generations
  are retried, every step finishes (steps 0 and 2 are the plain run: nothing retried);
* colocated: four trainer ranks and two TP2 servers on two nodes; every IPC payload a server
  receives points at memory made by the trainer rank on its own bundle, on its own node.

Needs root (namespaces); CI runs as root, so a skip fails there.
"""
from __future__ import annotations

import json
import time

import pytest

from tests.netns_cluster import NetnsCluster, RayBox, netns_available

_why = netns_available()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

NODE_A, NODE_B = 0, 1
# 4 logical CPUs a node: the disaggregated pools take 2 (actor) and 3 (rollout) 1-CPU bundles; the
# colocated pool 4 bundles of 2 CPUs, i.e. two per node.
LAYOUT = [{"megarl_train": 2}, {"megarl_rollout": 3}]
DISAGG = ["placement.mode=disaggregated", "actor.gpus=2", "actor.parallel.tp=2", "rollout.gpus=3",
          "rollout.num_servers=2", "rollout.server_tp=[1,2]", "sync.transport=gloo", "cluster.cpus_per_rank=1"]
COMMON = ["trainer.eval_before_after=false", "checkpoint.export_hf=false", "rollout.logprob_diff_bound=1e-3",
          "rollout.n_per_prompt=4", "batch.prompts_per_step=4", "batch.global_batch_size=8"]


@pytest.fixture(scope="module")
def ray_box():
    t0 = time.time()
    with NetnsCluster(len(LAYOUT), subnet="10.214.0") as box:
        with RayBox(box, LAYOUT, num_cpus=4, num_gpus=0, object_store_mb=100) as rb:
            print(f"\n[cluster-train] {len(LAYOUT)} Ray nodes up in {time.time() - t0:.1f}s: {box.addresses}")
            yield rb


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.helpers.runs import tiny_model

    return tiny_model(tmp_path_factory.mktemp("cluster_train_model"))


def _train(rb: RayBox, model, out, overrides: list[str], timeout: float = 560, **extra) -> dict:
    args = dict(model=str(model), out=str(out), overrides=COMMON + overrides, **extra)
    t0 = time.time()
    result = rb.driver(NODE_A, ["-m", "tests.cluster_box_drivers", "train", json.dumps(args)], timeout=timeout)
    print(f"\n[cluster-train] run {overrides[:2]} {extra or ''}: {time.time() - t0:.1f}s")
    return result


def _check_disaggregated_layout(box: NetnsCluster, run: dict) -> None:
    servers = run["servers"]
    assert [s["tp"] for s in servers] == [1, 2]
    for s in servers:
        assert box.node_of_netns(s["netns"]) == NODE_B, s
        assert s["url"].startswith(f"http://{box.address(NODE_B)}:"), s   # peers dial node B's address
    assert sorted(box.node_of_netns(r["netns"]) for r in run["ranks"]) == [NODE_A, NODE_A]
    # one update group (one pipeline stage); its master is node A's routable address, not 127.0.0.1
    ((group, master),) = run["sync_groups"]
    assert group == "megarl_weights_pp0" and master.startswith(f"{box.address(NODE_A)}:"), run["sync_groups"]


def test_server_killed_mid_step_is_restarted_on_its_node_and_the_run_finishes(ray_box, model, tmp_path):
    box = ray_box.cluster
    run = _train(ray_box, model, tmp_path / "run", DISAGG, kill={"step": 1, "server": 1})
    _check_disaggregated_layout(box, run)
    killed = run["killed"]
    print(f"[cluster-train] killed {killed}; step 1: retried {run['steps'][1]['rollout/retried_requests']}, "
          f"restarted {run['steps'][1]['rollout/restarted_servers']}, rollout {run['steps'][1]['time/rollout_s']:.1f}s")
    assert killed is not None and killed["in_flight"] > 0, killed
    steps = run["steps"]
    assert len(steps) == 3
    assert steps[1]["rollout/restarted_servers"] == 1 and steps[1]["rollout/retried_requests"] >= 1, steps[1]
    # the steps around the kill are the plain disaggregated run: nothing retried or restarted, and the
    # weights went over the distributed transport every step (one run covers both: CI time)
    for s in (steps[0], steps[2]):
        assert s["rollout/restarted_servers"] == 0 and s["rollout/retried_requests"] == 0, s
    assert all(s["sync/bytes"] > 1e5 for s in steps)
    assert all(s["rollout/logprob_diff_mean"] < 1e-3 for s in steps), [s["rollout/logprob_diff_mean"] for s in steps]
    after = run["after_kill"]
    restarted = after["servers"][1]
    assert restarted["pid"] != killed["pid"] and box.node_of_netns(restarted["netns"]) == NODE_B, restarted
    assert restarted["url"].startswith(f"http://{box.address(NODE_B)}:") and restarted["tp"] == 2
    # the restarted server holds the weights of this step (pushed to it alone), as the other one does
    probe = after["probe"]
    assert probe[0]["version"] == probe[1]["version"] == after["version"] == "step1", probe
    assert probe[0]["ids"] == probe[1]["ids"]
    assert max(abs(a - b) for a, b in zip(probe[0]["logprobs"], probe[1]["logprobs"])) < 1e-4, probe


def test_colocated_two_nodes_ipc_only_from_the_servers_own_node(ray_box, model, tmp_path):
    box = ray_box.cluster
    run = _train(ray_box, model, tmp_path / "run", [
        "placement.mode=colocated", "actor.gpus=4", "actor.parallel.pp=2", "rollout.num_servers=2", "rollout.tp=2",
        "sync.transport=ipc", "cluster.cpus_per_rank=2"], record_ipc=True)
    steps = run["steps"]
    assert len(steps) == 3 and all(s["rollout/logprob_diff_mean"] < 1e-3 for s in steps)
    ranks = {r["rank"]: r for r in run["ranks"]}
    node_of_rank = {rank: box.node_of_netns(r["netns"]) for rank, r in ranks.items()}
    pid_node = {r["pid"]: node_of_rank[rank] for rank, r in ranks.items()}
    server_nodes = [box.node_of_netns(s["netns"]) for s in run["servers"]]
    assert sorted(server_nodes) == [NODE_A, NODE_B], "one TP2 server on each node"
    assert sorted(node_of_rank.values()) == [NODE_A, NODE_A, NODE_B, NODE_B]
    posted = run["ipc"]
    assert {p["server"] for p in posted} == {0, 1} and len(posted) >= 2 * 4   # 4 pushes, >= 1 bucket each
    for p in posted:
        node = server_nodes[p["server"]]
        # TP rank r's payload: memory made by trainer rank (first rank of the server) + r, on the server's node
        first = 2 * p["server"]
        assert p["creators"] == [[ranks[first]["pid"]], [ranks[first + 1]["pid"]]], p
        assert {pid_node[c] for per_rank in p["creators"] for c in per_rank} == {node}, p
        assert pid_node[p["poster"]] == node
    # PP2 over two nodes (stage 0 on node A's ranks 0, 1; stage 1 on node B's): the push gathers once
    # per node -- each stage's tensors cross to the other node once, the node's ranks taking turns
    gather = run["gather"]
    assert all(g["gather"] == "node" and g["nodes"] == [[0, 1], [2, 3]] for g in gather), gather
    moved = [g["stats"] for g in gather]
    assert all(m["network_in"] > 0 and m["network_out"] > 0 for m in moved), moved
    assert sum(m["network_in"] for m in moved) == sum(m["network_out"] for m in moved)
