"""The prompt ledger's account of a run across kills and resumes (``megarl/rollout/ledger.py``):
which line of a redone step counts, a torn last line, and the exactly-once check, on ledgers
written by the ledger's own writer the way a killed and a resumed run write them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megarl.rollout.ledger import PromptLedger, read_ledger


def write_run(path: Path, steps: dict[int, list[int]], pending: list[int] | None = None,
              discarded: dict[int, list[int]] | None = None) -> PromptLedger:
    ledger = PromptLedger(path)
    ledger.run_id = f"run-{path.stat().st_size if path.exists() else 0}"   # distinct per call
    for step, trained in steps.items():
        ledger.record_step(step, trained, (discarded or {}).get(step, []), epoch=0)
    if pending is not None:
        ledger.record_exit(pending)
    return ledger


def test_a_resumed_run_supersedes_the_killed_runs_steps_from_its_checkpoint(tmp_path):
    path = tmp_path / "ledger.jsonl"
    # killed after step 3 was taken; its checkpoint was of step 2 (steps 0 and 1 done)
    write_run(path, {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]})
    with path.open("a") as f:
        f.write('{"run": "run-x", "step": 4, "trai')          # the kill cut this line
    # the resumed run redoes steps 2 and 3 and goes on; the prompts of the redone steps are the same
    write_run(path, {2: [4, 5], 3: [6, 7], 4: [8, 9]}, pending=[10])
    acc = read_ledger(path)
    assert acc.runs == 2 and acc.torn == 1 and acc.superseded == 2
    assert {s: v["trained"] for s, v in acc.steps.items()} == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7], 4: [8, 9]}
    assert acc.pending == [10]
    assert acc.problems(dataset_size=12) == []


def test_a_repeated_and_a_skipped_prompt_are_named(tmp_path):
    repeated = tmp_path / "repeated.jsonl"
    write_run(repeated, {0: [0, 1], 1: [1, 2]})                      # prompt 1 twice in the first epoch
    problems = read_ledger(repeated).problems(dataset_size=5)
    assert len(problems) == 1 and "drawn more often than the 1 epoch(s) begun" in problems[0] and "(1, 2)" in problems[0]

    skipped = tmp_path / "skipped.jsonl"
    # a resume that lost the buffered prompts 2 and 3: the second epoch starts without them
    write_run(skipped, {0: [0, 1], 1: [4, 5]})
    write_run(skipped, {2: [0, 1], 3: [4, 5]})
    problems = read_ledger(skipped).problems(dataset_size=6)
    assert problems == ["2 prompt(s) never drawn in the 1 finished epoch(s), e.g. [2, 3]"], problems


def test_discarded_and_pending_prompts_count_as_drawn(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_run(path, {0: [0, 1], 1: [3]}, pending=[5], discarded={1: [2, 4]})
    acc = read_ledger(path)
    assert acc.drawn == [0, 1, 3, 2, 4] and acc.problems(dataset_size=6) == []
    assert acc.summary(6)["discarded"] == 2


def test_the_cli_prints_one_line_and_fails_on_a_repeat(tmp_path):
    write_run(tmp_path / "rollout_ledger.jsonl", {0: [0, 1], 1: [2, 3]})
    ok = subprocess.run([sys.executable, "-m", "megarl", "ledger", str(tmp_path), "--dataset-size", "8"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout)
    assert summary["steps"] == 2 and summary["trained"] == 4 and summary["problems"] == []

    write_run(tmp_path / "rollout_ledger.jsonl", {2: [3]})            # a third run repeats prompt 3
    bad = subprocess.run([sys.executable, "-m", "megarl", "ledger", str(tmp_path), "--dataset-size", "8"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "drawn more often" in json.loads(bad.stdout)["problems"][0]

    missing = subprocess.run([sys.executable, "-m", "megarl", "ledger", str(tmp_path / "nowhere")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no prompt ledger" in missing.stderr
