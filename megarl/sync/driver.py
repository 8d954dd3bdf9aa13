"""Driver side of every weight push of a run: the target, the session, the ranks, the report.

The driver holds a :class:`WeightSync` for the actor role: it opens one weight-update session on
every server (`megarl.sync.session`) around all actor ranks' ``push_weights`` and turns the ranks'
statistics into the step's ``sync/*`` metrics. A restarted server (a new URL, `rollout.healing`)
gets the current weights through a session on it alone and a fresh update group per stage; the
run's own update groups held the old process, so they are left and made again at the next push.
"""
from __future__ import annotations

from typing import Any, Optional

from megarl.metrics_log import note
from megarl.quant.served import read_served_format
from megarl.config.colocation import adapter_push
from megarl.config.validate import push_transport
from megarl.sync.adapter_push import AdapterPush
from megarl.sync.colocated import ipc_groups_for
from megarl.sync.rank import PushTarget, checkpoint_names
from megarl.sync.session import weight_update_session
from megarl.wire.versions import INIT_TAG


class WeightSync:
    def __init__(self, cfg: Any, actor: Any, servers: Any, model_dir: str):
        """``model_dir``: the checkpoint the servers serve (its names and weight format)."""
        self.cfg, self.actor, self.servers, self.model_dir = cfg, actor, servers, str(model_dir)
        self.version = INIT_TAG          # the tag the servers hold
        self.groups: Optional[list] = None   # (update group, master) of the last push, for the log line
        self.heals = 0
        self._target: Optional[PushTarget] = None
        # actor.lora.push: adapter -- the servers keep their base, each push loads adapters only
        self.adapters = AdapterPush(cfg, actor, servers, model_dir) if adapter_push(cfg) else None

    def target(self) -> PushTarget:
        """Where and how this run's weights go (the servers' current URLs)."""
        cfg = self.cfg
        transport = push_transport(cfg)
        names = checkpoint_names(self.model_dir)
        return PushTarget(urls=tuple(self.servers.urls), server_tp_sizes=tuple(self.servers.tp_sizes),
                          transport=transport, backend="nccl" if cfg.cluster.device == "cuda" else "gloo",
                          bucket_mb=cfg.sync.bucket_mb, verify_checksum=cfg.sync.verify_checksum,
                          disk_dir=str(self.servers.weights_dir), api_key=self.servers.api_key,
                          timeout_s=cfg.rollout.request_timeout_s, known_names=names,
                          ipc_groups=self._ipc_groups(transport), served=read_served_format(self.model_dir, names),
                          expert_senders=cfg.sync.expert_senders, colocated_gather=cfg.sync.colocated_gather)

    def _ipc_groups(self, transport: str) -> Optional[tuple]:
        """Colocated tensor transport into servers megarl started on the actor's own bundles: which
        actor ranks hand each server TP rank a copy on its GPU (None: the sender's memory, e.g.
        servers given by URL)."""
        cfg = self.cfg
        if transport != "tensor" or cfg.placement.mode != "colocated" or cfg.rollout.server_urls:
            return None
        if sum(self.servers.tp_sizes) != cfg.actor.gpus:
            return None
        return ipc_groups_for(self.servers.tp_sizes)

    def push(self, version: str) -> dict[str, float]:
        """One weight-update session on every server around all actor ranks' pushes (adapter-only:
        the adapters of ``version`` loaded under their own name, the previous ones retired)."""
        if self.adapters is not None:
            stats = self.adapters.push(version)
            self.version = version
            return stats
        if self._target is None:
            self._target = self.target()
        with weight_update_session(self.servers.urls, api_key=self.servers.api_key):
            stats = self.actor.call("push_weights", self._target, version)
        self.version = version
        groups = sorted({(s["group"], s.get("master")) for s in stats if s.get("group")})
        if groups != self.groups:
            self.groups = groups
            gathers = sorted({s["gather"] for s in stats if s.get("gather")})
            note("weight sync: " + ", ".join(f"{g}" + (f" (master {m})" if m else "") for g, m in groups)
                 + f" -> {len(self.servers.urls)} server(s), TP {list(self.servers.tp_sizes)}"
                 + (f"; colocated gather: {', '.join(gathers)} (sync.colocated_gather)" if gathers else ""))
        total_bytes = sum(s.get("bytes", 0) for s in stats)
        seconds = max((s.get("seconds", 0.0) for s in stats), default=0.0)
        return {"sync/bytes": float(total_bytes), "sync/seconds": float(seconds),
                "sync/bytes_per_s": float(total_bytes / seconds) if seconds else 0.0}

    def push_to_restarted(self, server: int) -> None:
        """The current weights into restarted server ``server`` (new URL) alone."""
        if self.adapters is not None:
            self.adapters.push_to_restarted(server, self.version)
            return
        self.actor.call("close_pusher")
        self._target = self.target()
        self.heals += 1
        with weight_update_session([self.servers.urls[server]], api_key=self.servers.api_key):
            self.actor.call("push_to_server", self._target, self.version, server, f"heal{self.heals}")

    def close(self) -> None:
        """Leave the update groups on every rank; a failed worker must not keep the others from
        shutting down."""
        try:
            self.actor.call("close_pusher")
        except Exception as e:  # noqa: BLE001 - teardown
            note(f"closing weight-sync connections failed: {type(e).__name__}: {e}")
