"""A real SLURM cluster on this one machine, for tests: slurmctld + one slurmd per fake node.

Debian's slurm-wlm daemons started by hand (no systemd), as root, everything under one temp dir:
config, state, spool, logs and pid files. Authentication is ``auth/none`` + ``cred/none`` so no
munged is needed. Fake GPUs are gres ``gpu`` backed by symlinks to /dev/null named nvidia0..N
(slurmd rejects plain files), so ``--gres=gpu:2`` / ``--gpus-per-node=2`` set
``CUDA_VISIBLE_DEVICES=0,1`` like on a GPU node.

Two node names on one host: each fake node gets its own ``slurmd -N NAME`` with its own port,
spool dir and pid file (``%n`` in the paths), all with ``NodeAddr=127.0.0.1``. slurmctld then
schedules a 2-node job over them, and ``srun -w n2`` starts its task through n2's slurmd.

With ``netns=`` (a started ``tests.netns_cluster.NetnsCluster``) node ``nK`` is network namespace
K-1 instead: its slurmd runs there with ``NodeAddr`` = that namespace's address, slurmctld and every
client command run in the first node's namespace (``SlurmctldHost=localhost(<its address>)``), so
a job's steps on n1 and n2 see two different addresses and two different loopbacks, as on two
machines.

Daemons are stopped by the pids in their own pid files (never by process name: other test
sessions may run their own daemons on this machine).

    with SlurmCluster(tmp_dir, nodes=2) as cluster:
        job = cluster.sbatch(["launch/slurm/train.sbatch", ...], env=...)
        state = cluster.wait(job, timeout=300)
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")


def slurm_available() -> str | None:
    """None if a cluster can be started here, else the reason."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"SLURM not installed (missing {', '.join(missing)}): apt-get install -y slurm-wlm"
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class SlurmCluster:
    def __init__(self, root: str | Path, nodes: int = 2, cpus: int | None = None, gpus: int = 4,
                 memory_mb: int = 4000, name: str = "megarltest", netns: Any = None):
        if netns is not None and len(netns) < nodes:
            raise ValueError(f"netns has {len(netns)} node(s), the SLURM cluster needs {nodes}")
        self.netns = netns
        self.root = Path(root)
        self.node_names = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus or os.cpu_count() or 1
        self.gpus = gpus
        self.memory_mb = memory_mb
        self.name = name
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        # Never let a parent job's variables (if pytest itself runs under SLURM) leak in.
        for key in list(self.env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_")) and key != "SLURM_CONF":
                del self.env[key]

    # ------------------------------------------------------------------ files
    def write_config(self) -> None:
        r = self.root
        for sub in ("state", "log", "dev", *[f"spool/{n}" for n in self.node_names]):
            (r / sub).mkdir(parents=True, exist_ok=True)
        for i in range(self.gpus):
            link = r / "dev" / f"nvidia{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        ctld_port, *node_ports = _free_ports(1 + len(self.node_names))
        addrs = [self.node_address(i) for i in range(len(self.node_names))]
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr={a} Port={p} CPUs={self.cpus} "
            f"RealMemory={self.memory_mb} Gres=gpu:{self.gpus} State=UNKNOWN"
            for n, a, p in zip(self.node_names, addrs, node_ports))
        ctld_host = f"localhost({addrs[0]})" if self.netns is not None else "localhost"
        self.conf.write_text(f"""\
ClusterName={self.name}
SlurmctldHost={ctld_host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=3600
InactiveLimit=0
GresTypes=gpu
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
{nodes}
PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
""")
        (r / "gres.conf").write_text(
            "AutoDetect=off\n"
            + "".join(f"NodeName={n} Name=gpu File={r}/dev/nvidia[0-{self.gpus - 1}]\n" for n in self.node_names))

    def node_address(self, i: int) -> str:
        """The address node ``n<i+1>`` is reached at: its namespace's, or 127.0.0.1 without netns."""
        return self.netns.address(i) if self.netns is not None else "127.0.0.1"

    def _on_node(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` run on node ``n<i+1>``: inside its namespace when there is one."""
        return self.netns.command(i, cmd) if self.netns is not None else cmd

    # ------------------------------------------------------------------ daemons
    def pid_files(self) -> list[Path]:
        return [self.root / "slurmctld.pid"] + [self.root / f"slurmd.{n}.pid" for n in self.node_names]

    def start(self, timeout: float = 120.0) -> "SlurmCluster":   # a hang guard: returns once idle
        self.write_config()
        # -i: ignore saved state of an earlier run in this dir. Both daemonize and write pid files.
        subprocess.run(self._on_node(0, ["slurmctld", "-i", "-f", str(self.conf)]), env=self.env, check=True,
                       timeout=timeout)
        for i, n in enumerate(self.node_names):
            subprocess.run(self._on_node(i, ["slurmd", "-f", str(self.conf), "-N", n]), env=self.env, check=True,
                           timeout=timeout)
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == len(self.node_names) and all(s == "idle" for s in states.values()):
                return self
            time.sleep(0.3)
        logs = "\n".join(p.read_text()[-2000:] for p in (self.root / "log").glob("*.log"))
        self.stop()
        raise RuntimeError(f"slurm nodes did not become idle in {timeout}s: {out!r}\n{logs}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM each daemon by its pid file, wait, SIGKILL what is left."""
        pids = []
        for pf in reversed(self.pid_files()):   # slurmd first, slurmctld last
            try:
                pid = int(pf.read_text().strip())
            except (OSError, ValueError):
                continue
            if self._is_ours(pid):
                pids.append(pid)
                os.kill(pid, signal.SIGTERM)
        deadline = time.time() + timeout
        for pid in pids:
            while self._alive(pid) and time.time() < deadline:
                time.sleep(0.1)
            if self._alive(pid):
                os.kill(pid, signal.SIGKILL)

    def _is_ours(self, pid: int) -> bool:
        """The pid still names one of our daemons (pid files can outlive a crashed daemon)."""
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return any(str(self.conf).encode() == c for c in cmd)

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    def alive_daemons(self) -> list[int]:
        out = []
        for pf in self.pid_files():
            try:
                pid = int(pf.read_text().strip())
            except (OSError, ValueError):
                continue
            if self._alive(pid) and self._is_ours(pid):
                out.append(pid)
        return out

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ clients
    def run(self, cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A client command (sbatch, squeue, ...), from the first node (where slurmctld listens)."""
        env = dict(self.env, **kw.pop("env", {}))
        kw.setdefault("timeout", 120)
        return subprocess.run(self._on_node(0, cmd), env=env, check=check, capture_output=True, text=True, **kw)

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> int:
        proc = self.run(["sbatch", "--parsable", *args], env=env or {}, cwd=cwd, check=False)
        if proc.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float = 300.0, states: tuple[str, ...] = (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")) -> dict[str, str]:
        deadline = time.time() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states or time.time() > deadline:
                return info
            time.sleep(0.5)
