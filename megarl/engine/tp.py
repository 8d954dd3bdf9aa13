"""Tensor-parallel ranks of the embedded server: process groups, lockstep calls, child processes.

A `--tp-size N` server is N processes on one node. Rank 0 is the `megarl serve` process: it runs
HTTP and the engine loop. Ranks 1..N-1 are children that hold their shard of the model and do
nothing on their own: every model call and weight op is made on rank 0 through `Lockstep.call`,
which first broadcasts `(method, args)` over a gloo control group (CPU), then runs it locally;
each follower receives the same calls in the same order and runs them (`follow`). So all
collectives -- the TP all-reduces inside the forward (default group: gloo on CPU, NCCL on CUDA,
one GPU per rank: rank r uses cuda:r of CUDA_VISIBLE_DEVICES), the weight-update broadcasts, the
verdict exchange -- are issued in one order on one thread per rank, never concurrently.

Failure model: a weight op never throws on one rank only (errors are exchanged with `agree`, and
every rank raises the same `RankFailure`); any other exception while ranks > 1 are running means
they may be out of step, so rank 0 shuts the server down (`on_fatal`) and a follower exits.
Followers die with rank 0: PR_SET_PDEATHSIG (SIGTERM when the spawning thread -- rank 0's main
thread -- dies), a check that the parent is still the one that spawned them, and rank 0 stops
them (a `stop` call, then terminate/kill) on shutdown and watches them while it runs.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.wire.process_group import bound_store

log = logging.getLogger("megarl.rollout.tp")

# Followers wait in the control broadcast between calls for as long as the server is idle.
IDLE_TIMEOUT = timedelta(days=365)
PARENT_PID_ENV = "MEGARL_TP_PARENT_PID"
_PR_SET_PDEATHSIG = 1


class RankFailure(RuntimeError):
    """An op failed on at least one TP rank; raised on every rank alike (after `agree`)."""


def combine_errors(errors: Sequence[Optional[str]]) -> Optional[str]:
    """One message for the ranks' errors (None when every rank succeeded); identical messages
    are reported once, with the ranks that gave them."""
    if all(e is None for e in errors):
        return None
    if len(errors) == 1:
        return errors[0]
    by_msg: Dict[str, List[int]] = {}
    for r, e in enumerate(errors):
        if e is not None:
            by_msg.setdefault(e, []).append(r)
    return "; ".join(f"tp rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {m}" for m, rs in by_msg.items())


@dataclass
class TPComm:
    """This rank's view of the server's TP group (size 1: no process group at all)."""

    rank: int = 0
    size: int = 1
    ctrl: Any = None          # gloo group: calls and verdicts
    tensors: Any = None       # default group: all-reduces of activations (gloo / NCCL)

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.tensors)

    def agree(self, error: Optional[str]) -> List[Optional[str]]:
        """Every rank's error (None = ok), on every rank."""
        if self.size == 1:
            return [error]
        out: List[Optional[str]] = [None] * self.size
        dist.all_gather_object(out, error, group=self.ctrl)
        return out

    def check(self, error: Optional[str], prefix: str = "") -> None:
        """`agree`, then raise RankFailure on every rank if any rank failed."""
        msg = combine_errors(self.agree(error))
        if msg is not None:
            raise RankFailure(prefix + msg)

    def send_call(self, call: tuple) -> None:
        dist.broadcast_object_list([call], src=0, group=self.ctrl)

    def recv_call(self) -> tuple:
        box: List[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]


_BOUND_STORES: dict = {}   # port -> the TCP store rank 0's process bound before spawning the other ranks


def open_tp_store(size: int) -> int:
    """Rank 0's process, before the other ranks exist: bind the TP group's loopback store on a port
    the kernel picks and keep it for `init_tp`. Probing a free port and binding it later left a
    window in which another process could take it (EADDRINUSE at start-up)."""
    store = bound_store("127.0.0.1", size, 300)
    _BOUND_STORES[store.port] = store
    return store.port


