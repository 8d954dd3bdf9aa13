"""Megatron roles (actor, critic, reference, reward model) as ranks, grouped per role."""
from megarl.workers.batch import SequenceBatch, split_by_token_budget
from megarl.workers.group import WorkerGroup
from megarl.workers.megatron_worker import MegatronWorker, WorkerSpec

__all__ = ["MegatronWorker", "SequenceBatch", "WorkerGroup", "WorkerSpec", "split_by_token_budget"]
