"""Distributed setup for megarl: torch.distributed, megatron parallel_state, CPU shim, launcher.

Public API (others depend on these names):

- ``apply_cpu_shim(force=False) -> bool`` -- patch torch.cuda/megatron for CPU; idempotent; no-op
  when a CUDA device exists (see :mod:`megarl.parallel.cpu_shim` for the 7 fixes).
- ``init_distributed(backend=None, timeout_s=DEFAULT_TIMEOUT_S)`` -- default process group from env
  (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT); nccl with CUDA, gloo otherwise; idempotent.
- ``init_model_parallel(tp=1, pp=1, vpp=None, ep=1, etp=1, cp=1, timeout_s=None, seed=1234)`` --
  megatron parallel_state (dp = world / (tp*pp*cp)), group timeouts, RNG tracker seeding, and a
  start-up all-reduce on every group under ``collective_deadline``.
- ``destroy_model_parallel()``, ``destroy_distributed()``.
- ``collective_deadline(name=None, group=None)`` -- context manager turning a collective failure or
  timeout into ``CollectiveTimeout`` naming the group (``"tp"``, ``"pp"``, ``"dp"``, ``"ep"``...).
- ``groups() -> dict[str, ProcessGroup]``.
- ``spawn(fn, world_size, *args, timeout_s=300, method=None) -> list`` -- local launcher: runs
  ``fn(rank, world_size, *args)`` in N processes with torch.distributed initialised (gloo on a free
  loopback port); raises ``SpawnError`` with the failing rank's traceback.
"""
from .cpu_shim import apply_cpu_shim, cuda_available, shim_applied
from .dist import (
    DEFAULT_TIMEOUT_S,
    CollectiveTimeout,
    collective_deadline,
    default_backend,
    destroy_distributed,
    destroy_model_parallel,
    group_name,
    groups,
    init_distributed,
    init_model_parallel,
)
from megarl.wire.addresses import free_port

from .launcher import SpawnError, spawn

__all__ = [
    "apply_cpu_shim", "cuda_available", "shim_applied", "DEFAULT_TIMEOUT_S", "CollectiveTimeout",
    "collective_deadline", "default_backend", "destroy_distributed", "destroy_model_parallel",
    "group_name", "groups", "init_distributed", "init_model_parallel", "SpawnError", "free_port",
    "spawn",
]
