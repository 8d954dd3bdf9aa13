"""Run untrusted Python in a real sandbox: bubblewrap namespaces plus kernel resource limits.

Isolation (``bwrap``, Debian ``bubblewrap``): new PID, network, IPC and UTS namespaces (no network
at all, only a loopback device that reaches nothing), its own session (no terminal injection),
death with its parent, a fresh ``/dev`` and a fresh ``/proc`` of its own PID namespace (not the
host's processes), and an environment of a fixed minimal set (``SANDBOX_ENV``, ``--clearenv``).

Filesystem: only what the interpreter needs, read-only -- ``/usr`` and the ``/bin``, ``/lib*``
links or directories, the dynamic linker's cache, the interpreter's prefix (a venv, pyenv or conda
directory; the stdlib lives there or under ``/usr``) and the site-packages directories on its
``sys.path`` (``python -I``: no user site), found by asking the interpreter once. When those live
in a home directory (a venv in ``~/venv``, pyenv in ``/root/.pyenv``) exactly those directories are
mounted, never the home itself. Extra read-only mounts are only the ones named in config
(``agent.env_args.mounts``: an environment's fixtures, never its answers). Everything else --
``/home``, ``/root``, ``/etc``, the project, data, checkpoints, outputs -- does not exist inside.
The only writable places are a private tmpfs at ``/tmp`` (the working directory, holding the empty
home ``/tmp/home``) and one at ``/dev/shm`` (POSIX semaphores and shared memory, which
``multiprocessing`` needs), each capped at ``tmp_mb``; the rest of ``/dev`` is read-only (its
device nodes still work). Model-written code cannot read a credential (``~/.netrc``,
``~/.ssh``), a data file with the answers, or a checkpoint, whatever user the trainer runs as.

Limits, set in the child before ``bwrap`` starts and inherited by everything inside: CPU seconds
(``RLIMIT_CPU``: SIGXCPU), address space (``RLIMIT_AS``: allocations fail with MemoryError), file
size (``RLIMIT_FSIZE``: caps every file the code writes *and* its stdout/stderr, which go to files,
so output cannot flood the trainer's memory); a wall-clock limit enforced from outside (the whole
process group is killed). Processes and threads (``RLIMIT_NPROC`` = ``nproc``: a fork bomb gets
EAGAIN) are limited by ``prlimit`` inside the sandbox's own user namespace, right before the
interpreter starts: there the kernel counts only that namespace's tasks (bubblewrap's reaper
may be one), so the cap holds however many processes the trainer's user runs, and one sandbox's
processes never count against another's. (Set before ``bwrap``, it would count every process of
the user: ``bwrap`` itself could not start, or the cap would be far above ``nproc``.)

User namespaces: the code cannot create one (``unshare(CLONE_NEWUSER)`` fails with ENOSPC):
bubblewrap's ``--disable-userns`` (0.8 and later; without it a warning is logged once and the
rest still holds) sets ``user.max_user_namespaces`` to 1 in the sandbox's namespace and then makes
that one itself, for the code to run in.

Users: an ordinary user runs ``bwrap`` unprivileged (a user namespace) and the code runs as that
user, who can see nothing but the mounts above. As root, ``bwrap`` mounts as root (so an
interpreter under ``/root`` can be mounted), then drops to an unused uid of its own per
concurrent slot (``setpriv``, no new privileges; the kernel applies no ``RLIMIT_NPROC`` to root),
and a second ``bwrap`` run by that uid inside the first one, seeing the same filesystem, adds the
user namespace that ``--disable-userns`` and the process count need.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

SANDBOX_UID_BASE = 61000
log = logging.getLogger("megarl.envs.sandbox")


class SandboxCrashed(RuntimeError):
    """The sandbox itself could not run the code (its interpreter or ``bwrap`` failed to start):
    not the model's doing, so the trajectory has no reward (its declared failure ``reason``:
    ``megarl.errors.failure_reason``)."""

    reason = "sandbox_crashed"


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5                 # CPU seconds of the code
    wall_s: float = 10.0           # wall-clock seconds before the whole sandbox is killed
    memory_mb: int = 1024          # address space
    output_bytes: int = 16384      # stdout and stderr each; also the largest file it may write
    nproc: int = 32                # processes and threads inside the sandbox
    tmp_mb: int = 64               # size of its private /tmp, and of its /dev/shm


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


# The environment inside, and nothing else. One BLAS/OpenMP thread: numpy's thread pool would
# otherwise start one thread per host core and run into RLIMIT_NPROC and RLIMIT_AS.
SANDBOX_HOME = "/tmp/home"
SANDBOX_ENV = {"HOME": SANDBOX_HOME, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Host paths every interpreter needs; a symlink (merged /usr: /bin -> usr/bin) stays a symlink.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)
# Asked of the interpreter once (python -I, as the tool code will run): where it lives, what it imports.
_PROBE = ("import json, sys; print(json.dumps({'executable': sys.executable, 'prefix': sys.prefix, "
          "'base_prefix': sys.base_prefix, 'path': sys.path}))")


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise FileNotFoundError("the python sandbox needs bubblewrap: apt-get install bubblewrap")
    return path


def util_linux(name: str) -> str:
    """A util-linux tool (``prlimit``, ``setpriv``) from the system dirs, which the sandbox mounts."""
    path = shutil.which(name, path="/usr/bin:/bin")
    if path is None:
        raise FileNotFoundError(f"the python sandbox needs {name} (util-linux)")
    return path


@functools.lru_cache(maxsize=None)
def can_disable_userns() -> bool:
    """Whether this host's bubblewrap has ``--disable-userns`` (0.8 and later). Without it the code
    could create user namespaces of its own (kernel attack surface), so that is logged once."""
    r = subprocess.run([bwrap_path(), "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if "--disable-userns" in r.stdout + r.stderr:
        return True
    log.warning("bubblewrap at %s has no --disable-userns (needs 0.8+): sandboxed code can create user "
                "namespaces", bwrap_path())
    return False


@dataclass(frozen=True)
class Interpreter:
    """A Python as the sandbox runs it: the path to execute and the host directories it needs."""

    executable: str
    mounts: tuple[str, ...]


def _under(path: str, parents: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def _homes() -> list[str]:
    """The home directories of people on this host (root, uids >= 1000), /home and /root: never
    mounted whole (system accounts' "homes" such as /usr/sbin are not homes)."""
    homes = {"/home", "/root", os.path.expanduser("~")}
    homes.update(u.pw_dir for u in pwd.getpwall() if (u.pw_uid == 0 or u.pw_uid >= 1000) and u.pw_dir not in ("", "/"))
    return sorted(os.path.realpath(h) for h in homes)


def interpreter_mounts(executable: str, prefix: str, base_prefix: str, path: Sequence[str]) -> tuple[str, ...]:
    """The read-only mounts of an interpreter: its prefixes (venv and base) and every site-packages
    directory on its ``sys.path`` (a .pth may add another environment's), real paths, outermost
    only, nothing under the system dirs (mounted anyway). A prefix that is a home directory or holds
    one is never mounted whole; then only its stdlib and site-packages entries are."""
    homes = _homes()
    candidates = []
    for prefix_dir in (base_prefix, prefix):
        real = os.path.realpath(prefix_dir)
        if not any(_under(h, [real]) for h in homes) and real != "/":
            candidates.append(real)
    for entry in path:
        real = os.path.realpath(entry) if entry else ""
        if real and os.path.isdir(real) and (real.endswith(("site-packages", "dist-packages")) or
                                             _under(real, [os.path.realpath(base_prefix)])):
            candidates.append(real)
    candidates.append(os.path.realpath(executable))
    out: list[str] = []
    for c in sorted(set(candidates), key=len):           # parents sort before their children
        if os.path.exists(c) and not _under(c, list(SYSTEM_DIRS) + out):
            out.append(c)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def interpreter(python: str) -> Interpreter:
    """What ``python`` needs inside the sandbox (asked once per interpreter and process)."""
    try:
        r = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
    except OSError as e:
        raise FileNotFoundError(f"sandbox interpreter {python!r}: {e.strerror or e}") from None
    if r.returncode != 0:
        raise RuntimeError(f"sandbox interpreter {python!r} failed: {r.stderr.strip()[-500:]}")
    info = json.loads(r.stdout)
    return Interpreter(info["executable"],
                       interpreter_mounts(info["executable"], info["prefix"], info["base_prefix"], info["path"]))


def _parents(path: str) -> list[str]:
    """``/a``, ``/a/b`` for ``/a/b/c``: created 0755 in the sandbox before ``path`` is mounted."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def filesystem_args(mounts: Sequence[str], tmp_mb: int) -> list[str]:
    """bwrap arguments of the sandbox's filesystem: system dirs, ``mounts`` (read-only, same path
    inside), a fresh /dev and /proc, the private /tmp with the empty home, the rest read-only."""
    args: list[str] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in SYSTEM_FILES:
        args += ["--ro-bind-try", f, f]
    made: set[str] = set()
    for m in mounts:
        for parent in _parents(m):
            if parent not in made and not _under(parent, SYSTEM_DIRS):
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", m, m]
    return args + [*dev_args(tmp_mb), "--proc", "/proc", "--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs",
                   "/tmp", "--perms", "1777", "--dir", SANDBOX_HOME, "--chdir", "/tmp", "--remount-ro", "/"]


def dev_args(tmp_mb: int) -> list[str]:
    """A fresh /dev, read-only but for its device nodes, with a /dev/shm capped at ``tmp_mb``: bwrap's
    plain ``--dev`` is a writable tmpfs of half the host's RAM, owned by an ordinary user who runs it."""
    return ["--dev", "/dev", "--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev"]


