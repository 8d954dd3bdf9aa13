"""Megatron roles (actor, critic, reference, reward model, distillation teacher) as ranks, grouped per role."""
from megarl.data.batch import TokenBatch
from megarl.workers.dispatch import Shard
from megarl.workers.group import WorkerGroup
from megarl.workers.megatron_worker import MegatronWorker, WorkerSpec

__all__ = ["MegatronWorker", "Shard", "TokenBatch", "WorkerGroup", "WorkerSpec"]
