"""Local multi-process launcher: ``spawn(fn, world_size, *args)``.

Runs ``fn(rank, world_size, *args)`` in ``world_size`` processes on one host, with
``torch.distributed`` already initialised (gloo on CPU, nccl with CUDA) on a free loopback port,
``OMP_NUM_THREADS=1`` and one torch thread per worker. Returns the list of per-rank return values
(must be picklable). If any rank raises, :class:`SpawnError` is raised in the caller with that
rank's traceback; the remaining ranks are terminated after a short grace period (they are
probably blocked in a collective).

Start method: ``fork`` by default on Linux (the parent's imports of torch/megatron are reused, so a
2-rank test costs well under a second of start-up); ``forkserver`` once the parent holds threads,
with the same modules imported once in the forkserver (``megarl.parallel.preload``) and not again in
each rank; ``method="spawn"`` for a clean interpreter (``fn`` must then be importable at module level).
"""
from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from typing import Any, Callable, List, Optional

import multiprocessing as mp

from .dist import AGENT_STORE


class SpawnError(RuntimeError):
    """A rank failed; ``.rank`` and ``.remote_traceback`` tell which and where."""

    def __init__(self, rank: int, remote_traceback: str):
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")


def _worker(fn, rank, world_size, port, args, q, backend, timeout_s, init):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
                       AGENT_STORE: "True"})   # the launcher holds the store: every rank is its client
    try:
        import torch
        torch.set_num_threads(1)
        if init:
            from .dist import init_distributed
            init_distributed(backend=backend, timeout_s=timeout_s)
        result = fn(rank, world_size, *args)
        # plain pickle bytes: through the queue's own pickler torch tensors would travel as
        # shared-memory handles that die with this process, and the parent could not read them
        try:
            data = pickle.dumps(result)
        except Exception:
            data = pickle.dumps(repr(result))
        q.put((rank, True, data))
    except BaseException:  # noqa: BLE001 - report everything, incl. SystemExit
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from .dist import destroy_distributed
            destroy_distributed()
        except Exception:
            pass


PRELOAD = ("megatron.core.models.gpt.gpt_model", "megatron.core.pipeline_parallel",
           "megatron.core.dist_checkpointing", "transformers")


FORKSERVER_PRELOAD = "megarl.parallel.preload"   # imports PRELOAD, ignoring failures


def _preload(mods):
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in mods:
            try:
                importlib.import_module(m)
            except Exception:
                pass


def _default_method() -> str:
    """``fork`` (fast: megatron imported once) while this process is still single-threaded and has
    no process group; ``forkserver`` once it holds threads (Ray's gRPC, an asyncio loop, gloo):
    forking those segfaulted children inside ``initialize_model_parallel``."""
    import threading

    import torch.distributed as dist

    if not sys.platform.startswith("linux"):
        return "spawn"
    busy = threading.active_count() > 1 or (dist.is_available() and dist.is_initialized()) or "ray" in sys.modules
    return "forkserver" if busy else "fork"


def spawn(fn: Callable[..., Any], world_size: int, *args, backend: Optional[str] = None,
          timeout_s: float = 300.0, method: Optional[str] = None, init: bool = True,
          collective_timeout_s: Optional[float] = None, preload=PRELOAD) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; see module doc.

    With ``fork``, ``preload`` modules (megatron, transformers) are imported in the parent first.
    ``timeout_s`` bounds the whole run; ``collective_timeout_s`` (default ``min(timeout_s, 120)``)
    is the process-group timeout handed to ``init_distributed``.
    """
    method = method or _default_method()
    if method == "fork" and preload:
        _preload(preload)  # import once in the parent instead of N times in the children
    elif method == "forkserver" and preload:
        # the forkserver imports them once when it starts (its first child, in this process's
        # lifetime); the ranks it forks then start with them imported, as with fork
        mp.set_forkserver_preload([FORKSERVER_PRELOAD])
    ctx = mp.get_context(method)
    # the rendezvous store is bound here, now, and every rank dials it (torchelastic's agent-store
    # convention, TORCHELASTIC_USE_AGENT_STORE): no window between finding a free port and binding it
    from megarl.wire.process_group import bound_store

    store = bound_store("127.0.0.1", world_size, timeout_s)
    port = store.port
    q = ctx.Queue()
    cto = collective_timeout_s if collective_timeout_s is not None else min(timeout_s, 120.0)
    procs = [ctx.Process(target=_worker, daemon=False,
                         args=(fn, r, world_size, port, args, q, backend, cto, init))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict = {}
    failure = None
    deadline = time.time() + timeout_s
    try:
        while len(results) < world_size and failure is None:
            try:
                rank, ok, payload = q.get(timeout=0.2)
            except Exception:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in results]
                if dead:
                    # give its message a chance to arrive (a rank that exited cleanly has sent it; on a
                    # loaded machine the parent may see the exit before the queue's data)
                    wait_until = time.time() + (10.0 if all(procs[r].exitcode == 0 for r in dead) else 0.5)
                    while q.empty() and time.time() < wait_until:
                        time.sleep(0.1)
                    if q.empty():
                        r = dead[0]
                        failure = SpawnError(r, f"process exited with code {procs[r].exitcode} "
                                                f"without reporting (crash / killed)")
                if time.time() > deadline:
                    missing = [r for r in range(world_size) if r not in results]
                    failure = SpawnError(missing[0], f"spawn timed out after {timeout_s}s; "
                                                     f"ranks {missing} did not finish")
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failure = SpawnError(rank, payload)
    finally:
        grace = time.time() + (3.0 if failure is not None else 30.0)
        for p in procs:
            p.join(timeout=max(0.0, grace - time.time()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        q.close()
    if failure is not None:
        raise failure
    return [results[r] for r in range(world_size)]