def init_tp(rank: int, size: int, port: int, device: torch.device) -> TPComm:
    """Join the server's TP group (loopback TCP store on `port`, served by rank 0: the one
    `open_tp_store` bound, or bound here)."""
    if size == 1:
        return TPComm()
    store = _BOUND_STORES.pop(port, None) if rank == 0 else None
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=(rank == 0), timeout=timedelta(seconds=300))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    ctrl = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_TIMEOUT)
    return TPComm(rank=rank, size=size, ctrl=ctrl, tensors=dist.group.WORLD)


class Lockstep:
    """Rank 0's way to call the rank worker: the same call on every TP rank, in one order.

    Only one thread may call (the engine thread, or the loader before the engine starts)."""

    def __init__(self, target: Any, comm: TPComm, on_fatal: Optional[Callable[[str], None]] = None):
        self.target = target
        self.comm = comm
        self.on_fatal = on_fatal
        self._lock = threading.Lock()   # guards against a second calling thread by mistake
        self.broken: Optional[str] = None

    def call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self.broken:
                raise RuntimeError(f"TP ranks out of service: {self.broken}")
            if self.comm.size > 1:
                self.comm.send_call((method, args))
            try:
                return getattr(self.target, method)(*args)
            except RankFailure:
                raise                       # every rank raised it: still in step
            except Exception as e:
                if self.comm.size > 1:
                    self.broken = f"{method} failed on tp rank 0: {type(e).__name__}: {e}"
                    log.exception("TP rank 0: %s failed; ranks may be out of step, shutting down", method)
                    if self.on_fatal:
                        self.on_fatal(self.broken)
                raise

    def stop(self) -> None:
        """Tell the followers to exit (best effort)."""
        if self.comm.size > 1 and not self.broken:
            with self._lock:
                try:
                    self.comm.send_call(("__stop__", ()))
                except Exception:  # noqa: BLE001 - a follower already gone
                    pass


def follow(target: Any, comm: TPComm) -> None:
    """A follower's loop: run rank 0's calls until `__stop__`."""
    while True:
        method, args = comm.recv_call()
        if method == "__stop__":
            return
        try:
            getattr(target, method)(*args)
        except RankFailure:
            continue                        # rank 0 raised the same
        except Exception:
            log.exception("tp rank %d: %s failed; exiting", comm.rank, method)
            raise


# ---------------------------------------------------------------- follower processes
def die_with_parent() -> None:
    """In a follower: get SIGTERM when the process that spawned us dies, and exit now if it
    already has (it may have died before the prctl)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        log.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent to stop this rank")
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)


class Followers:
    """Rank 0's handle on ranks 1..N-1 (child processes)."""

    def __init__(self, procs: List[subprocess.Popen]):
        self.procs = procs
        self._stopping = False

    @classmethod
    def spawn(cls, size: int, options: Dict[str, Any], env: Dict[str, str]) -> "Followers":
        """Start ranks 1..size-1 (`python -m megarl.engine.follower RANK OPTIONS_JSON`).
        Call from the main thread: PR_SET_PDEATHSIG fires when the spawning THREAD exits."""
        env = dict(env, **{PARENT_PID_ENV: str(os.getpid())})
        procs = [subprocess.Popen([sys.executable, "-m", "megarl.engine.follower", str(r), json.dumps(options)],
                                  env=env, stdin=subprocess.DEVNULL)
                 for r in range(1, size)]
        return cls(procs)

    def watch(self, on_death: Callable[[str], None], interval_s: float = 0.5) -> None:
        """Call `on_death` (once) from a daemon thread if a follower exits while we run."""
        def loop():
            while not self._stopping:
                for r, p in enumerate(self.procs, start=1):
                    code = p.poll()
                    if code is not None and not self._stopping:
                        on_death(f"tp rank {r} exited with code {code}")
                        return
                time.sleep(interval_s)
        threading.Thread(target=loop, name="megarl-tp-watch", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the followers to exit (after `Lockstep.stop`), then terminate / kill them."""
        self._stopping = True
        deadline = time.time() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
