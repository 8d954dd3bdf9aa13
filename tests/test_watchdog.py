"""The watchdog: phase deadlines, every rank's stack, one line naming the hung rank, the requeue code.

The runs freeze one Megatron rank with SIGSTOP (a reward function does it inside step 2's rollout,
``tests/helpers/hang.py``) at gloo TP2 and PP2 under Ray: the next Megatron pass hangs and the
watchdog must stop the run within that pass's deadline (3 x its step-1 time, at least 10 s), name
the stopped rank and the phase, leave a stack for every rank and exit with the requeue code. No
timing is asserted beyond generous upper bounds.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.config import ConfigError, validate_config
from megarl.watchdog import REQUEUE_EXIT, Deadlines, Watchdog
from megarl.workers.stack_dump import RankProcess, inspect_ranks, proc_state
from tests.helpers.models import make_tiny_chat_model
from tests.helpers.runs import DEFAULT, ROOT, tiny_overrides, tiny_run_config


def _settings(**kw) -> SimpleNamespace:
    base = dict(enabled=True, factor=3.0, first_step_s=100.0, min_s=5.0, phase_s={})
    return SimpleNamespace(**{**base, **kw})


# ------------------------------------------------------------------------------ deadline arithmetic

def test_deadline_is_first_step_before_history_then_factor_times_longest_with_a_floor():
    d = Deadlines(factor=3.0, first_step_s=100.0, min_s=5.0, fixed={"checkpoint": 42.0})
    assert d.of("train") == 100.0                     # no history yet
    d.record("train", 10.0)
    assert d.of("train") == 30.0                      # factor x longest
    d.record("train", 4.0)
    assert d.of("train") == 30.0                      # the longest so far counts, not the last
    d.record("train", 12.0)
    assert d.of("train") == 36.0
    d.record("sync", 0.5)
    assert d.of("sync") == 5.0                        # never below min_s
    d.record("checkpoint", 100.0)
    assert d.of("checkpoint") == 42.0                 # a fixed deadline ignores history
    assert Deadlines(3.0, 1.0, 5.0).of("rollout") == 5.0   # min_s bounds the first deadline too


def test_only_finished_phases_count_towards_the_deadline():
    dog = Watchdog(_settings(), Path("/nonexistent"), exit=lambda code: None, end_children=False)
    with dog.phase("train", 1):
        pass
    with pytest.raises(RuntimeError):
        with dog.phase("values", 1):
            raise RuntimeError("failed pass")
    assert set(dog.deadlines.longest) == {"train"}
    dog.stop()


def test_watchdog_config_is_validated_one_line_per_field(tmp_path):
    model = make_tiny_chat_model(tmp_path / "m")
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_run_config(model, tmp_path / "run", "watchdog.factor=0.5", "watchdog.phase_s={trian: 3}",
                                        "cluster.collective_timeout_s=0"))
    text = "\n".join(err.value.problems)
    assert "watchdog.factor: 0.5 < 1" in text
    assert "watchdog.phase_s: no phase 'trian'" in text
    assert "cluster.collective_timeout_s: 0" in text


# ---------------------------------------------------------------------------- expiry, in-process

def test_an_expired_phase_dumps_the_driver_names_the_phase_and_exits_with_the_requeue_code(tmp_path, capfd):
    exits: list[int] = []
    closed: list[bool] = []
    dog = Watchdog(_settings(first_step_s=0.5, min_s=0.1), tmp_path / "watchdog", exit=exits.append,
                   close=lambda: closed.append(True), end_children=False)
    with dog.phase("rollout", 1):                      # finishes in time: no expiry
        time.sleep(0.05)
    with dog.phase("train", 2):                        # first train: deadline first_step_s = 0.5 s
        deadline = time.monotonic() + 120
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    assert exits == [REQUEUE_EXIT] and closed == [True]
    err = capfd.readouterr().err
    assert "watchdog: step 2 phase train passed its 0s deadline" in err
    stacks = tmp_path / "watchdog" / "stacks_step2_train.txt"
    assert f"stacks of 0 ranks and the driver in {stacks}" in err
    text = stacks.read_text()
    assert "== driver on host" in text and "test_watchdog.py" in text   # the main thread, inside the phase
    report = json.loads((tmp_path / "watchdog" / "hang.json").read_text())
    assert report["phase"] == "train" and report["exit_code"] == REQUEUE_EXIT and report["checkpoint"] is None


# ------------------------------------------------------------------------- stacks of other processes

RANK_BODY = textwrap.dedent("""
    import sys, time
    from megarl.workers.stack_dump import arm
    arm(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    print("armed", flush=True)
    def waiting_in_a_collective():
        time.sleep(600)
    waiting_in_a_collective()
""")


def test_stacks_of_a_live_rank_by_its_signal_and_of_a_stopped_rank_by_py_spy(tmp_path):
    folder = tmp_path / "ranks"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    live, stopped = [subprocess.Popen([sys.executable, "-c", RANK_BODY, str(folder), "actor", str(r)], env=env,
                                      stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        for p in (live, stopped):
            assert p.stdout.readline().strip() == "armed"
        os.kill(stopped.pid, signal.SIGSTOP)
        procs = [RankProcess("actor", r, p.pid, socket.gethostname(), "", str(folder / f"actor_rank{r}_pid{p.pid}.txt"))
                 for r, p in enumerate((live, stopped))]
        a, b = inspect_ranks(procs, wait_s=30)
        assert a.source == "faulthandler" and not a.stopped and "waiting_in_a_collective" in a.stack, a
        assert b.source == "py-spy" and b.stopped and b.state.startswith("T"), b
        assert "waiting_in_a_collective" in b.stack, b.stack
    finally:
        for p in (live, stopped):
            p.kill()
            p.wait()
    assert proc_state(stopped.pid) == "gone"


def test_ranks_sharing_a_process_share_its_one_stack_file(tmp_path):
    """Backend local: one process holds a rank of each role; each points at the file its one
    handler writes, so each gets the process's stack from its signal."""
    from megarl.workers.stack_dump import arm

    actor, ref = arm(str(tmp_path), "actor", 0), arm(str(tmp_path), "ref", 0)
    assert actor.stack_file == ref.stack_file and actor.pid == ref.pid == os.getpid()
    found = inspect_ranks([actor, ref], wait_s=30)
    assert [s.source for s in found] == ["faulthandler", "faulthandler"], found
    assert all("test_ranks_sharing_a_process" in s.stack for s in found)


# ----------------------------------------------------------------------------------- SLURM requeue

def test_slurm_requeues_the_job_on_the_watchdog_exit_code_only(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)

    def run(rc: int, restarts: int) -> str:
        calls.unlink(missing_ok=True)
        script = f"source {ROOT}/launch/slurm/common.sh; megarl_requeue_on {rc}; echo rc=$?"
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4711",
                   SLURM_RESTART_COUNT=str(restarts), MEGARL_MAX_REQUEUES="2")
        out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return calls.read_text() if calls.exists() else ""

    assert run(REQUEUE_EXIT, 0) == "requeue 4711\n"
    assert run(REQUEUE_EXIT, 1) == "requeue 4711\n"
    assert run(REQUEUE_EXIT, 2) == ""                  # MEGARL_MAX_REQUEUES used up
    assert run(1, 0) == "" and run(0, 0) == ""

    # SIGUSR1 before the time limit: the driver checkpoints and exits 0; the job goes back to the queue
    calls.unlink(missing_ok=True)
    ready = tmp_path / "driver_ready"   # USR1 only once the driver handles it (its default action kills)
    driver = (f"import pathlib, signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: sys.exit(0)); "
              f"pathlib.Path(\"{ready}\").touch(); time.sleep(120)")
    script = (f"source {ROOT}/launch/slurm/common.sh; (while [ ! -f {ready} ]; do sleep 0.1; done; kill -USR1 $$) & "
              f"megarl_run {sys.executable} -c '{driver}'; echo rc=$?")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4711", SLURM_RESTART_COUNT="9")
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=100)
    assert out.stdout.strip().endswith("rc=0"), (out.stdout, out.stderr)
    assert calls.read_text() == "requeue 4711\n"   # no cap: every time-limit stop made progress


