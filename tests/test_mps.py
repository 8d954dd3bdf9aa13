"""CUDA MPS for the one-shared-GPU layout: when megarl wants it, what it says without it,
and that each server process gets its SM share. The daemon itself runs only on a GPU machine
(benchmarks/run_gpu.sh `mps`: bench_async with megarl starting and stopping it)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.placement.mps import MpsError, MpsSession, start_mps, wanted
from megarl.rollout.launch import RolloutServers
from tests.helpers.runs import tiny_model, tiny_run_config

pytestmark = pytest.mark.unit
ONE_GPU = ("cluster.device=cuda", "cluster.backend=local", "cluster.gpus_per_node=1", "actor.gpus=1",
           "rollout.gpus=1", "placement.mode=disaggregated")


def _cfg(tmp_path: Path, *overrides: str):
    return load_config(Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-grpo-cpu.yaml",
                       [f"output_dir={tmp_path}", *overrides])


def test_mps_is_wanted_only_for_one_gpu_shared_by_trainer_and_server(tmp_path):
    assert wanted(_cfg(tmp_path, *ONE_GPU))
    assert not wanted(_cfg(tmp_path, *ONE_GPU, "cluster.mps=disabled"))
    assert not wanted(_cfg(tmp_path, *ONE_GPU, "placement.mode=colocated"))   # one process, memory saver
    assert not wanted(_cfg(tmp_path))                                            # CPU


def test_without_the_control_binary_auto_says_so_in_one_line_and_on_refuses(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))       # no nvidia-cuda-mps-control anywhere
    lines: list[str] = []
    assert start_mps(_cfg(tmp_path, *ONE_GPU), tmp_path, lines.append) is None
    assert len(lines) == 1 and lines[0].startswith("MPS: not used") and "nvidia-cuda-mps-control" in lines[0]
    with pytest.raises(MpsError, match=r"^cluster\.mps: required"):
        start_mps(_cfg(tmp_path, *ONE_GPU, "cluster.mps=required"), tmp_path, lines.append)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ or os.environ["CUDA_MPS_PIPE_DIRECTORY"] != str(tmp_path)


def test_sm_shares_are_validated_and_reach_the_server_process(tmp_path):
    from megarl.config import validate_config
    from megarl.config.loader import ConfigError

    with pytest.raises(ConfigError, match="cluster.mps_rollout_sm_percent"):
        validate_config(_cfg(tmp_path, *ONE_GPU, "cluster.mps_rollout_sm_percent=0"))
    session = MpsSession(str(tmp_path / "pipe"), str(tmp_path / "log"), started=False,
                         shares={"trainer": 40, "rollout": 60}, below_normal=frozenset({"rollout"}))
    assert session.env_for("trainer")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in session.env_for("trainer")
    # a role without a share is not capped by the other's (servers inherit the trainer's environment)
    only_trainer = MpsSession("p", "l", started=False, shares={"trainer": 40, "rollout": None})
    assert only_trainer.env_for("rollout")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in MpsSession("p", "l", started=False).env_for("rollout")
    # a real embedded server started by megarl's launcher carries the rollout share in its environment
    model = tiny_model(tmp_path)
    cfg = tiny_run_config(model, tmp_path / "run")
    servers = RolloutServers(cfg, model, tmp_path / "logs", env=session.env_for("rollout"))
    try:
        pid = servers.hosts[0][0].proc.pid
        deadline = time.time() + 30
        while not Path(f"/proc/{pid}/environ").exists() and time.time() < deadline:
            time.sleep(0.1)
        environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        assert environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
        assert environ["CUDA_MPS_CLIENT_PRIORITY"] == "1"
        assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    finally:
        servers.stop()


def test_rollout_priority_below_normal_reaches_the_rollout_only(tmp_path, monkeypatch):
    """``cluster.mps_rollout_priority: below_normal`` -> the rollout's CUDA_MPS_CLIENT_PRIORITY=1
    (NVIDIA's value for below normal), the trainer's process keeps normal priority; a bad value is
    a config error naming the field."""
    import megarl.placement.mps as mps
    from megarl.config.loader import ConfigError

    with pytest.raises(ConfigError, match="mps_rollout_priority"):
        _cfg(tmp_path, *ONE_GPU, "cluster.mps_rollout_priority=low")
    monkeypatch.setattr(mps, "_find_or_start",   # no daemon on a CPU box: a running one, found
                        lambda *a: MpsSession(str(tmp_path / "pipe"), str(tmp_path / "log"), started=False))
    monkeypatch.setattr(mps, "_warn_if_context_exists", lambda note: None)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    lines: list[str] = []
    session = start_mps(_cfg(tmp_path, *ONE_GPU, "cluster.mps_rollout_priority=below_normal"), tmp_path, lines.append)
    assert session.env_for("rollout")["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in session.env_for("trainer") and "CUDA_MPS_CLIENT_PRIORITY" not in os.environ
    assert any("below-normal" in line for line in lines)
    default = start_mps(_cfg(tmp_path, *ONE_GPU), tmp_path, lines.append)
    assert "CUDA_MPS_CLIENT_PRIORITY" not in default.env_for("rollout")
