"""``megarl hub export`` as users run it (a subprocess): each hub's own export writes the tasks a
recipe's ``data.path`` reads, ``--arg`` values are YAML, and bad input is one line, exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VF_ENVS = ROOT / "tests" / "helpers" / "vf_envs"      # vf-say-word, as an installed environment package


def megarl(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(VF_ENVS)]))
    return subprocess.run([sys.executable, "-m", "megarl", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_export_writes_each_hubs_own_tasks(tmp_path):
    out = tmp_path / "vf.jsonl"
    r = megarl("hub", "export", "verifiers", str(out), "--arg", "environment=vf-say-word",
               "--arg", "env_args={taskset: {num_tasks: 5}}")
    assert r.returncode == 0, r.stderr
    assert f"megarl hub export: 5 tasks -> {out}" in r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(row["verifiers"]["environment"] == "vf-say-word" for row in rows)
    assert len({json.dumps(row["prompt"]) for row in rows}) == 5        # five different tasks

    out = tmp_path / "oe.jsonl"
    r = megarl("hub", "export", "openenv", str(out), "--arg", "count=3", "--arg", "seed_start=10",
               "--arg", "reset={difficulty: 2}")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["openenv"] for row in rows] == [{"seed": s, "reset": {"difficulty": 2}} for s in (10, 11, 12)]


@pytest.mark.parametrize("args,words", [
    (["verifier", "x.jsonl"], "hub 'verifier': unknown (known: openenv, verifiers)"),
    (["openenv", "x.jsonl", "--arg", "count"], "--arg 'count': expected NAME=VALUE"),
    (["openenv", "x.jsonl", "--arg", "count=many"], "openenv export: count 'many' must be a positive integer"),
    (["openenv", "x.jsonl", "--arg", "count=2", "--arg", "colour=red"], "openenv export: unknown arguments ['colour']"),
    (["verifiers", "x.jsonl", "--arg", "environment=no-such-env"], "environment"),
])
def test_bad_input_is_one_line(tmp_path, args, words):
    r = megarl("hub", "export", *[str(tmp_path / a) if a.endswith(".jsonl") else a for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("megarl hub: ") and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr
