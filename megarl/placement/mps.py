"""CUDA MPS for a run whose trainer and rollout server share one GPU as two processes.

Why: without MPS two processes on one GPU time-slice it -- only one context runs kernels at a time,
so one-step-off / async rollouts overlap little (measured on the H200: 0.89x-0.97x of sync without
MPS, 1.16x-1.19x with it; benchmarks/RESULTS.md). Under MPS their kernels run side by side.

What megarl does (``cluster.mps``: auto | required | disabled), only for the one-shared-GPU layout
(``config.validate.one_shared_gpu``) on CUDA:

* a daemon already listening on the pipe directory (``CUDA_MPS_PIPE_DIRECTORY``, default
  ``/tmp/nvidia-mps``) is used as it is and left running;
* otherwise megarl starts its own (``nvidia-cuda-mps-control -d``) with pipe and log folders under the
  run's output, and stops it (``quit``) when the run ends, also on an error;
* ``auto`` without ``nvidia-cuda-mps-control`` (or without permission to start it) says so in one
  line and runs time-sliced; ``required`` makes that an error.

SM shares: ``cluster.mps_trainer_sm_percent`` / ``cluster.mps_rollout_sm_percent`` become each
process's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (null: no limit). ``cluster.mps_rollout_priority:
below_normal`` sets the server's ``CUDA_MPS_CLIENT_PRIORITY`` so the trainer's kernels go first and
the overlapped rollout takes the SMs they leave. A client reads the MPS variables
when it creates its CUDA context, so everything here runs before the trainer touches CUDA: the
trainer's rank runs in this process under ``cluster.backend=local``.
"""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

CONTROL = "nvidia-cuda-mps-control"
# CUDA_MPS_CLIENT_PRIORITY's values (NVIDIA's MPS guide, "Environment Variables"): like a stream
# priority across clients -- a hint for the scheduler, running work is not preempted
CLIENT_PRIORITY = {"normal": "0", "below_normal": "1"}
DEFAULT_PIPE = "/tmp/nvidia-mps"


class MpsError(RuntimeError):
    """``cluster.mps: required`` and MPS cannot be used (one line naming the field)."""


@dataclass
class MpsSession:
    """The daemon a run uses: its folders, whether megarl started it, the environment per role."""

    pipe_dir: str
    log_dir: str
    started: bool
    shares: dict[str, Optional[int]] = field(default_factory=dict)   # role -> SM percent
    below_normal: frozenset = frozenset()   # roles whose MPS client priority is below normal

    def env_for(self, role: str) -> dict[str, str]:
        """What a process of ``role`` (trainer | rollout) needs in its environment."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}
        share = self.shares.get(role)
        if share:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(share))
        elif any(self.shares.values()):
            # no limit, said explicitly: the servers start from the trainer's environment, which
            # holds the trainer's own share
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = "100"
        if role in self.below_normal:
            env["CUDA_MPS_CLIENT_PRIORITY"] = CLIENT_PRIORITY["below_normal"]
        return env

    def stop(self) -> None:
        """Ask the daemon megarl started to quit (a daemon found running is left alone). The daemon
        exits once its last client has: this process holds a CUDA context until it ends, so the
        request is sent without waiting for it (a blocking ``quit`` would hang here)."""
        if not self.started:
            return
        self.started = False
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=self.pipe_dir, CUDA_MPS_LOG_DIRECTORY=self.log_dir)
        try:
            proc = subprocess.Popen([CONTROL], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=env, start_new_session=True, text=True)
            proc.stdin.write("quit\n")
            proc.stdin.close()
        except OSError:
            pass   # teardown: never mask the run's own outcome


def _control(command: str, pipe_dir: str, log_dir: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir, CUDA_MPS_LOG_DIRECTORY=log_dir)
    return subprocess.run([CONTROL], input=command + "\n", capture_output=True, text=True, env=env,
                          timeout=timeout_s)


def daemon_running(pipe_dir: str) -> bool:
    """Whether an MPS control daemon answers on ``pipe_dir`` (its ``control`` pipe exists and a
    query through it succeeds)."""
    if not os.path.exists(os.path.join(pipe_dir, "control")):
        return False
    try:
        return _control("get_server_list", pipe_dir, os.environ.get("CUDA_MPS_LOG_DIRECTORY", pipe_dir)).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def wanted(cfg: Any) -> bool:
    """MPS applies to one GPU shared by the trainer and a rollout server, on CUDA."""
    from megarl.config.validate import one_shared_gpu

    return cfg.cluster.mps != "disabled" and cfg.cluster.device == "cuda" and cfg.placement.mode == "disaggregated" \
        and one_shared_gpu(cfg)


def start_mps(cfg: Any, run_dir: Path, note=print) -> Optional[MpsSession]:
    """Use or start the MPS daemon for this run (None: not wanted, or not available under ``auto``).
    Sets this process's MPS variables (the trainer's rank runs here under the local backend)."""
    if not wanted(cfg):
        return None
    shares = {"trainer": cfg.cluster.mps_trainer_sm_percent, "rollout": cfg.cluster.mps_rollout_sm_percent}
    session = _find_or_start(cfg, Path(run_dir), shares, note)
    if session is None:
        return None
    if cfg.cluster.mps_rollout_priority == "below_normal":
        session.below_normal = frozenset({"rollout"})
        note("MPS: the rollout server's kernels run at below-normal priority (cluster.mps_rollout_priority)")
    _warn_if_context_exists(note)
    os.environ.update(session.env_for("trainer"))
    if session.started:
        atexit.register(session.stop)
    return session


def _find_or_start(cfg: Any, run_dir: Path, shares: dict, note) -> Optional[MpsSession]:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE)
    log = os.environ.get("CUDA_MPS_LOG_DIRECTORY", os.path.join(os.path.dirname(pipe), "nvidia-log"))
    if shutil.which(CONTROL) is None:
        return _unavailable(cfg, f"{CONTROL} is not on PATH", note)
    if daemon_running(pipe):
        note(f"MPS: using the daemon already running on {pipe} (SM shares: trainer "
             f"{shares['trainer'] or 'all'}%, rollout {shares['rollout'] or 'all'}%)")
        return MpsSession(pipe, log, started=False, shares=shares)
    pipe, log = str(run_dir / "mps" / "pipe"), str(run_dir / "mps" / "log")
    os.makedirs(pipe, exist_ok=True)
    os.makedirs(log, exist_ok=True)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=log)
    try:
        done = subprocess.run([CONTROL, "-d"], capture_output=True, text=True, env=env, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return _unavailable(cfg, f"{CONTROL} -d failed: {e}", note)
    if done.returncode != 0 or not daemon_running(pipe):
        reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return _unavailable(cfg, f"{CONTROL} -d failed: {reason[0]}", note)
    note(f"MPS: started a daemon for this run (pipe {pipe}); trainer and rollout server share the GPU's SMs "
         f"(trainer {shares['trainer'] or 'all'}%, rollout {shares['rollout'] or 'all'}%)")
    return MpsSession(pipe, log, started=True, shares=shares)


def _unavailable(cfg: Any, reason: str, note) -> None:
    if cfg.cluster.mps == "required":
        raise MpsError(f"cluster.mps: required, but MPS cannot be used: {reason}")
    note(f"MPS: not used ({reason}): the trainer and the rollout server time-slice the GPU, so rollout and "
         f"training overlap little (cluster.mps: disabled silences this)")
    return None


def _warn_if_context_exists(note) -> None:
    import torch

    if torch.cuda.is_initialized():
        note("MPS: this process created its CUDA context before MPS was set up; the trainer here runs outside MPS")
