"""Ray drivers that tests/test_cluster_box.py runs inside a node of the namespace cluster.

A driver must live in a node's network namespace (as `megarl train` runs on the head node of a
SLURM job), so the tests start ``python -m tests.cluster_box_drivers NAME JSON_ARGS`` there through
:meth:`tests.netns_cluster.RayBox.driver`; each driver prints one JSON object on its last line.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
from typing import Any, Callable, Optional

import ray


def _whereami() -> dict[str, Any]:
    """What a process knows about its own node: Ray's view, megarl's, and the naive ones."""
    from megarl.wire.addresses import node_address

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

    from megarl.data.batch import TokenBatch
    from megarl.placement import create_placement_groups, init_ray, plan_pools
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
        ranks = group.call("probe", _rank_facts)
        sequences = [[1, 20, 300, 4000, 50, 6, 70], [9, 8, 7, 600, 5000], [11, 12, 13, 14, 15, 16]]
        prompt_lens = [3, 2, 4]
        batch = TokenBatch.from_sequences([s[:n] for s, n in zip(sequences, prompt_lens)],
                                          [s[n:] for s, n in zip(sequences, prompt_lens)])
        flat = group.forward("compute_logprobs", batch, False)["logprobs"]
        offsets = batch.response_offsets.tolist()
        got = [flat[offsets[i]:offsets[i + 1]] for i in range(len(sequences))]
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


def _netns_of(pid: int) -> Optional[int]:
    """The network namespace (inode) of a live process on this machine (any node: one pid space)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _rank_where(worker: Any) -> dict[str, Any]:
    import torch.distributed as dist

    return dict(_whereami(), rank=dist.get_rank())


_IPC_SEEN: list = []


def _record_ipc(worker: Any) -> int:
    """On an actor rank: record, for every bucket a server's first rank posts, the creator pid of
    the shared memory each TP rank's payload points at (torch names it /torch_<pid>_...)."""
    import megarl.sync.colocated as colocated
    from tests.helpers.ipc import shm_creator_pids

    real = colocated.IpcFanIn.payloads
    if getattr(real, "recording", False):
        return os.getpid()

    def recording(self, bucket, server_tp, fmt):
        out = real(self, bucket, server_tp, fmt)
        if out:
            _IPC_SEEN.append({"server": self.server, "poster": os.getpid(),
                              "creators": [sorted(shm_creator_pids(p)) for p in out[0]]})
        return out
    recording.recording = True
    colocated.IpcFanIn.payloads = recording
    return os.getpid()


def _ipc_seen(worker: Any) -> list:
    seen = list(_IPC_SEEN)
    _IPC_SEEN.clear()
    return seen


def _gather_seen(worker: Any) -> dict:
    """On an actor rank: the colocated gather its pushes used and the bytes it moved in the last."""
    sender = worker.sender
    stats = sender.node_stats.__dict__ if sender.node_stats is not None else None
    return {"gather": sender.gather, "nodes": sender.nodes.nodes if sender.nodes else None, "stats": stats}


def train(args: dict[str, Any]) -> dict[str, Any]:
    """`megarl train` of the tiny model on this Ray cluster, driven from this node (the head node of
    a job), reporting where things ran: every server's process and namespace (before and after a
    restart), every actor rank's, the update groups and their master addresses, IPC payload origins
    (args["record_ipc"]), and each server's answer to one greedy request after the step where
    args["kill"] = {"step", "server"} SIGKILLs a server while that server has requests in flight."""
    import threading
    import time
    from pathlib import Path

    from megarl.rollout.client import LoopThread, SGLangClient, sampling_params
    from megarl.trainer import Trainer
    from tests.helpers.runs import tiny_run_config

    # the module by its importable name: this file runs as __main__, whose functions Ray would ship
    # by value, each call with its own copy of _IPC_SEEN
    import tests.cluster_box_drivers as drivers

    cfg = tiny_run_config(Path(args["model"]), Path(args["out"]), "cluster.backend=ray", "cluster.ray_address=auto",
                          *args.get("overrides", []))
    facts: dict[str, Any] = {"ipc": [], "killed": None}
    kill = args.get("kill")

    class Observed(Trainer):
        def setup(self) -> None:
            super().setup()
            facts["servers"] = self.server_facts()
            facts["ranks"] = self.groups["actor"].call("probe", drivers._rank_where)
            facts["sync_groups"] = [list(g) for g in self.weights.groups]

        def server_facts(self) -> list[dict[str, Any]]:
            out = []
            for i, (url, tp) in enumerate(zip(self.servers.urls, self.servers.tp_sizes)):
                pid = self.servers.pid(i)
                out.append({"url": url, "tp": tp, "pid": pid, "netns": _netns_of(pid)})
            return out

        def setup_rollout(self, servers) -> None:
            super().setup_rollout(servers)
            collect = self.rollout.collect
            self.rollout.collect = lambda loader, step: self.collect_and_kill(collect, loader, step)
            if args.get("record_ipc"):   # every push records what the ranks posted
                actor, push = self.groups["actor"], self.weights.push
                actor.call("probe", drivers._record_ipc)

                def recorded(version: str) -> dict[str, float]:
                    out = push(version)
                    facts["ipc"].extend(e for per_rank in actor.call("probe", drivers._ipc_seen) for e in per_rank)
                    facts["gather"] = actor.call("probe", drivers._gather_seen)
                    return out
                self.weights.push = recorded

        def probe_servers(self) -> list[dict[str, Any]]:
            io = LoopThread()
            try:
                async def one(url: str) -> dict[str, Any]:
                    async with SGLangClient(url, api_key=self.servers.api_key) as c:
                        out = (await c.generate([1, 2, 3, 4, 5], sampling_params(max_new_tokens=6, temperature=0.0),
                                                return_logprob=True))[0]
                    return {"version": out.weight_version, "ids": list(out.output_ids), "logprobs": list(out.logprobs)}
                return [io.run(one(u)) for u in self.servers.urls]
            finally:
                io.close()

        def kill_when_busy(self, server: int, pid: int) -> None:
            deadline = time.time() + 120
            while time.time() < deadline:
                manager = self.rollout.manager
                if manager.outstanding[server] > 0:
                    os.kill(pid, signal.SIGKILL)
                    facts["killed"] = {"server": server, "pid": pid, "in_flight": manager.outstanding[server]}
                    return
                time.sleep(0.001)


        def collect_and_kill(self, collect, loader, step: int):
            killer = None
            if kill and step == kill["step"]:
                killer = threading.Thread(target=self.kill_when_busy,
                                          args=(kill["server"], self.servers.pid(kill["server"])), daemon=True)
                killer.start()
            try:
                return collect(loader, step)
            finally:
                if killer is not None:
                    killer.join(5)
                    facts["after_kill"] = {"servers": self.server_facts(), "probe": self.probe_servers(),
                                           "version": self.weights.version}

    t0 = time.time()
    results = Observed(cfg).run()
    return {"steps": results["steps"], "seconds": time.time() - t0, **facts}


DRIVERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "addresses": addresses, "placement": placement, "worker_group": worker_group, "train": train}


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
