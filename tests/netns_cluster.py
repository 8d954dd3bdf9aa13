"""A cluster in a box: N fake nodes on this machine, each a Linux network namespace, for tests.

Why: on one host every multi-node path (Ray placement, the torch.distributed rendezvous, servers
dialled by trainers) works whatever address is used, so an address bug (127.0.0.1, 127.0.1.1 from
``gethostbyname(gethostname())``) never shows. In a namespace a node has its own network stack:
its own address, its own loopback and its own ports. Dialling 127.0.0.1 or the wrong node fails
here as it does on a real cluster.

Layout (created as root by :meth:`NetnsCluster.start`, removed by :meth:`NetnsCluster.stop`)::

    <run>-br    a namespace holding only the bridge ``br0`` and the host ends ``v0..vN-1`` of the
                nodes' veth pairs
    <run>-n<i>  node i: ``lo`` up, ``eth0`` = SUBNET.<i+1>/24 (veth peer of ``v<i>``), a default
                route through ``eth0`` (real nodes have one; Ray and ``megarl_node_ip`` ask the
                routing table for their address)

``<run>`` is ``megarl-<pid>-<random>``. Commands enter a node with ``nsenter --net`` (the network
namespace only: the filesystem, /sys and cgroups stay the host's, as one machine's are). The root namespace gets nothing (no bridge, no link, no
route), so traffic between the nodes stays in namespaces this run made. Teardown (``stop``, also
from the context manager on failure, from SIGTERM turned into SystemExit, and at interpreter
exit) stops the processes this module started, then every process still inside the run's
namespaces (found with ``ip netns pids``: only processes started inside them), then deletes the
namespaces and the run's temp dir. ``start`` first removes namespaces and temp dirs of earlier
runs whose process is gone (a crashed or SIGKILLed test). Every wait has a deadline.

Signals and teardown: a namespace is recorded before ``ip netns add`` runs, so a signal that
interrupts ``start`` just after the kernel made it still has it deleted; SIGINT and SIGTERM are
held back while ``stop`` runs (main thread), so a second Ctrl-C or a CI's SIGTERM during the
teardown acts once it is done instead of cutting it short (which left the namespaces and their
processes behind, ``stop`` already marked done). A process that waits for a signal to tear down
should wait in short sleeps: CPython runs a Python-level handler only between bytecodes, so a
signal that lands after the last check and before a long ``time.sleep`` starts waits out the whole
sleep (under ``stress-ng --cpu 2`` on 2 cores, 3 of 900 SIGTERMs sent just after a holder printed
its line did).

:class:`RayBox` starts a Ray cluster over the nodes the way ``launch/slurm/common.sh`` and
``launch/ray_bootstrap.sh`` do: ``ray start --block`` per node with ``--node-ip-address``, fake GPUs
(``--num-gpus``), custom node resources (``megarl_train`` / ``megarl_rollout``), token auth with a
fresh ``RAY_AUTH_TOKEN``, a small object store; drivers run inside a node's namespace.

    with NetnsCluster(3) as box, RayBox(box, [{"megarl_train": 1}, {"megarl_rollout": 1}, {}]) as ray_box:
        out = ray_box.driver(0, ["-m", "tests.cluster_box_drivers", "addresses"], timeout=120)
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "megarl"
_RUN_RE = re.compile(r"^([A-Za-z0-9_]+-(\d+)-[0-9a-f]+)(-.*)?$")   # <prefix>-<pid>-<random>[-<role>]


def netns_available() -> Optional[str]:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if shutil.which("nsenter") is None:
        return "util-linux (`nsenter`) is not installed"
    return None


def _ip(*args: str, timeout: float = 20.0, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _kill_and_wait(pids: Sequence[int], timeout: float) -> None:
    """SIGTERM the given pids, wait up to ``timeout``, SIGKILL whatever is left."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + timeout
    for pid in pids:
        while pid_alive(pid) and time.time() < deadline:
            time.sleep(0.1)
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def namespace_pids(ns: str) -> list[int]:
    """Pids of the processes living in namespace ``ns`` (all of them were started inside it)."""
    proc = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _remove_namespaces(names: Sequence[str], timeout: float = 20.0) -> None:
    pids = [p for ns in names for p in namespace_pids(ns) if p != os.getpid()]
    _kill_and_wait(pids, timeout)
    for ns in names:
        _ip("netns", "delete", ns, check=False)


