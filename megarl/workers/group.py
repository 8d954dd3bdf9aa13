"""A role's ranks, called together.

``WorkerGroup.call("method", ...)`` runs the method on every rank at once (megatron collectives
need all of them) and returns the per-rank results; ``gather`` reassembles the data-parallel
shares returned by output ranks into the batch's original order. Backend ``ray`` makes one Ray
actor per rank inside the role's placement group; backend ``local`` runs a single rank in this
process (tests, one-GPU boxes without Ray).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megarl.parallel.launcher import free_port
from megarl.placement.addresses import node_address
from megarl.workers.megatron_worker import MegatronWorker, WorkerSpec


class _RayRank(MegatronWorker):
    """Ray actor body: a MegatronWorker plus a generic method dispatcher."""

    def execute(self, method: str, *args, **kwargs):
        return getattr(self, method)(*args, **kwargs)

    @staticmethod
    def node_address() -> tuple[str, int]:
        """(this node's address as Ray reports it, a port free on it): the rendezvous that ranks
        on other nodes dial (never 127.0.0.1 or the hostname's /etc/hosts entry)."""
        address = node_address()
        return address, free_port(address)


class WorkerGroup:
    def __init__(self, role: str, cfg: Any, *, backend: str, trainable: bool, value_head: bool,
                 placement_group: Any = None, share: float = 1.0):
        self.role = role
        self.world_size = getattr(cfg, role).gpus
        self.backend = backend
        spec_args = dict(role=role, cfg=cfg, world_size=self.world_size, trainable=trainable, value_head=value_head)
        if backend == "local":
            if self.world_size != 1:
                raise ValueError(f"{role}.gpus = {self.world_size}: backend 'local' runs one rank; use cluster.backend=ray")
            self.workers = [MegatronWorker(WorkerSpec(rank=0, master_addr="127.0.0.1", master_port=free_port(), **spec_args))]
        else:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            gpu = cfg.cluster.device == "cuda"
            remote = ray.remote(_RayRank)
            self.workers = []
            master_addr, master_port = None, None
            for rank in range(self.world_size):
                options = dict(num_cpus=cfg.cluster.cpus_per_rank * share, num_gpus=share if gpu else 0,
                               name=None, max_concurrency=1,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   placement_group=placement_group, placement_group_bundle_index=rank))
                if rank == 0:
                    # rank 0's node hosts the rendezvous; ask it for an address before creating the rest
                    probe = remote.options(**options).remote(WorkerSpec(rank=0, master_addr="", master_port=0, **spec_args))
                    master_addr, master_port = ray.get(probe.node_address.remote())
                    ray.kill(probe)
                spec = WorkerSpec(rank=rank, master_addr=master_addr, master_port=master_port, **spec_args)
                self.workers.append(remote.options(**options).remote(spec))

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        if self.backend == "local":
            return [getattr(self.workers[0], method)(*args, **kwargs)]
        import ray

        return ray.get([w.execute.remote(method, *args, **kwargs) for w in self.workers])

    def gather(self, method: str, batch_size: int, *args, **kwargs) -> list[list[Optional[torch.Tensor]]]:
        """Per-sample results of a forward-only method, in batch order: a list over samples of the
        tuple each micro-batch produced (e.g. (logprobs, entropy))."""
        slots: list[Any] = [None] * batch_size
        for result in self.call(method, *args, **kwargs):
            if not result:
                continue
            index = iter(result["index"])
            for micro_out in result["results"]:
                rows = next((t.shape[0] for t in micro_out if t is not None), 0)
                for r in range(rows):
                    slots[next(index)] = tuple(t[r] if t is not None else None for t in micro_out)
        missing = [i for i, s in enumerate(slots) if s is None]
        if missing:
            raise RuntimeError(f"{self.role}: no result for samples {missing[:8]}")
        return slots

    def reduce_metrics(self, per_rank: list[dict[str, float]]) -> dict[str, float]:
        """Add ``*_sum`` metrics over output ranks (they carry global denominators), average the rest;
        each over the ranks that report it (a data-parallel rank without samples reports no loss
        metrics)."""
        merged: dict[str, float] = {}
        keys = dict.fromkeys(k for m in per_rank if m for k in m)
        for key in keys:
            values = [m[key] for m in per_rank if m and key in m]
            if key.endswith("_sum"):
                merged[key[: -len("_sum")]] = sum(values)
            else:
                merged[key] = sum(values) / len(values)
        return merged

    def shutdown(self) -> None:
        if self.backend == "local":
            self.workers[0].shutdown()
            return
        import ray

        try:
            ray.get([w.execute.remote("shutdown") for w in self.workers], timeout=30)
        except Exception:  # noqa: BLE001 - best effort on teardown
            pass
        for w in self.workers:
            ray.kill(w)
