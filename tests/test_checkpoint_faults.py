"""Checkpoints and stops under faults: SIGTERM (a SLURM preemption) while a checkpoint is being
written and while the weights are being pushed, a full disk under the checkpoint folder, and a
run killed with a partial checkpoint folder left behind. What must hold each time: the previous
checkpoint stays whole and is what a resume loads, nothing partial is taken for a checkpoint, the
run ends with one line (SIGTERM: the requeue exit code), and the prompt ledger of all the runs
together shows every prompt of the committed steps once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.checkpoint.manager import STATE_FILE, CheckpointNotWritten, latest_checkpoint
from megarl.errors import RunStopped
from megarl.rollout.ledger import LEDGER_FILE, read_ledger
from megarl.trainer import Trainer
from megarl.watchdog import REQUEUE_EXIT
from tests.helpers.faults import fill_filesystem
from tests.helpers.runs import DEFAULT, ROOT, tiny_model, tiny_overrides, tiny_run_config

QUIET = ("checkpoint.export_hf=false", "trainer.eval_before_after=false", "logging.progress_bar=false",
         "checkpoint.interval=1")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


class SignalledTrainer(Trainer):
    """Sends itself SIGTERM at a chosen moment: while step ``at``'s checkpoint is being written
    (``during="checkpoint"``) or while the weights of step ``at`` are pushed (``during="push"``)."""

    def __init__(self, cfg, during: str, at: int):
        super().__init__(cfg)
        self.during, self.at = during, at

    def setup(self) -> None:
        super().setup()
        save, push = self.checkpoints.save, self.weights.push

        def saving(step: int):
            if self.during == "checkpoint" and step == self.at:
                os.kill(os.getpid(), signal.SIGTERM)   # delivered now; the write below must still finish
            return save(step)

        def pushing(version: str):
            if self.during == "push" and self.state.step + 1 == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
            return push(version)
        self.checkpoints.save, self.weights.push = saving, pushing


def test_sigterm_during_a_checkpoint_write_and_a_push_stops_cleanly_and_resumes(model, tmp_path):
    out = tmp_path / "run"
    common = (*QUIET, "trainer.total_steps=3")
    # 1: SIGTERM while step 1's checkpoint is written: the checkpoint is finished, then the run stops
    with pytest.raises(RunStopped) as stopped:
        SignalledTrainer(tiny_run_config(model, out, *common), during="checkpoint", at=1).run()
    ckpt1 = out / "checkpoints" / "step_000001"
    assert stopped.value.exit_code == REQUEUE_EXIT
    assert "stopped by SIGTERM after step 1, before the next step" in str(stopped.value)
    assert f"resumes from {ckpt1}" in str(stopped.value)
    assert json.loads((ckpt1 / STATE_FILE).read_text())["step"] == 1 and latest_checkpoint(out / "checkpoints") == ckpt1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # the run's handler is gone with it

    # 2: resumed, SIGTERM while step 2's weights are pushed: the push finishes, no checkpoint of
    # step 2 is started, and the newest checkpoint is still step 1's
    with pytest.raises(RunStopped) as stopped:
        SignalledTrainer(tiny_run_config(model, out, *common, "checkpoint.resume=auto"), during="push", at=2).run()
    assert "stopped by SIGTERM after step 2, before the step's eval and checkpoint" in str(stopped.value)
    assert latest_checkpoint(out / "checkpoints") == ckpt1 and not (out / "checkpoints" / "step_000002").exists()

    # 3: resumed again: steps 1 and 2 redone, the run ends
    steps = Trainer(tiny_run_config(model, out, *common, "checkpoint.resume=auto")).run()["steps"]
    assert len(steps) == 2
    account = read_ledger(out / LEDGER_FILE)
    assert account.runs == 3 and sorted(account.steps) == [0, 1, 2] and account.superseded == 1
    assert account.problems(64) == [] and len(account.drawn) == 3 * 4


def test_sigterm_to_megarl_train_exits_with_the_requeue_code_in_one_line(model, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl", "train", str(DEFAULT), *tiny_overrides(model, out, *QUIET)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.time() + 600   # a hang guard only; the first step takes seconds
        while not (out / LEDGER_FILE).is_file():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)   # the driver only, as `scancel --signal=TERM --batch` does
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [x for x in err.splitlines() if x.startswith("megarl train:")]
    assert proc.returncode == REQUEUE_EXIT, err[-3000:]
    assert len(lines) == 1 and "stopped by SIGTERM after step" in lines[0], err[-3000:]
    assert "Traceback" not in err
    newest = latest_checkpoint(out / "checkpoints")
    assert newest is None or (newest / STATE_FILE).is_file()


@pytest.fixture
def small_disk(tmp_path):
    """A 256 MiB tmpfs mounted at ``tmp_path / "disk"`` (needs root: CI runs as root)."""
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(model, tmp_path, small_disk):
    out = tmp_path / "run"
    ckpts = small_disk / "checkpoints"
    common = (*QUIET, "trainer.total_steps=3", f"checkpoint.dir={ckpts}")
    filled: list[Path] = []

    class DiskFillingTrainer(Trainer):
        def setup(self) -> None:
            super().setup()
            save = self.checkpoints.save

            def saving(step: int):
                if step == 2:
                    filled.append(fill_filesystem(small_disk))
                return save(step)
            self.checkpoints.save = saving

    with pytest.raises(CheckpointNotWritten) as failed:
        DiskFillingTrainer(tiny_run_config(model, out, *common)).run()
    message = str(failed.value)
    assert "\n" not in message and "No space left on device" in message, message
    assert f"checkpoint of step 2 not written to {ckpts / 'step_000002'}" in message
    assert f"the newest checkpoint is still {ckpts / 'step_000001'}" in message
    # nothing partial stays (its space is given back), and the previous checkpoint is the newest
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001"]
    from megarl.errors import user_error_line

    assert user_error_line(failed.value) is not None   # the CLI prints it as one line, no traceback

    filled[0].unlink()   # space again: the run resumes from step 1 and finishes
    steps = Trainer(tiny_run_config(model, out, *common, "checkpoint.resume=auto")).run()["steps"]
    assert len(steps) == 2 and latest_checkpoint(ckpts) == ckpts / "step_000003"
    assert read_ledger(out / LEDGER_FILE).problems(64) == []


class ValuePart:
    """A driver-side part holding one number."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class FileRole:
    """A role whose ranks write one file; with HANG_IN_SAVE set they then wait (killed there)."""

    def call(self, method: str, folder: str) -> list:
        if method == "load_checkpoint":
            assert (Path(folder) / "weights.bin").read_bytes() == b"\1" * 1000
            return [None]
        Path(folder).mkdir(parents=True)
        (Path(folder) / "weights.bin").write_bytes(b"\1" * 1000)
        if os.environ.get("HANG_IN_SAVE"):
            time.sleep(600)
        return [None]


