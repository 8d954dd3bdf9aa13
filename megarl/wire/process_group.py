"""A torch.distributed process group between processes that are NOT in one default world.

Trainer ranks already live in megatron's default group; rollout servers live in their own
processes.  The weight-update group joins one trainer rank (rank 0) with every rollout rank
(rank_offset..) over its own TCP store, the same way sglang's `init_custom_process_group` does
(`sglang/srt/utils/common.py`), so a megarl trainer can join a real sglang server's group.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megarl.wire.addresses import gloo_interface


def bound_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A rendezvous store that this process serves, bound on ``host`` at a port the kernel picks;
    its ``.port`` is what the other ranks are told. Probing a free port and binding it later
    leaves a window in which another process takes it (EADDRINUSE at start-up); a bound store
    has none. Returns at once: the ranks join when they are started."""
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: Optional[timedelta] = None, store=None):
    """SGLang's ``init_custom_process_group``: a process group outside the default one. ``store``:
    a store this rank already holds (rank 0's TCPStore bound before the others were told its port,
    so no other process can take the port in between); otherwise ``init_method``'s rendezvous."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, default_pg_timeout, rendezvous)
    timeout = timeout or default_pg_timeout
    if str(backend) == "gloo":
        # bind the interface that routes to the master, not what the hostname resolves to
        # (loopback on Debian-style hosts: peers on other nodes would be told to dial 127.0.0.1)
        from urllib.parse import urlparse

        bind_gloo_towards(urlparse(init_method).hostname or "127.0.0.1")
    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def bind_gloo_towards(master_addr: str) -> None:
    """Make gloo (every group this process creates from now on) bind the interface that routes to
    the rendezvous master, unless ``GLOO_SOCKET_IFNAME`` is set already.

    Why: without it gloo binds whatever the hostname resolves to, which is loopback on hosts
    whose /etc/hosts maps the hostname to 127.0.x.1, and then tells its peers on other nodes to dial
    127.0.0.1 ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). A loopback master means all
    ranks are on this host, where gloo's default works.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    interface = gloo_interface(master_addr)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


_ABANDONED: list = []   # groups left with a broadcast in flight: never destroyed in this process


def abandon_group(pg) -> None:
    """Keep ``pg`` (a weight-update group whose broadcast was abandoned, e.g. refused by a server)
    alive and out of the way: destroying it -- directly or by destroying every group -- waits for
    that broadcast (~100 s seen). Process exit releases it."""
    if pg is not None:
        _ABANDONED.append(pg)


def has_abandoned_groups() -> bool:
    return bool(_ABANDONED)


def destroy_group(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:
        pass


def tcp(addr: str, port: int) -> str:
    return f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"
