"""The real sbatch scripts on a real slurmctld + slurmd (Debian slurm-wlm), one host.

The cluster has two SLURM node names (n1, n2), each its own slurmd with 4 fake GPUs (gres backed by
/dev/null symlinks) in its own network namespace (tests/netns_cluster.py: own address, own
loopback), so `sbatch -N 2` is a real 2-node allocation: the batch step runs on n1, `srun -w n2`
goes through n2's slurmd, and the Ray head and the Ray worker are two Ray nodes with two different
addresses. What one host cannot show: real GPUs, NCCL across hosts, a real fabric.

Skipped when slurm-wlm is not installed or not root, unless MEGARL_REQUIRE_SLURM=1 (CI), where
that is a failure.
"""
from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_cluster import NetnsCluster, netns_available  # noqa: E402
from slurm_cluster import SlurmCluster, slurm_available  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU_RECIPE = "recipes/smollm2-135m-grpo-cpu.yaml"

_why = slurm_available() or netns_available()
if _why and os.environ.get("MEGARL_REQUIRE_SLURM") != "1":
    pytestmark = pytest.mark.skip(reason=_why)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if _why:
        pytest.fail(f"MEGARL_REQUIRE_SLURM=1 but {_why}")
    with NetnsCluster(2) as nodes:
        c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, gpus=4, netns=nodes)
        t0 = time.time()
        try:
            c.start()
            print(f"slurm cluster up in {time.time() - t0:.1f}s: {c.node_names} at {nodes.addresses}")
            yield c
        finally:
            c.stop()
        assert c.alive_daemons() == [], "slurm daemons still running after stop()"


def _job_env(tmp: Path, **extra: str) -> tuple[dict[str, str], str]:
    # Ray's unix socket paths must stay < 107 chars: a short temp dir of our own per job.
    ray_tmp = f"/tmp/mrl-{uuid.uuid4().hex[:8]}"
    env = {"MEGARL_HOME": str(ROOT), "MEGARL_RAY_TMPDIR": ray_tmp, "MEGARL_RAY_OBJECT_STORE_MB": "100",
           "MEGARL_RAY_DASHBOARD": "0", "MEGARL_RAY_WAIT_S": "180", "HF_HUB_OFFLINE": "1",
           "PYTHON": sys.executable, **extra}
    return env, ray_tmp