def manager_of(root: Path, value: int):
    from megarl.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(root)
    manager.register("part", ValuePart(value))
    manager.register_role("actor", FileRole())
    return manager


def test_a_partial_checkpoint_left_by_a_kill_is_never_loaded(tmp_path):
    """A kill can stop a save anywhere before its rename: what it leaves is a ``.tmp_step_*``
    folder (the roles' files, no state file) that resume never takes and the next save removes; a
    ``step_*`` folder without its state file is skipped too."""
    root = tmp_path / "checkpoints"
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from tests.test_checkpoint_faults import manager_of\n"
            "manager_of(Path(sys.argv[1]), int(sys.argv[2])).save(int(sys.argv[2]))\n")
    assert subprocess.run([sys.executable, "-c", code, str(root), "1"], cwd=ROOT, timeout=120).returncode == 0
    killed = subprocess.Popen([sys.executable, "-c", code, str(root), "2"], cwd=ROOT,
                              env=dict(os.environ, HANG_IN_SAVE="1"))
    deadline = time.time() + 120
    while not (root / ".tmp_step_000002" / "actor" / "weights.bin").is_file():
        assert killed.poll() is None and time.time() < deadline
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    (root / "step_000003").mkdir()   # a folder of the right name without a state file

    manager = manager_of(root, 0)
    assert manager.find("auto") == root / "step_000001"
    assert manager.load(root / "step_000001")["value"] == 1 and manager.parts["part"].value == 1
    manager.parts["part"].value = 4
    manager.save(4)
    assert not (root / ".tmp_step_000002").exists() and manager.find("auto") == root / "step_000004"