def nproc_limited(argv: list[str], nproc: int) -> list[str]:
    """``argv`` run under ``RLIMIT_NPROC`` = ``nproc`` (soft and hard), set by ``prlimit`` where it
    stands: inside the sandbox's user namespace, where the kernel counts only that namespace's tasks."""
    return [util_linux("prlimit"), f"--nproc={nproc}:{nproc}", "--", *argv]


def bwrap_command(argv: list[str], tmp_mb: int, mounts: Sequence[str] = (), run_as: Optional[int] = None,
                  nproc: int = SandboxLimits.nproc) -> list[str]:
    """The full command: namespaces, environment, filesystem, then ``argv`` limited to ``nproc``
    processes -- as uid ``run_as`` (root only: bwrap mounts as root, then ``setpriv`` drops every
    privilege and a second bwrap adds the user namespace, seeing the same filesystem)."""
    env = [a for k, v in SANDBOX_ENV.items() for a in ("--setenv", k, v)]
    path = os.pathsep.join(dict.fromkeys([os.path.dirname(argv[0]), "/usr/bin", "/bin"]))
    head = [bwrap_path(), "--die-with-parent", "--new-session", "--clearenv", *env, "--setenv", "PATH", path]
    no_userns = ["--disable-userns"] if can_disable_userns() else []
    code = nproc_limited(argv, nproc)
    if run_as is None:
        return [*head, "--unshare-all", "--unshare-user", *no_userns, *filesystem_args(mounts, tmp_mb), "--", *code]
    drop = [util_linux("setpriv"), f"--reuid={run_as}", f"--regid={run_as}", "--clear-groups", "--no-new-privs", "--"]
    inner = nested_bwrap() if no_userns else []
    if inner and not _under(inner[0], SYSTEM_DIRS):
        mounts = [*mounts, inner[0]]
    return [*head, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", *filesystem_args(mounts, tmp_mb), "--",
            *drop, *inner, *code]