# ------------------------------------------------------------------------ a stopped rank in a real run

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny4", layers=4)


SAMPLES_PER_STEP = 8   # batch.prompts_per_step 2 x the recipe's rollout.n_per_prompt 4


@pytest.mark.parametrize("layout, stop_rank, live_rank, via_ray", [("tp", 1, 0, "0"), ("pp", 0, 1, "1")])
def test_a_stopped_rank_is_named_with_its_phase_and_every_rank_stack_and_the_run_requeues(model, tmp_path, layout,
                                                                                         stop_rank, live_rank, via_ray):
    """PP2 reads the stacks as for ranks on other nodes: a Ray task pinned to the ranks' node
    (``MEGARL_WATCHDOG_VIA_RAY=1``); TP2 from the driver, the ranks' own node."""
    out = tmp_path / "run"
    ranks = out / "watchdog" / "ranks"
    cmd = [sys.executable, "-m", "megarl", "train", str(DEFAULT), *tiny_overrides(
        model, out, "cluster.backend=ray", "actor.gpus=2", f"actor.parallel.{layout}=2", "trainer.total_steps=3",
        "trainer.eval_before_after=false", "checkpoint.export_hf=false", "batch.prompts_per_step=2",
        "data.num_eval=4", "reward.function=tests.helpers.hang:stop_rank_after_calls",
        "watchdog.factor=3", "watchdog.min_s=10", "watchdog.first_step_s=600", "cluster.collective_timeout_s=900")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), MEGARL_TEST_STOP_DIR=str(ranks),
               MEGARL_TEST_STOP_RANK=f"actor_rank{stop_rank}_", MEGARL_TEST_STOP_AFTER=str(SAMPLES_PER_STEP),
               MEGARL_WATCHDOG_VIA_RAY=via_ray)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    ended = time.time()
    log = proc.stdout + proc.stderr
    assert proc.returncode == REQUEUE_EXIT, log[-4000:]
    pid = int((out / "watchdog" / "test_stopped_pid").read_text())
    stopped_at = (out / "watchdog" / "test_stopped_pid").stat().st_mtime
    host = socket.gethostname()
    line = re.search(r"watchdog: step 2 phase old_logprobs passed its (\d+)s deadline \(running \d+s\): "
                     rf"actor rank {stop_rank} on host {re.escape(host)} \(pid {pid}\) is T \(stopped\); "
                     r"stacks of 2 ranks and the driver in (\S+)", log)
    assert line, log[-4000:]
    deadline_s, stacks = float(line.group(1)), Path(line.group(2))
    assert 10 <= deadline_s < 600                      # from step 1's history, not the first-step deadline
    assert ended - stopped_at < deadline_s + 180, (ended - stopped_at, deadline_s)   # generous: load, dumps
    assert "no checkpoint written: actor rank" in log
    text = stacks.read_text()
    sections = dict(re.findall(r"^== (actor rank \d) on host .*?\n(.*?)(?=^== |\Z)", text, re.S | re.M))
    assert set(sections) == {"actor rank 0", "actor rank 1"}, text[:3000]
    assert "[stack from py-spy, read by pid" in text and "Thread" in sections[f"actor rank {stop_rank}"]
    driver = re.search(r"^== driver on host .* \(pid (\d+)\)", text, re.M).group(1)
    readers = set(re.findall(r"^== actor rank .*, read by pid (\d+)\]", text, re.M))
    assert (readers == {driver}) == (via_ray == "0"), (readers, driver)   # via Ray: a task on the ranks' node
    assert "compute_logprobs" in sections[f"actor rank {live_rank}"], sections[f"actor rank {live_rank}"]
    report = json.loads((out / "watchdog" / "hang.json").read_text())
    assert report["stopped"]["rank"] == stop_rank and report["phase"] == "old_logprobs"
    for _ in range(60):                                 # the stopped rank does not outlive the run
        if proc_state(pid) in ("gone",) or proc_state(pid).startswith("Z"):
            break
        time.sleep(1)
    assert proc_state(pid) == "gone" or proc_state(pid).startswith("Z"), proc_state(pid)


