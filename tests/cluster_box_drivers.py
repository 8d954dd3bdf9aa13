"""Ray drivers that tests/test_cluster_box.py runs inside a node of the namespace cluster.

A driver must live in a node's network namespace (as `megarl train` runs on the head node of a
SLURM job), so the tests start ``python -m tests.cluster_box_drivers NAME JSON_ARGS`` there through
:meth:`tests.netns_cluster.RayBox.driver`; each driver prints one JSON object on its last line.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Callable

import ray


def _whereami() -> dict[str, Any]:
    """What a process knows about its own node: Ray's view, megarl's, and the naive ones."""
    from megarl.placement.addresses import node_address

    return {"pid": os.getpid(), "ray_ip": ray.util.get_node_ip_address(), "megarl_address": node_address(),
            "hostname_ip": socket.gethostbyname(socket.gethostname()),
            "node_id": ray.get_runtime_context().get_node_id(), "netns": os.stat("/proc/self/ns/net").st_ino}


@ray.remote(num_cpus=0.1)
class Probe:
    def whereami(self) -> dict[str, Any]:
        return _whereami()


def addresses(args: dict[str, Any]) -> dict[str, Any]:
    """One probe actor per node resource named in ``args["resources"]``; where did each land?"""
    placed = {res: Probe.options(resources={res: 0.1}).remote() for res in args["resources"]}
    return {"driver": _whereami(), "actors": {res: ray.get(a.whereami.remote(), timeout=120) for res, a in placed.items()}}


def _config(overrides: list[str]):
    from megarl.config import load_config
    from tests.helpers.runs import ARCH_FROM_CONFIG_JSON, DEFAULT

    return load_config(DEFAULT, ["cluster.backend=ray", "cluster.ray_address=auto", "placement.mode=disaggregated",
                                 *ARCH_FROM_CONFIG_JSON, *overrides])


def placement(args: dict[str, Any]) -> dict[str, Any]:
    """megarl's placement groups for the run ``args["overrides"]`` describes, and the node (and
    GPU ids) of a probe actor in every bundle; or the one-line error when they cannot be made."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from megarl.placement import PlacementError, create_placement_groups, init_ray, plan_pools

    cfg = _config(args["overrides"])
    init_ray(cfg)
    pools = plan_pools(cfg)
    try:
        groups = create_placement_groups(pools, timeout_s=60)
    except PlacementError as err:
        return {"error": str(err)}
    out: dict[str, Any] = {}
    for name, pg in groups.items():
        gpu = pools[name].gpus_per_bundle
        probes = [Probe.options(num_gpus=gpu, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(pools[name].bundles)]
        out[name] = ray.get([p.whereami.remote() for p in probes], timeout=120)
        for p in probes:
            ray.kill(p)
        ray.util.remove_placement_group(pg)
    return out


def _rank_facts(worker: Any) -> dict[str, Any]:
    """Runs on a Megatron rank: its node, its rendezvous and the interface gloo bound to."""
    import torch.distributed as dist

    return dict(_whereami(), rank=dist.get_rank(), world=dist.get_world_size(),
                master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                gloo_ifname=os.environ.get("GLOO_SOCKET_IFNAME"), topology=worker.topology())


def worker_group(args: dict[str, Any]) -> dict[str, Any]:
    """The actor pool of a disaggregated run as megarl places it (2 ranks, TP2 over gloo), one
    forward of a small batch, and the same forward in HF transformers in this driver."""
    import torch
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from transformers import AutoModelForCausalLM

    from megarl.placement import create_placement_groups, init_ray, plan_pools
    from megarl.data.batch import TokenBatch
    from megarl.workers import WorkerGroup

    cfg = _config([f"model.hf_path={args['model']}", "actor.gpus=2", "actor.parallel.tp=2", "rollout.gpus=1",
                   "actor.micro_batch_size=4", *args.get("overrides", [])])
    init_ray(cfg)
    pools = plan_pools(cfg)
    groups = create_placement_groups(pools, timeout_s=60)
    group = WorkerGroup("actor", cfg, backend="ray", trainable=False, value_head=False,
                        placement_group=groups["actor"], share=0.9)
    try:
        group.call("setup")
        ranks = group.call("call", _rank_facts)
        sequences = [[1, 20, 300, 4000, 50, 6, 70], [9, 8, 7, 600, 5000], [11, 12, 13, 14, 15, 16]]
        prompt_lens = [3, 2, 4]
        batch = TokenBatch.from_sequences([s[:p] for s, p in zip(sequences, prompt_lens)],
                                          [s[p:] for s, p in zip(sequences, prompt_lens)])
        flat = group.forward("compute_logprobs", batch, False)["logprobs"]
        got = [flat[int(a):int(b)] for a, b in zip(batch.response_offsets[:-1], batch.response_offsets[1:])]
    finally:
        group.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32).eval()
    diffs = []
    for logprobs, seq, plen in zip(got, sequences, prompt_lens):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[torch.arange(plen - 1, len(seq) - 1), torch.tensor(seq[plen:])]
        diffs.append(float((logprobs[: len(ref)] - ref).abs().max()))
    rollout_pg = groups["rollout"]
    rollout_probe = Probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=rollout_pg, placement_group_bundle_index=0)).remote()
    rollout = ray.get(rollout_probe.whereami.remote(), timeout=120)
    return {"ranks": ranks, "logprob_max_abs_diff": max(diffs), "rollout_bundle": rollout, "driver": _whereami()}


DRIVERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "addresses": addresses, "placement": placement, "worker_group": worker_group}


def main(argv: list[str]) -> int:
    name, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    ray.init(address="auto", logging_level="ERROR", log_to_driver=os.environ.get("MEGARL_TEST_RAY_LOGS") == "1")
    try:
        result = DRIVERS[name](args)
    finally:
        ray.shutdown()
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