def nested_bwrap() -> list[str]:
    """As root, the second bwrap: run by the dropped uid inside the first, seeing its filesystem as
    it is (``--dev-bind / /``), it adds the user namespace that ``--disable-userns`` closes and in
    which the process count is kept. (The first cannot: as root it makes no user namespace, and
    one made there would map root, not the unused uid the code must run as.)"""
    return [os.path.realpath(bwrap_path()), "--die-with-parent", "--unshare-user", "--disable-userns",
            "--dev-bind", "/", "/", "--chdir", "/tmp", "--"]


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), python: Optional[str] = None,
               mounts: Sequence[str] = ()) -> SandboxResult:
    """Run ``code`` with ``python -I`` (default: this process's interpreter) in the sandbox, with
    ``mounts`` (host paths) also visible read-only; blocks up to ``limits.wall_s`` (+ teardown)."""
    try:
        interp = interpreter(python or sys.executable)
    except (OSError, RuntimeError, ValueError) as err:
        raise SandboxCrashed(f"sandbox interpreter: {err}") from err
    extra = tuple(os.path.abspath(m) for m in mounts)
    for m in extra:
        if any(_under(home, [os.path.realpath(m)]) for home in _homes()):
            raise ValueError(f"sandbox mount {m!r} would show tool code a home directory")
    uid = _SLOTS.take() if os.geteuid() == 0 else None
    out_dir = tempfile.mkdtemp(prefix="megarl-sandbox-")
    t0 = time.perf_counter()
    try:
        out_path, err_path = os.path.join(out_dir, "stdout"), os.path.join(out_dir, "stderr")
        command = bwrap_command([interp.executable, "-I", "-c", code], limits.tmp_mb, interp.mounts + extra, uid,
                                limits.nproc)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            def child() -> None:
                cap = limits.output_bytes
                resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
                resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
                resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            try:
                proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, preexec_fn=child,
                                        start_new_session=True, close_fds=True,
                                        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
            except (OSError, subprocess.SubprocessError) as crash:   # bwrap missing, fork refused, a limit unsettable
                raise SandboxCrashed(f"sandbox did not start: {type(crash).__name__}: {crash}") from crash
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