@contextlib.contextmanager
def _signals_held(signals: Sequence[int]) -> Iterator[None]:
    """Block ``signals`` in the main thread for the block's duration: one that arrives meanwhile
    is delivered (its handler runs) when the block ends, not in the middle of it. Elsewhere than
    the main thread, where Python handlers never run, nothing to do."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def clean_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces and temp dirs of earlier runs whose creating process is gone; returns
    the namespaces removed. A live creator (another test session running now) is left alone."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    stale = []
    for line in listed:
        name = line.split(" ", 1)[0].strip()
        m = _RUN_RE.match(name)
        if m and name.startswith(prefix + "-") and not pid_alive(int(m.group(2))):
            stale.append(name)
    _remove_namespaces(stale)
    tmp = Path("/tmp")
    for d in tmp.glob(f"{prefix}-*"):
        m = _RUN_RE.match(d.name)
        if m and d.is_dir() and not pid_alive(int(m.group(2))):
            shutil.rmtree(d, ignore_errors=True)
    return stale


class NetnsCluster:
    """N fake nodes, each a network namespace with its own address on a private bridge."""

    def __init__(self, nodes: int, subnet: str = "10.213.0", prefix: str = PREFIX):
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be 1..200, got {nodes}")
        self.run_id = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.prefix = prefix
        self.bridge_ns = f"{self.run_id}-br"
        self.names = [f"{self.run_id}-n{i}" for i in range(nodes)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(nodes)]
        self.tmp = Path("/tmp") / self.run_id
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._stopped = True
        self._old_sigterm: Any = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "NetnsCluster":
        why = netns_available()
        if why:
            raise RuntimeError(why)
        clean_stale(self.prefix)
        self._stopped = False
        atexit.register(self.stop)
        self._trap_sigterm()
        try:
            self.tmp.mkdir(parents=True)
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
                self._add_ns(ns)
                _ip("-n", self.bridge_ns, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.bridge_ns, "link", "set", f"v{i}", "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", f"v{i}", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "route", "add", "default", "dev", "eth0")
        except BaseException:
            self.stop()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        """Recorded first: interrupted once the kernel has made it, it is still deleted by stop
        (deleting one that was never made is a no-op)."""
        self._created.append(ns)
        _ip("netns", "add", ns)

    def _trap_sigterm(self) -> None:
        """SIGTERM (CI timeout, `kill`) becomes SystemExit so context managers and fixtures tear down."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def _exit(signum: int, frame: Any) -> None:
                raise SystemExit(128 + signum)
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop what this run started and delete its namespaces and temp dir (idempotent). A SIGINT
        or SIGTERM arriving meanwhile is held back and acts when the teardown is done."""
        if self._stopped:
            return
        self._stopped = True
        with _signals_held((signal.SIGINT, signal.SIGTERM)):
            self._stop_procs(timeout / 2)
            _remove_namespaces(self._created, timeout=timeout / 2)
            self._created = []
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None
            atexit.unregister(self.stop)

    def _stop_procs(self, timeout: float) -> None:
        """SIGTERM the process group of every process ``popen`` started, SIGKILL what is left after
        ``timeout``; one that outlives even SIGKILL is left to the namespace sweep."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + timeout
        for p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ nodes
    def __len__(self) -> int:
        return len(self.names)

    def address(self, node: int) -> str:
        """The node's own address on the bridge (what other nodes dial)."""
        return self.addresses[node]

    def node_of_netns(self, inode: int) -> Optional[int]:
        """Index of the node whose namespace has inode ``inode`` (``os.stat("/proc/self/ns/net")``
        inside a process: lets a process that has since exited say where it ran)."""
        for i, name in enumerate(self.names):
            try:
                if os.stat(f"/run/netns/{name}").st_ino == inode:
                    return i
            except OSError:
                continue
        return None

    def node_of_pid(self, pid: int) -> Optional[int]:
        """Index of the node whose namespace holds process ``pid`` (None: not in one of ours)."""
        name = _ip("netns", "identify", str(pid), check=False).stdout.strip()
        return self.names.index(name) if name in self.names else None

    def env(self, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
        """The environment processes in the nodes get: this one, with the repo first on
        PYTHONPATH (so Ray workers import this checkout) and no inherited Ray session."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1"})
        env.update(extra or {})
        return env

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node``'s network namespace. ``nsenter --net`` switches only the
        network namespace; ``ip netns exec`` would also remount /sys for it, hiding
        /sys/fs/cgroup, which slurmd needs (a real node has its cgroups)."""
        return ["nsenter", f"--net=/run/netns/{self.names[node]}", "--", *argv]

    def run(self, node: int, argv: Sequence[str], timeout: float, env: Optional[dict[str, str]] = None,
            check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside node ``node`` and wait (at most ``timeout`` seconds)."""
        proc = subprocess.run(self.command(node, argv), env=self.env(env), capture_output=True, text=True,
                              timeout=timeout, **kw)
        if check and proc.returncode:
            raise RuntimeError(f"node {node}: {' '.join(argv)} exited {proc.returncode}:\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return proc

    def popen(self, node: int, argv: Sequence[str], env: Optional[dict[str, str]] = None,
              **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``node`` in its own session; stopped by :meth:`stop`."""
        if self._stopped:
            raise RuntimeError("cluster is not started")
        proc = subprocess.Popen(self.command(node, argv), env=self.env(env), start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def python(self, node: int, code: str, timeout: float, env: Optional[dict[str, str]] = None) -> Any:
        """Run Python ``code`` in node ``node``; returns the JSON it prints on its last stdout line."""
        out = self.run(node, [sys.executable, "-c", code], timeout=timeout, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])


class RayBox:
    """A Ray cluster over a :class:`NetnsCluster`: head on node 0, one worker per other node.

    ``resources[i]`` are node i's custom resources (e.g. ``{"megarl_train": 2}``, as
    ``train_disagg.sbatch`` gives trainer nodes). Each node runs ``ray start --block`` (stopped with
    SIGTERM, which stops exactly the processes it started, as in ``launch/ray_bootstrap.sh``) with
    its own temp dir under the run's dir.
    """

    def __init__(self, cluster: NetnsCluster, resources: Sequence[dict[str, float]], num_cpus: int = 2,
                 num_gpus: int = 0, object_store_mb: int = 100, port: int = 6379):
        if len(resources) != len(cluster):
            raise ValueError(f"resources: one dict per node ({len(cluster)}), got {len(resources)}")
        self.cluster = cluster
        self.resources = [dict(r) for r in resources]
        self.num_cpus, self.num_gpus, self.object_store_mb, self.port = num_cpus, num_gpus, object_store_mb, port
        self.address = f"{cluster.address(0)}:{port}"
        self.token = secrets.token_hex(32)
        self._nodes: list[subprocess.Popen] = []
        self._attempts: dict[int, int] = {}
        self.nodes: list[dict[str, Any]] = []
        self.logs = cluster.tmp / "ray_logs"

    @property
    def env(self) -> dict[str, str]:
        """What every Ray process and driver of this cluster needs (token auth, as common.sh does)."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
                "RAY_memory_monitor_refresh_ms": "0", "RAY_DEDUP_LOGS": "0"}

    def start(self, timeout: float = 240.0) -> "RayBox":
        """Head first, then the workers one at a time (a 2-core CI box starting three raylets at
        once can pass Ray's fixed 30 s registration wait); a node whose ``ray start`` gives up is
        started again, at most ``START_ATTEMPTS`` times."""
        self.logs.mkdir(parents=True, exist_ok=True)
        deadline = time.time() + timeout
        try:
            for i in range(len(self.cluster)):
                self._start_node(i, deadline)
            self.wait_nodes(len(self.cluster), max(1.0, deadline - time.time()))
        except BaseException:
            self.stop()
            raise
        return self

    START_ATTEMPTS = 3
    STARTED = "Ray runtime started."

    def _start_node(self, i: int, deadline: float) -> None:
        c = self.cluster
        args = ["ray", "start", "--block", "--disable-usage-stats", f"--node-ip-address={c.address(i)}",
                f"--num-cpus={self.num_cpus}", f"--num-gpus={self.num_gpus}",
                f"--object-store-memory={self.object_store_mb * 1024 * 1024}",
                f"--resources={json.dumps(self.resources[i])}"]
        if i == 0:
            args += ["--head", f"--port={self.port}", f"--temp-dir={c.tmp / 'r0'}", "--include-dashboard=false"]
        else:
            args += [f"--address={self.address}"]
        for attempt in range(self.START_ATTEMPTS):
            self._attempts[i] = attempt
            with self._log_path(i).open("w") as log:
                proc = c.popen(i, args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            if i < len(self._nodes):
                self._nodes[i] = proc
            else:
                self._nodes.append(proc)
            while time.time() < deadline and proc.poll() is None and self.STARTED not in self.log(i):
                time.sleep(0.3)
            if self.STARTED in self.log(i) and proc.poll() is None:
                return
            if time.time() >= deadline:
                break
        raise RuntimeError(f"ray node {i} ({c.address(i)}) did not start after {self._attempts[i] + 1} attempt(s): "
                           f"{self.log(i)[-3000:]}")

    def _log_path(self, i: int) -> Path:
        return self.logs / f"node{i}.{self._attempts.get(i, 0)}.log"

    def _check_nodes(self) -> None:
        for i, p in enumerate(self._nodes):
            if p.poll() is not None:
                raise RuntimeError(f"ray node {i} exited {p.returncode}: {self.log(i)[-3000:]}")

    def log(self, i: int) -> str:
        """Output of node i's latest ``ray start``."""
        path = self._log_path(i)
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_nodes(self, want: int, timeout: float) -> list[dict[str, Any]]:
        """Wait (from a driver in node 0) until ``want`` nodes are alive; returns them."""
        code = ("import json, time, ray\n"
                f"end = time.time() + {timeout:.1f}\n"
                "ray.init(address='auto', logging_level='ERROR', log_to_driver=False)\n"
                "while True:\n"
                "    alive = [n for n in ray.nodes() if n['Alive']]\n"
                f"    if len(alive) >= {want} or time.time() > end: break\n"
                "    time.sleep(0.5)\n"
                "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']} for n in alive]))\n")
        nodes = self.cluster.python(0, code, timeout=timeout + 60, env=self.env)
        self._check_nodes()
        if len(nodes) < want:
            raise RuntimeError(f"only {len(nodes)}/{want} Ray nodes joined in {timeout:.0f}s: {nodes}\n"
                               + "\n".join(self.log(i)[-1500:] for i in range(len(self._nodes))))
        self.nodes = nodes
        return nodes

    def driver(self, node: int, argv: Sequence[str], timeout: float,
               env: Optional[dict[str, str]] = None) -> Any:
        """Run a Python driver (``python ARGV``) inside node ``node`` connected to this cluster;
        returns the JSON object it prints on its last stdout line."""
        proc = self.cluster.run(node, [sys.executable, *argv], timeout=timeout, env=dict(self.env, **(env or {})),
                                check=False)
        if proc.returncode:
            raise RuntimeError(f"driver {' '.join(argv)} in node {node} exited {proc.returncode}:\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every ``ray start --block`` (workers first, head last) and wait for them."""
        for p in reversed(self._nodes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout
        for p in reversed(self._nodes):
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass  # NetnsCluster.stop kills what is left in the namespaces
        self._nodes = []

    def __enter__(self) -> "RayBox":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
