"""Worker side of a weight push: what each actor rank runs (through its named methods).

The driver opens the weight-update session on every server (`megarl.sync.session`) and calls
`push_weights` on every actor rank, which runs its `RankSender`; each pipeline stage's sender (`megarl.sync.stage`: one update
group per stage) streams buckets through its own `WeightPusher`, the other ranks take part in the
all-gathers and send their experts to it. `RankSender.push_to_server` does the same for one server alone
through a fresh, short-lived update group (a restarted server: `megarl.rollout.healing`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from .push import WeightPusher, is_sender_rank, push_megatron, sender_group_name
from .session import SyncError


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
    # the served checkpoint's weight format (megarl.quant.served): block FP8 is quantized on the
    # sending rank; None = the trainer's dtype
    served: Any = None
    # distributed transport: every EP rank's ETP0/EDP0 rank sends its own experts (sync.expert_senders)
    expert_senders: bool = False
    # colocated tensor transport: auto | node | everywhere (sync.colocated_gather; megarl.sync.colocated)
    colocated_gather: str = "auto"


def checkpoint_names(hf_dir: str) -> Optional[frozenset]:
    """HF tensor names of the checkpoint the servers were started from (safetensors index or
    headers; no tensor is read); None when the folder has no weights (e.g. config only)."""
    from megarl.models.naming import SafetensorsSource

    try:
        return frozenset(SafetensorsSource(hf_dir).names())
    except FileNotFoundError:
        return None


class RankSender:
    """One actor rank's side of every weight push of a run, kept between pushes: its stage's
    pusher (whose update group is made on the first push) or, colocated, its IPC fan-in (whose
    process groups are made once: ``new_group`` is collective). A worker holds one in a field and
    calls it from its named methods (``push_weights``, ``push_to_server``, ``close_pusher``)."""

    def __init__(self) -> None:
        self.pusher: Optional[WeightPusher] = None
        self.fan: Any = None
        self.nodes: Any = None                 # colocated: the actor's NodeLayout, made on the first push
        self.gather = "everywhere"             # colocated: the gather the pushes use (node | everywhere)
        self.node_stats: Any = None

    def push(self, chunks: list, target: PushTarget, version: str) -> dict[str, Any]:
        """Stream HF-named weights bucket by bucket to all servers (every rank takes part)."""
        if target.transport == "tensor" and target.ipc_groups:
            return self._push_colocated(chunks, target, version)
        experts = target.expert_senders
        if self.pusher is None and is_sender_rank(expert_senders=experts):
            self.pusher = _stage_pusher(target, sender_group_name(expert_senders=experts))
        return _stage_push(chunks, self.pusher, target, version)

    def push_to_server(self, chunks: list, target: PushTarget, version: str, server: int, tag: str) -> dict[str, Any]:
        """The current weights to server ``server`` alone (e.g. restarted, at a new URL in
        ``target.urls``), through a fresh update group per stage named with ``tag``, left again
        afterwards. The run's regular pusher is not touched (the driver drops it when a server's
        URL changed: :meth:`close`)."""
        if target.transport == "tensor" and target.ipc_groups:
            return self._push_colocated(chunks, target, version, only=server)
        sub = replace(target, urls=(target.urls[server],), server_tp_sizes=(target.server_tp_sizes[server],))
        experts = target.expert_senders
        pusher = (_stage_pusher(sub, f"{sender_group_name(expert_senders=experts)}_{tag}")
                  if is_sender_rank(expert_senders=experts) else None)
        try:
            return _stage_push(chunks, pusher, sub, version)
        finally:
            if pusher is not None:
                pusher.close()

    def close(self) -> None:
        """Leave the update groups and close the HTTP sessions of this rank's pusher (unclosed
        aiohttp sessions warn at exit); the next push makes a new one."""
        if self.pusher is not None:
            self.pusher.close()
        self.pusher = None

    def _push_colocated(self, chunks: list, target: PushTarget, version: str,
                        only: Optional[int] = None) -> dict[str, Any]:
        """Every rank streams the whole model; each server's first rank posts its TP ranks'
        handles. ``only``: to that server alone, with a one-off pusher (the others' leaders post
        nothing but still gather, as every bucket's gather is collective within each server's group)."""
        from .colocated import IpcFanIn, NodeShareStats, iter_hf_weights_by_node, iter_hf_weights_everywhere, node_layout

        if self.fan is None:
            self.fan = IpcFanIn(target.ipc_groups, target.timeout_s)
            if target.colocated_gather != "everywhere":
                self.nodes = node_layout(target.timeout_s)    # a layout that does not fit: the gather says why
                by_node = target.colocated_gather == "node" or (self.nodes.spans_nodes and self.nodes.fits)
                self.gather = "node" if by_node else "everywhere"
        fan = self.fan
        by_node = self.gather == "node"

        def pusher_for(server: Optional[int]) -> WeightPusher:
            mine = fan.server is not None and fan.leader and (server is None or fan.server == server)
            return WeightPusher(
                [target.urls[fan.server]] if mine else [], transport="tensor", bucket_mb=target.bucket_mb,
                server_tp_sizes=[target.server_tp_sizes[fan.server]] if mine else [],
                send_checksums=target.verify_checksum, api_key=target.api_key, timeout_s=target.timeout_s,
                known_names=target.known_names, tensor_payloads=fan.payloads,
                served=None if by_node else target.served)

        if only is None and self.pusher is None:
            self.pusher = pusher_for(None)
        pusher = self.pusher if only is None else pusher_for(only)
        try:
            if by_node:       # the served format (FP8) is made where each tensor is held, before it crosses
                self.node_stats = NodeShareStats()
                convert = target.served.stream if target.served is not None else None
                stream = iter_hf_weights_by_node(chunks, self.nodes, convert=convert, stats=self.node_stats)
            else:
                stream = iter_hf_weights_everywhere(chunks)
            stats = pusher.push(stream, weight_version=version)
            fan.barrier()
        finally:
            if only is not None:
                pusher.close()
        if not fan.leader:
            return {}
        out = dict(stats.as_dict(), group=f"ipc_server{fan.server}", master=None, servers=len(pusher.servers),
                   gather=self.gather)
        if self.node_stats is not None:
            out["node_gather"] = asdict(self.node_stats)
        return out


def _stage_pusher(target: PushTarget, group_name: str) -> WeightPusher:
    """The stage sender's pusher towards `target`'s servers, connected (its update group made)."""
    from .stage import stage_index

    disk_dir = target.disk_dir
    if disk_dir and _pipeline_stages() > 1:   # one folder per stage: each sender writes its own
        disk_dir = os.path.join(disk_dir, f"pp{stage_index()}")
    pusher = WeightPusher(list(target.urls), transport=target.transport, bucket_mb=target.bucket_mb,
                          backend=target.backend, group_name=group_name,
                          server_tp_sizes=list(target.server_tp_sizes), send_checksums=target.verify_checksum,
                          disk_dir=disk_dir, api_key=target.api_key, timeout_s=target.timeout_s,
                          known_names=target.known_names, served=target.served)
    try:
        pusher.connect()
    except Exception as e:
        pusher.close()
        raise SyncError(f"{_where(group_name)}: {e}") from e
    return pusher


def _stage_push(chunks: list, pusher: Optional[WeightPusher], target: PushTarget, version: str) -> dict[str, Any]:
    """Every rank walks its stage's stream; the sender pushes it. Errors name stage and group."""
    try:
        stats = push_megatron(chunks, None, pusher, weight_version=version, bucket_mb=target.bucket_mb,
                              expert_senders=target.expert_senders)
    except Exception as e:
        name = pusher.group_name if pusher is not None else sender_group_name(expert_senders=target.expert_senders)
        raise SyncError(f"{_where(name)}: {type(e).__name__}: {e}") from e
    if pusher is None:
        return {}
    out: dict[str, Any] = stats.as_dict()
    out.update(group=pusher.group_name, master=f"{pusher.master_address}:{pusher.master_port_used}"
               if pusher.transport == "distributed" else None, servers=len(pusher.servers))
    return out


def _where(group_name: str) -> str:
    import torch.distributed as dist

    from .stage import stage_index

    rank = dist.get_rank() if dist.is_initialized() else 0
    return f"weight sync of pipeline stage {stage_index()} (update group {group_name}, trainer rank {rank})"


def _pipeline_stages() -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_world_size()
