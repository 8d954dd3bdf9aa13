"""What validation accepts, ``megarl train`` runs; what it refuses, it refuses in one line a problem,
each naming its field.

Configurations are drawn from a seeded generator over the switches that change the runtime's
shape: backend, ranks, TP / PP / VPP and an uneven first stage, the offload switches, packing,
placement and the rollout mode, on a 4-layer tiny model. Every draw is validated in-process (fast);
a few of the accepted ones, and one fixed uneven pipeline, run one real step with the CLI in a
subprocess under a deadline: exit 0, no traceback, and the uneven split built as planned.
``MEGARL_VALIDATED_RUNS`` (default 1) and ``MEGARL_VALIDATED_SEED`` widen the search by hand.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.config.loader import ConfigError
from tests.helpers.models import make_tiny_chat_model
from tests.helpers.runs import DEFAULT, ROOT, tiny_overrides

SPACE = {
    "cluster.backend": ["local", "ray"],
    "actor.gpus": [1, 2],
    "actor.parallel.tp": [1, 2],
    "actor.parallel.pp": [1, 2],
    "actor.parallel.vpp": [1, 2],
    "actor.parallel.first_stage_layers": [0, 1, 3],
    "actor.offload.params": [True, False],
    "actor.offload.grads": [True, False],
    "actor.offload.optimizer": [True, False],
    "actor.packing": [True, False],
    "placement.mode": ["colocated", "disaggregated"],
    "rollout.mode": ["sync", "one_step_off", "async"],
}
DRAWS = 40
FIELD_LINE = re.compile(r"^[a-z_0-9]+(\.[a-z_0-9]+)*: \S")
ONE_STEP = ("trainer.total_steps=1", "trainer.eval_before_after=false", "checkpoint.export_hf=false",
            "batch.prompts_per_step=2", "data.num_eval=4")
UNEVEN = {"cluster.backend": "ray", "actor.gpus": 2, "actor.parallel.pp": 2,
          "actor.parallel.first_stage_layers": 1, "actor.offload.optimizer": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny4", layers=4)


def draw(rng: random.Random) -> dict:
    return {k: rng.choice(v) for k, v in SPACE.items()}


def as_overrides(choice: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in choice.items()]


def validate(model: Path, out: Path, choice: dict) -> list[str]:
    """The problems validation names (empty: accepted)."""
    try:
        load_config(DEFAULT, tiny_overrides(model, out, *ONE_STEP, *as_overrides(choice)))
    except ConfigError as err:
        return list(err.problems)
    return []


def run_one_step(model: Path, out: Path, choice: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megarl", "train", str(DEFAULT),
           *tiny_overrides(model, out, *ONE_STEP, *as_overrides(choice))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_drawn_configs_are_refused_in_one_line_each_or_run_one_step(model, tmp_path):
    rng = random.Random(int(os.environ.get("MEGARL_VALIDATED_SEED", "7")))
    accepted, refused = [], 0
    for i in range(DRAWS):
        choice = draw(rng)
        problems = validate(model, tmp_path / f"v{i}", choice)
        if problems:
            refused += 1
            bad = [p for p in problems if "\n" in p or not FIELD_LINE.match(p)]
            assert not bad, (choice, bad)
        else:
            accepted.append(choice)
    assert refused and accepted, (refused, len(accepted))   # the space holds both kinds
    runs = int(os.environ.get("MEGARL_VALIDATED_RUNS", "1"))
    for i, choice in enumerate(accepted[:runs]):
        proc = run_one_step(model, tmp_path / f"run{i}", choice)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (choice, proc.stderr[-3000:])
        assert "step 1/1" in proc.stdout + proc.stderr, (choice, proc.stdout[-2000:])


def test_uneven_pipeline_runs_with_the_planned_split(model, tmp_path):
    """pp 2 with one layer on the first stage: the ranks build 1 / 3 layers (checked against the
    plan at start-up), and the step runs."""
    assert validate(model, tmp_path / "v", UNEVEN) == []
    proc = run_one_step(model, tmp_path / "run", UNEVEN)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "layers per pipeline rank 1/3" in out, out[-3000:]
    assert "step 1/1" in out
