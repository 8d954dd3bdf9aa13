"""A Megatron rank's Python stack, readable from outside the rank while the rank is stuck.

Why here, on the rank side: a hung phase leaves the driver blocked in ``ray.get`` and every rank
inside a method (an actor runs one call at a time), so nothing can *ask* a rank for its stack. Two
ways still work, both from another process on the rank's node:

* a live rank (blocked in a gloo/NCCL wait, a CUDA sync, a lock) dumps every thread's stack when it
  gets :data:`STACK_SIGNAL`: :func:`arm` registers ``faulthandler`` for it at start-up, writing to a
  per-rank file. faulthandler writes from the C signal handler, so a rank whose main thread sits in
  C code without the GIL still answers;
* a stopped rank (``T (stopped)``: SIGSTOP, a frozen cgroup) runs no handler at all; its stack is
  read from its memory by ``py-spy dump --nonblocking`` (ptrace rights over the rank: same user and
  ``kernel.yama.ptrace_scope`` <= 1 for a child, or CAP_SYS_PTRACE). Without them the report still
  names its pid, host and /proc state.

:func:`inspect_ranks` does both for the ranks of one node; the driver's watchdog runs it on each node
(``megarl/watchdog.py``). This module imports nothing of megarl, so it runs in a bare Ray task.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

STACK_SIGNAL = signal.SIGUSR2   # SIGUSR1 is the driver's SLURM time-limit signal; ranks leave USR2 unused
_ARMED: dict[str, Any] = {}     # keeps the file faulthandler writes to open for the process's life


@dataclasses.dataclass(frozen=True)
class RankProcess:
    """Where one rank runs: what the watchdog needs to find it without asking it."""

    role: str
    rank: int
    pid: int
    host: str
    node_id: str          # Ray node id ("" outside Ray)
    stack_file: str       # where the rank's faulthandler writes on STACK_SIGNAL


@dataclasses.dataclass
class RankStack:
    """One rank as found when a deadline passed: its /proc state and its stack (or why none)."""

    process: RankProcess
    state: str            # "R (running)", "S (sleeping)", "T (stopped)", "gone", ...
    stack: str            # the threads' stacks, or "(no Python stack: why)"
    source: str           # faulthandler | py-spy | none
    reader: int = dataclasses.field(default_factory=os.getpid)   # the process that read it (driver or node task)

    @property
    def stopped(self) -> bool:
        """Stopped, traced-stopped, dead, reaped, or on a node that does not answer: a rank that
        cannot take part in a collective."""
        return self.state[:1] in ("T", "t", "Z", "X") or self.state == "gone" or self.state.startswith("unknown")


def arm(folder: str, role: str, rank: int) -> RankProcess:
    """Register this process's stack dump on :data:`STACK_SIGNAL` into ``folder/ROLE_rankR_pidP.txt``
    (appended: each dump adds all threads' stacks) and say where this rank runs. A process that hosts
    several ranks (backend ``local``: one rank of each role) keeps the first file: one handler per
    process, so every rank of it points at the file that handler writes."""
    armed = _ARMED.get("file")
    if armed is not None and Path(armed.name).parent == Path(folder):
        path = Path(armed.name)
    else:
        path = Path(folder) / f"{role}_rank{rank}_pid{os.getpid()}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        out = open(path, "a", buffering=1)
        faulthandler.register(STACK_SIGNAL, file=out, all_threads=True, chain=False)
        _ARMED["file"] = out
        if armed is not None:
            armed.close()
    return RankProcess(role, rank, os.getpid(), socket.gethostname(), _ray_node_id(), str(path))


def _ray_node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node id, and none is needed
        return ""


def proc_state(pid: int) -> str:
    """The /proc state of ``pid`` as ``ps`` shows it ("T (stopped)"), or "gone"."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "gone"


def py_spy() -> Optional[str]:
    """The py-spy executable next to this Python, or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def py_spy_dump(pid: int, timeout_s: float = 30.0) -> tuple[Optional[str], str]:
    """``py-spy dump --nonblocking`` of ``pid``: (its stacks, "") or (None, why not). Nonblocking:
    py-spy reads the process's memory without pausing it, which also works on a stopped process."""
    exe = py_spy()
    if exe is None:
        return None, "py-spy is not installed (pip install py-spy)"
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump did not answer within {timeout_s:.0f}s"
    if done.returncode != 0 or "Thread" not in done.stdout:
        why = (done.stderr or done.stdout).strip().splitlines()
        return None, f"py-spy dump failed ({why[-1] if why else f'exit {done.returncode}'}; ptrace not permitted?)"
    return done.stdout, ""


def _signal_dump(proc: RankProcess, wait_s: float) -> Optional[str]:
    """Send STACK_SIGNAL and return what the rank's handler appended to its file (None: nothing
    within ``wait_s``). The dump is complete when the file stops growing."""
    path = Path(proc.stack_file)
    before = path.stat().st_size if path.exists() else 0
    try:
        os.kill(proc.pid, STACK_SIGNAL)
    except OSError:
        return None
    deadline, size, still = time.monotonic() + wait_s, before, 0
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = path.stat().st_size if path.exists() else 0
        still = still + 1 if now == size and now > before else 0
        size = now
        if still >= 3:   # 0.3 s without growth after the first bytes
            break
    if size <= before:
        return None
    with open(path, "rb") as f:
        f.seek(before)
        return f.read().decode(errors="replace")


def inspect_ranks(procs: list[RankProcess], wait_s: float = 10.0) -> list[RankStack]:
    """Every rank of ``procs`` (all on this node): its state and stack. A live rank dumps through its
    faulthandler (py-spy if that stays silent); a stopped one is read by py-spy."""
    found = []
    for proc in procs:
        state = proc_state(proc.pid)
        stack, source = None, "none"
        if state == "gone":
            why = "the process is gone"
        else:
            if state[:1] not in ("T", "t", "Z"):
                stack = _signal_dump(proc, wait_s)
                source = "faulthandler" if stack else source
            why = ""
            if stack is None:
                stack, why = py_spy_dump(proc.pid)
                source = "py-spy" if stack else source
        found.append(RankStack(proc, state, stack or f"(no Python stack: {why})", source))
    return found
