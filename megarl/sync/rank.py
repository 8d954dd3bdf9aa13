"""Worker side of a weight push: what each actor rank runs (called through `WorkerGroup.call`).

The driver opens the weight-update session on every server (`megarl.sync.session`) and calls
`push_from_rank` on every actor rank; sender ranks (TP0/DP0 of each stage, ETP0/EDP0 of each
expert group) stream buckets through their own `WeightPusher`, the others take part in the
all-gathers of `iter_hf_weights` and send nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .push import WeightPusher, is_sender_rank, push_megatron, sender_group_name


@dataclass(frozen=True)
class PushTarget:
    """Where and how a run's weights go; the same for every push of a run."""

    urls: tuple[str, ...]
    server_tp_sizes: tuple[int, ...]
    transport: str                       # distributed | tensor | disk
    backend: str                         # nccl | gloo (distributed transport)
    bucket_mb: float
    verify_checksum: Optional[bool]
    disk_dir: Optional[str]
    api_key: Optional[str]
    timeout_s: float = 600.0
    known_names: Optional[frozenset] = None   # the served checkpoint's HF names (None: not checked)
    # colocated tensor transport: per server, the trainer ranks on its TP ranks' GPUs (TP order);
    # each of them hands its own GPU's copy (megarl.sync.colocated). None: the sender rank's memory.
    ipc_groups: Optional[tuple] = None


def checkpoint_names(hf_dir: str) -> Optional[frozenset]:
    """HF tensor names of the checkpoint the servers were started from (safetensors index or
    headers; no tensor is read); None when the folder has no weights (e.g. config only)."""
    from megarl.models.naming import SafetensorsSource

    try:
        return frozenset(SafetensorsSource(hf_dir).names())
    except FileNotFoundError:
        return None


def resolve_transport(configured: str, device: str, colocated: bool) -> str:
    """`sync.transport` -> pusher transport. auto: CUDA IPC when colocated on GPU (NCCL refuses two
    ranks on one GPU), a broadcast group otherwise."""
    return {"nccl": "distributed", "gloo": "distributed", "ipc": "tensor", "disk": "disk",
            "auto": "tensor" if device == "cuda" and colocated else "distributed"}[configured]


def push_from_rank(worker: Any, target: PushTarget, version: str) -> dict[str, float]:
    """Runs on every actor rank: stream HF-named weights bucket by bucket to all servers.
    The pusher (and its update group) is created on the first push and reused."""
    if target.transport == "tensor" and target.ipc_groups:
        return _push_colocated(worker, target, version)
    if not hasattr(worker, "_pusher"):
        pusher = None
        if is_sender_rank():
            pusher = WeightPusher(list(target.urls), transport=target.transport, bucket_mb=target.bucket_mb,
                                  backend=target.backend, group_name=sender_group_name(),
                                  server_tp_sizes=list(target.server_tp_sizes),
                                  send_checksums=target.verify_checksum, disk_dir=target.disk_dir,
                                  api_key=target.api_key, timeout_s=target.timeout_s,
                                  known_names=target.known_names)
            pusher.connect()
        worker._pusher = pusher
    stats = push_megatron(worker.chunks, None, worker._pusher, weight_version=version)
    return stats.as_dict() if worker._pusher is not None else {}


def _push_colocated(worker: Any, target: PushTarget, version: str) -> dict[str, float]:
    """Every rank streams the whole model; each server's first rank posts its TP ranks' handles."""
    from .colocated import IpcFanIn, iter_hf_weights_everywhere

    if not hasattr(worker, "_pusher"):
        fan = IpcFanIn(target.ipc_groups)
        mine = fan.server is not None and fan.leader
        worker._fan = fan
        worker._pusher = WeightPusher(
            [target.urls[fan.server]] if mine else [], transport="tensor", bucket_mb=target.bucket_mb,
            server_tp_sizes=[target.server_tp_sizes[fan.server]] if mine else [],
            send_checksums=target.verify_checksum, api_key=target.api_key, timeout_s=target.timeout_s,
            known_names=target.known_names, tensor_payloads=fan.payloads)
    stats = worker._pusher.push(iter_hf_weights_everywhere(worker.chunks), weight_version=version)
    worker._fan.barrier()
    return stats.as_dict() if worker._fan.leader else {}


def close_pusher(worker: Any) -> None:
    """Runs on every actor rank before shutdown: leave the update groups and close the HTTP
    sessions of this rank's pusher (unclosed aiohttp sessions warn at exit)."""
    pusher = getattr(worker, "_pusher", None)
    if pusher is not None:
        pusher.close()
    worker.__dict__.pop("_pusher", None)