def test_a_hung_rollout_with_healthy_ranks_checkpoints_the_last_step_and_the_requeued_run_resumes(model, tmp_path):
    """A reward that never returns hangs step 2's rollout while the rank is idle: the watchdog writes a
    checkpoint of step 1 (the step's batch given back to the source), exits 75, and the run started
    again (what the requeue does) resumes at step 1 and finishes."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "megarl", "train", str(DEFAULT)]
    common = ("trainer.total_steps=2", "trainer.eval_before_after=false", "checkpoint.export_hf=false",
              "batch.prompts_per_step=2", "data.num_eval=4", "reward.function=tests.helpers.hang:hang_after_calls",
              # step 2's rollout (its first phase) is the one that hangs: no healthy phase runs under a
              # deadline from history, so the floor only sets how long the hang is waited out
              "watchdog.factor=3", "watchdog.min_s=5", "watchdog.first_step_s=600")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), MEGARL_TEST_STOP_DIR=str(out / "test"),
               MEGARL_TEST_STOP_AFTER=str(SAMPLES_PER_STEP))
    hung = subprocess.run(args + tiny_overrides(model, out, *common), capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)
    log = hung.stdout + hung.stderr
    assert hung.returncode == REQUEUE_EXIT, log[-4000:]
    assert re.search(r"watchdog: step 2 phase rollout passed its \d+s deadline .*: no rank is stopped or gone "
                     r"\(actor: 1 ranks alive", log), log[-4000:]
    written = out / "checkpoints" / "step_000001"
    assert f"checkpoint of the last finished step written to {written}" in log, log[-3000:]
    assert json.loads((written / "trainer_state.json").read_text())["step"] == 1
    resumed = subprocess.run(args + tiny_overrides(model, out, *common, "checkpoint.resume=auto"), capture_output=True,
                             text=True, timeout=600, env=env, cwd=ROOT)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-4000:]
    assert f"resumed from {written} at step 1" in log and "step 2/2" in log, log[-3000:]
