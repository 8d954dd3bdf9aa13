"""Run untrusted Python in a real sandbox: bubblewrap namespaces plus kernel resource limits.

Isolation (``bwrap``, Debian ``bubblewrap``): new user, PID, network, IPC and UTS namespaces
(``--unshare-all``: no network at all, only a loopback device that reaches nothing), the host
filesystem mounted read-only (``--ro-bind / /``), a private size-capped tmpfs at ``/tmp`` (the
only writable place, also the working directory), a fresh ``/dev`` and ``/proc``, its own session
(no terminal injection) and death with its parent.

Limits (``setrlimit`` in the child before ``bwrap`` starts, inherited by everything inside):
CPU seconds (``RLIMIT_CPU``: SIGXCPU), address space (``RLIMIT_AS``: allocations fail with
MemoryError), processes (``RLIMIT_NPROC``: a fork bomb gets EAGAIN), file size (``RLIMIT_FSIZE``:
caps every file the code writes *and* its stdout/stderr, which go to files, so output cannot
flood the trainer's memory), and a wall-clock limit enforced from outside (the whole process
group is killed). As root, the sandbox runs under an unused uid of its own per concurrent slot:
the kernel does not apply ``RLIMIT_NPROC`` to root, and a per-slot uid keeps one sandbox's
processes from counting against another's.
"""
from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

SANDBOX_UID_BASE = 61000


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5                 # CPU seconds of the code
    wall_s: float = 10.0           # wall-clock seconds before the whole sandbox is killed
    memory_mb: int = 1024          # address space
    output_bytes: int = 16384      # stdout and stderr each; also the largest file it may write
    nproc: int = 32                # processes/threads of the sandbox's uid
    tmp_mb: int = 64               # size of its private /tmp


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int
    killed: Optional[str] = None   # why it was stopped (limit reached), None when it exited by itself
    seconds: float = 0.0

    def observation(self, max_chars: int = 2000) -> str:
        """What the model sees: its output, errors, and a plain sentence when a limit stopped it."""
        parts = []
        if self.stdout:
            parts.append(self.stdout[-max_chars:])
        if self.stderr:
            parts.append("stderr:\n" + self.stderr[-max_chars:])
        if self.killed:
            parts.append(f"[sandbox: {self.killed}]")
        elif self.exit_code != 0:
            parts.append(f"[sandbox: exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


class _UidSlots:
    """One unused uid per concurrent sandbox (root only)."""

    def __init__(self, n: int = 256):
        self._free = list(range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + n))
        self._cond = threading.Condition()

    def take(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def give(self, uid: int) -> None:
        with self._cond:
            self._free.append(uid)
            self._cond.notify()


_SLOTS = _UidSlots()


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise FileNotFoundError("the python sandbox needs bubblewrap: apt-get install bubblewrap")
    return path


def bwrap_command(argv: list[str], tmp_mb: int) -> list[str]:
    return [bwrap_path(), "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/", "/",
            "--dev", "/dev", "--proc", "/proc", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
            "--chdir", "/tmp", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--", *argv]


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), python: str = "python3") -> SandboxResult:
    """Run ``code`` with ``python -I`` in the sandbox; blocks up to ``limits.wall_s`` (+ teardown)."""
    uid = _SLOTS.take() if os.geteuid() == 0 else None
    out_dir = tempfile.mkdtemp(prefix="megarl-sandbox-")
    t0 = time.perf_counter()
    try:
        out_path, err_path = os.path.join(out_dir, "stdout"), os.path.join(out_dir, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            def child() -> None:
                cap = limits.output_bytes
                resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
                resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
                resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                if uid is not None:
                    resource.setrlimit(resource.RLIMIT_NPROC, (limits.nproc, limits.nproc))
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
            proc = subprocess.Popen(bwrap_command([python, "-I", "-c", code], limits.tmp_mb), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, preexec_fn=child, start_new_session=True, close_fds=True,
                                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
            killed = None
            try:
                rc = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                killed = f"killed at the wall-clock limit of {limits.wall_s:g}s"
        stdout = _read(out_path, limits.output_bytes)
        stderr = _read(err_path, limits.output_bytes)
        if killed is None:
            killed = _limit_hit(rc, stdout, stderr, limits)
        return SandboxResult(stdout, stderr, rc, killed, time.perf_counter() - t0)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        if uid is not None:
            _SLOTS.give(uid)


def _read(path: str, cap: int) -> str:
    with open(path, "rb") as f:
        return f.read(cap).decode("utf-8", errors="replace")


def _limit_hit(rc: int, stdout: str, stderr: str, limits: SandboxLimits) -> Optional[str]:
    """The limit that stopped the code, from its exit status and output (None: it just exited)."""
    sig = rc - 128 if rc > 128 else -rc if rc < 0 else 0
    if sig == signal.SIGXCPU or sig == signal.SIGKILL:
        return f"killed at the CPU-time limit of {limits.cpu_s}s"
    if len(stdout.encode()) >= limits.output_bytes or len(stderr.encode()) >= limits.output_bytes \
            or "File too large" in stderr:
        return f"output limit of {limits.output_bytes} bytes reached"
    if "MemoryError" in stderr:
        return f"memory limit of {limits.memory_mb} MiB reached"
    if "BlockingIOError" in stderr and "Resource temporarily unavailable" in stderr:
        return f"process limit of {limits.nproc} reached"
    if sig:
        return f"killed by signal {signal.Signals(sig).name}"
    return None