def _processes_using(path: str) -> list[str]:
    """Command lines of live processes that mention ``path`` (the job's Ray temp dir)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if path in cmd and state != "Z":
            out.append(f"{proc.name}: {cmd[:200]}")
    return out


def _log(cluster: SlurmCluster, job: int) -> str:
    p = cluster.root / f"job-{job}.out"
    return p.read_text() if p.exists() else "(no log)"


def _wait_gone(path: str, timeout: float = 300) -> list[str]:   # a hang guard: returns once gone
    deadline = time.time() + timeout
    while True:
        left = _processes_using(path)
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


DRIVER_CHECK = (
    "import json, os, ray; ray.init(address='auto', logging_level='ERROR'); "
    "nodes = [n for n in ray.nodes() if n['Alive']]; "
    "json.dump({'nodes': len(nodes), 'resources': ray.cluster_resources(), "
    "'per_node': [n['Resources'] for n in nodes], 'ips': [n['NodeManagerAddress'] for n in nodes], "
    "'address': os.environ['RAY_ADDRESS']}, "
    "open(os.environ['OUT'] + '/driver.json', 'w')); ray.shutdown()"
)


def test_sbatch_two_nodes_ray_bootstrap_and_teardown(cluster, tmp_path):
    """train.sbatch on 2 SLURM nodes: Ray head on n1, worker on n2 via srun, driver sees both nodes
    at their own addresses and 2 fake GPUs per node (from --gpus-per-node), job completes, no Ray
    process outlives it."""
    out = tmp_path / "out"
    env, ray_tmp = _job_env(tmp_path, OUT=str(out), MEGARL_CMD=f"{sys.executable} -c \"{DRIVER_CHECK}\"")
    job = cluster.sbatch(["-N", "2", "--gpus-per-node=2", f"--output={cluster.root}/job-%j.out",
                          "launch/slurm/train.sbatch", CPU_RECIPE, f"output_dir={out}", "cluster.nodes=2"],
                         env=env, cwd=ROOT)
    info = cluster.wait(job, timeout=300)
    log = _log(cluster, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]"
    ray_info = json.loads((out / "ray_cluster.json").read_text())
    assert ray_info["nodes"] == 2 and ray_info["gpus"] == 4, ray_info
    n1, n2 = cluster.node_address(0), cluster.node_address(1)
    assert ray_info["node_ips"] == sorted([n1, n2]) and ray_info["address"].startswith(f"{n1}:"), ray_info
    driver = json.loads((out / "driver.json").read_text())
    assert driver["nodes"] == 2 and driver["resources"]["GPU"] == 4
    assert sorted(n.get("GPU") for n in driver["per_node"]) == [2, 2]
    assert "slurm-node=n2 role=worker" in log and "slurm-node=n1 role=head" in log
    assert "megarl plan" in log and "verdict: FITS" in log          # the plan gate ran
    assert "Ray stopped" in log
    assert _wait_gone(ray_tmp) == []


def test_disaggregated_sbatch_marks_pools(cluster, tmp_path):
    """train_disagg.sbatch: trainer node and rollout node carry their own Ray resource."""
    out = tmp_path / "out"
    env, ray_tmp = _job_env(tmp_path, OUT=str(out), MEGARL_CMD=f"{sys.executable} -c \"{DRIVER_CHECK}\"",
                            MEGARL_TRAIN_NODES="1", MEGARL_ROLLOUT_NODES="1")
    job = cluster.sbatch(["-N", "2", "--gpus-per-node=2", f"--output={cluster.root}/job-%j.out",
                          "launch/slurm/train_disagg.sbatch", CPU_RECIPE, f"output_dir={out}",
                          "placement.mode=disaggregated", "cluster.nodes=2"], env=env, cwd=ROOT)
    info = cluster.wait(job, timeout=300)
    assert info["JobState"] == "COMPLETED", _log(cluster, job)
    driver = json.loads((out / "driver.json").read_text())
    pools = {ip: ("megarl_train" in n) * "train" + ("megarl_rollout" in n) * "rollout"
             for ip, n in zip(driver["ips"], driver["per_node"])}
    assert pools == {cluster.node_address(0): "train", cluster.node_address(1): "rollout"}, driver
    assert driver["resources"]["megarl_train"] == 2 and driver["resources"]["megarl_rollout"] == 2
    assert _wait_gone(ray_tmp) == []


def test_scancel_tears_ray_down(cluster, tmp_path):
    """scancel while the driver runs: the trap stops the driver and every Ray process of the job."""
    out = tmp_path / "out"
    env, ray_tmp = _job_env(tmp_path, MEGARL_CMD="sleep 600")
    job = cluster.sbatch(["-N", "1", "--gpus-per-node=1", f"--output={cluster.root}/job-%j.out", "launch/slurm/train.sbatch",
                          CPU_RECIPE, f"output_dir={out}"], env=env, cwd=ROOT)
    deadline = time.time() + 240
    while not (out / "ray_cluster.json").exists() or not (out / "ray_cluster.json").read_text():
        assert time.time() < deadline, _log(cluster, job)
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), _log(cluster, job)
        time.sleep(0.5)
    assert _processes_using(ray_tmp), "Ray should be running before scancel"
    cluster.run(["scancel", str(job)])
    info = cluster.wait(job, timeout=300)
    assert info["JobState"] == "CANCELLED"
    assert _wait_gone(ray_tmp) == [], _log(cluster, job)


def test_plan_gate_stops_a_recipe_that_does_not_fit(cluster, tmp_path):
    """The sbatch script runs `megarl plan` first and exits 1 before starting Ray."""
    env, ray_tmp = _job_env(tmp_path, MEGARL_CMD="true")
    job = cluster.sbatch(["-N", "1", "--gpus-per-node=1", f"--output={cluster.root}/job-%j.out", "launch/slurm/train.sbatch",
                          "recipes/qwen3-8b-dapo.yaml", "cluster.gpu_type=A100-40GB", f"output_dir={tmp_path / 'o'}"],
                         env=env, cwd=ROOT)
    info = cluster.wait(job, timeout=600)
    log = _log(cluster, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", log
    assert "DOES NOT FIT" in log and "short by" in log
    assert "Ray head" not in log and not Path(ray_tmp).exists()


def test_convert_sbatch_runs_megarl_convert(cluster, tmp_path):
    job = cluster.sbatch([f"--output={cluster.root}/job-%j.out", "launch/slurm/convert.sbatch", "--help"],
                         env=_job_env(tmp_path)[0], cwd=ROOT)
    info = cluster.wait(job, timeout=600)
    log = _log(cluster, job)
    assert info["JobState"] == "COMPLETED", log
    assert "hf-to-megatron" in log


def test_sbatch_trains_the_cpu_recipe(cluster, tmp_path):
    """The real thing: train.sbatch runs `megarl train` on the CPU recipe (one step: this test is
    about the launch) on the Ray cluster the script started; the job completes and the run's final
    checkpoint exists."""
    out = tmp_path / "run"
    env, ray_tmp = _job_env(tmp_path)
    job = cluster.sbatch(["-N", "1", "--gpus-per-node=1", f"--output={cluster.root}/job-%j.out", "launch/slurm/train.sbatch",
                          CPU_RECIPE, "trainer.total_steps=1", f"output_dir={out}", "checkpoint.interval=0",
                          "trainer.eval_before_after=false", "checkpoint.export_hf=false",
                          # the recipe's model and data, a smaller batch: this test is about the launch
                          "batch.prompts_per_step=2", "batch.global_batch_size=8", "rollout.sampling.max_new_tokens=16"],
                         env=env, cwd=ROOT)
    info = cluster.wait(job, timeout=1200)
    log = _log(cluster, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-6000:]
    assert json.loads((out / "ray_cluster.json").read_text())["nodes"] == 1
    assert "cluster.ray_address=auto" in log
    produced = sorted(p.name for p in out.iterdir() if p.name != "ray_cluster.json")
    assert produced, f"no run outputs in {out}"
    assert "step 1/1" in log, log[-3000:]
    assert (out / "checkpoints" / "step_000001" / "trainer_state.json").is_file(), produced
    assert _wait_gone(ray_tmp) == []
