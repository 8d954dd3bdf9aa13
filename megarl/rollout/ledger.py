"""The prompt ledger: which prompts each step trained on, across kills and resumes.

Why: a resume that silently skips or repeats data is the fault users of other RL frameworks
report most after preemption (a third of the prompts skipped after a resume, buffered rollouts
dropped), and nothing in a run's metrics shows it. Every rollout source appends one JSON line to
``OUTPUT_DIR/rollout_ledger.jsonl`` per batch the trainer takes:

    {"run": "<pid>-<start time>", "step": 3, "epoch": 0, "trained": [17, 4, ...], "discarded": [...]}

* ``trained``: the record indices (``PromptRecord.index``) whose groups the step trains on;
* ``discarded``: those drawn for the step but left out (dynamic sampling's groups without signal,
  an off-policy buffer's stale groups);
* ``epoch``: the data loader's epoch after the draw.

and, when an off-policy run ends, one line with the prompts drawn but not yet trained on
(``pending_at_exit``; a checkpoint holds them and the next run trains them first).

A run resumed from a checkpoint redoes the steps after it, so :func:`read_ledger` keeps, for each
step, the line of the latest run that wrote it (a run that starts at step k supersedes every
earlier line of step k or later); a step redone in one run (its batch rewound after a failure)
keeps its last line too. :meth:`LedgerAccount.problems` then checks what the run promises: no
prompt trained or discarded more often than the epochs begun, and within the epochs finished,
none left out. ``megarl ledger OUTPUT_DIR`` prints that account.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

LEDGER_FILE = "rollout_ledger.jsonl"


class PromptLedger:
    """Appends one run's lines; ``path=None`` keeps no ledger."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self.run_id = f"{os.getpid()}-{time.time():.0f}"

    def record_step(self, step: int, trained: Iterable[int], discarded: Iterable[int] = (),
                    epoch: Optional[int] = None) -> None:
        self._write({"step": step, "epoch": epoch, "trained": [int(i) for i in trained],
                     "discarded": [int(i) for i in discarded]})

    def record_exit(self, pending: Iterable[int]) -> None:
        self._write({"pending_at_exit": [int(i) for i in pending]})

    def _write(self, entry: dict[str, Any]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a+b") as f:   # one write per line: a kill leaves at most one torn line
            torn = False
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            f.write((("\n" if torn else "") + json.dumps({"run": self.run_id, **entry}) + "\n").encode())
            f.flush()


@dataclass
class LedgerAccount:
    """The committed history: per step its trained and discarded prompts, the last run's pending."""

    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)
    runs: int = 0
    superseded: int = 0          # lines of steps a later run (or a rewind) redid
    torn: int = 0                # lines cut by a kill

    @property
    def drawn(self) -> list[int]:
        """Every prompt the committed steps drew, trained or discarded, in step order."""
        return [i for s in sorted(self.steps) for i in self.steps[s]["trained"] + self.steps[s]["discarded"]]

    def problems(self, dataset_size: int) -> list[str]:
        """What breaks exactly-once, as sentences (empty when the ledger holds): a prompt drawn more
        often than the epochs begun, or, of the epochs finished, one never drawn. Prompts pending at
        exit count as drawn (their groups are in the checkpoint)."""
        drawn = self.drawn + self.pending
        counts = Counter(drawn)
        out: list[str] = []
        outside = sorted(i for i in counts if not 0 <= i < dataset_size)
        if outside:
            out.append(f"record indices outside the data set of {dataset_size}: {outside[:10]}")
        begun = -(-len(drawn) // dataset_size) if drawn else 0      # epochs begun, by count
        finished = len(drawn) // dataset_size
        over = sorted(i for i, c in counts.items() if c > begun)
        if over:
            out.append(f"{len(over)} prompt(s) drawn more often than the {begun} epoch(s) begun, e.g. "
                       f"{[(i, counts[i]) for i in over[:5]]}")
        missing = sorted(i for i in range(dataset_size) if counts[i] < finished)
        if missing:
            out.append(f"{len(missing)} prompt(s) never drawn in the {finished} finished epoch(s), e.g. {missing[:5]}")
        return out

    def summary(self, dataset_size: Optional[int] = None) -> dict[str, Any]:
        steps = sorted(self.steps)
        out: dict[str, Any] = {"runs": self.runs, "steps": len(steps), "first_step": steps[0] if steps else None,
                               "last_step": steps[-1] if steps else None,
                               "trained": sum(len(v["trained"]) for v in self.steps.values()),
                               "discarded": sum(len(v["discarded"]) for v in self.steps.values()),
                               "pending_at_exit": len(self.pending), "superseded_lines": self.superseded,
                               "torn_lines": self.torn}
        gaps = [s for s in range(steps[0], steps[-1] + 1) if s not in self.steps] if steps else []
        if gaps:
            out["missing_steps"] = gaps
        if dataset_size is not None:
            out["problems"] = self.problems(dataset_size) + ([f"steps without a line: {gaps[:10]}"] if gaps else [])
        return out


def read_ledger(path: Path) -> LedgerAccount:
    """The committed history of ``path`` (see the module's docstring for which line wins)."""
    acc = LedgerAccount()
    lines = path.read_text().splitlines() if path.is_file() else []
    current: Optional[str] = None
    run_started = False          # the current run wrote a step line already
    for raw in lines:
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError:     # a run killed mid-line (the next run starts a new line)
            acc.torn += 1
            continue
        run = entry.get("run")
        if run != current:
            current, run_started = run, False
            acc.runs += 1
            acc.pending = []
        if "pending_at_exit" in entry:
            acc.pending = list(entry["pending_at_exit"])
            continue
        if "step" not in entry:
            continue
        step = int(entry["step"])
        if not run_started:          # a run resumes at its first step: earlier lines from there on are redone
            run_started = True
            for s in [s for s in acc.steps if s > step]:
                del acc.steps[s]
                acc.superseded += 1
        if step in acc.steps:
            acc.superseded += 1
        acc.steps[step] = {"trained": list(entry.get("trained", entry.get("consumed", []))),
                           "discarded": list(entry.get("discarded", [])), "epoch": entry.get("epoch")}
    return acc


__all__ = ["LEDGER_FILE", "PromptLedger", "LedgerAccount", "read_ledger"]


def ledger_main(argv: list[str]) -> int:
    """``megarl ledger OUTPUT_DIR [--dataset-size N]``: the run's prompt account as one JSON line;
    exit 1 when a prompt was repeated or left out."""
    import argparse

    parser = argparse.ArgumentParser(prog="megarl ledger", description="which prompts a run trained on, across "
                                     "resumes; checks that none was repeated or skipped within an epoch")
    parser.add_argument("output_dir", type=Path, help="the run's output_dir (or the ledger file itself)")
    parser.add_argument("--dataset-size", type=int, default=None,
                        help="prompts in the train split (enables the exactly-once check)")
    args = parser.parse_args(argv)
    path = args.output_dir if args.output_dir.is_file() else args.output_dir / LEDGER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no prompt ledger (is this a run's output_dir?)")
    summary = read_ledger(path).summary(args.dataset_size)
    print(json.dumps(summary))
    return 1 if summary.get("problems") else 0
