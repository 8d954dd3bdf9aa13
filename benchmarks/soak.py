"""Soak: a run hit by random faults ends bit-identical to the same run without them.

The CPU default recipe at small settings (a tiny random-init chat model by default, sync rollout,
a checkpoint every step, the ``jsonl`` metrics sink) runs twice with the same seed:

* the reference: ``megarl train`` once, never disturbed;
* the soak: ``megarl train ... checkpoint.resume=auto`` started again whenever it ends early,
  while faults drawn from ``--seed`` hit it at chosen steps:

  - ``server_kill``  -- SIGKILL of a rollout server (healed: restarted with the current weights);
  - ``server_stop``  -- SIGSTOP of a rollout server (its requests time out, it is restarted);
  - ``driver_kill``  -- SIGKILL of the driver's whole process group (resumed from the checkpoint);
  - ``rank_stop``    -- SIGSTOP of a Megatron rank (the watchdog names it, exits 75, resumed);
    needs ranks in processes of their own (``--set cluster.backend=ray``; the local backend runs
    the rank in the driver), else left out and said so;
  - ``reward_hang``  -- one reward call never returns (past ``reward.timeout_s`` it is tried again);
  - ``disk_full``    -- the tmpfs under ``checkpoint.dir`` filled before a save (the save fails
    with ``CheckpointNotWritten``, the previous checkpoint stays; the space is freed and the run
    resumed). Needs root (a tmpfs mount); without it this kind is left out and said so.

Compared at the end: every per-step metric of the two runs bit for bit (a step redone after a
resume counts with its last line), except time, throughput, memory and the fault counters
(``rollout/restarted_servers``, ``rollout/retried_requests``, ``rollout/resumed_requests``); the
sha256 of every file of the final HF export; the prompt ledger (each step's prompts equal to the
reference's, none repeated or skipped per epoch). One JSON line: faults by kind, restarts, steps
redone, wall time lost per fault (soak wall minus reference wall, over the faults).

    python benchmarks/soak.py --steps 200 --faults 12 --seed 0
    python benchmarks/soak.py --steps 12 --faults 4 --seed 1 --kinds server_kill,driver_kill,reward_hang
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl.rollout.ledger import LEDGER_FILE, read_ledger  # noqa: E402

KINDS = ("server_kill", "server_stop", "driver_kill", "rank_stop", "reward_hang", "disk_full")
NOT_COMPARED = ("time/", "throughput/", "memory/", "sync/seconds", "sync/bytes_per_s", "rollout/restarted_servers",
                "rollout/retried_requests", "rollout/resumed_requests")
TRAIN_RECORDS = 64
MISS_AFTER_S = 60.0   # a fault with nothing to hit (no server up, say) this long after it is due is missed


def soak_reward(text: str, record: Any) -> float:
    """The tests' distinct-token reward, except that once ``SOAK_HANG_DIR/arm`` exists, the one
    call that takes it (an atomic rename) never returns: a verifier stuck for good."""
    arm = os.environ.get("SOAK_HANG_DIR")
    if arm:
        try:
            os.rename(os.path.join(arm, "arm"), os.path.join(arm, f"fired-{os.getpid()}-{time.time_ns()}"))
        except FileNotFoundError:
            pass
        else:
            while True:
                time.sleep(1.0)
    return len(set(text)) / 10.0


def run_overrides(model: Path, out: Path, ckpt: Path, steps: int, extra: list[str]) -> list[str]:
    from tests.helpers.runs import tiny_overrides

    return tiny_overrides(model, out, f"trainer.total_steps={steps}", f"data.num_train={TRAIN_RECORDS}",
                          "checkpoint.interval=1", "checkpoint.keep_last=2", f"checkpoint.dir={ckpt}",
                          "checkpoint.export_hf=true", "trainer.eval_before_after=false", "logging.sinks=[jsonl]",
                          "logging.progress_bar=false", "reward.function=benchmarks.soak:soak_reward",
                          "reward.timeout_s=5", "reward.retries=1", "rollout.request_timeout_s=15",
                          "rollout.max_restarts=1000", "watchdog.min_s=90", "watchdog.first_step_s=300", *extra)


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def steps_logged(out: Path) -> int:
    """The highest step the run's metrics reached (0 before the first)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    last = 0
    for line in path.read_text().splitlines():
        try:
            last = max(last, int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass            # a line cut by a kill
    return last


def per_step(out: Path) -> dict[int, dict[str, float]]:
    """Each step's last line (a step redone after a resume: the redone one)."""
    found: dict[int, dict[str, float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            x = json.loads(line)
        except ValueError:
            continue
        if any(k.startswith("actor/") for k in x):   # step lines (evals are logged at a step too)
            found[int(x["step"])] = {k: v for k, v in x.items() if k != "step" and not k.startswith(NOT_COMPARED)}
    return found


def checkpoint_step(ckpt: Path) -> int:
    """The step of the newest whole checkpoint (0: none yet)."""
    from megarl.checkpoint.manager import latest_checkpoint

    newest = latest_checkpoint(ckpt)
    return int(newest.name.split("_")[1]) if newest is not None else 0


def digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}


def descendants(root: int) -> list[int]:
    from tests.helpers.faults import process_tree

    return sorted(process_tree(root) - {root})


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def server_pids(driver: int) -> list[int]:
    return [p for p in descendants(driver) if "megarl.engine" in cmdline(p) and state(p) not in ("T", "Z", "gone")]


def rank_pids(driver: int, out: Path) -> list[int]:
    """Megatron ranks of the running driver: the stack files they registered (``..._pidN.txt``)."""
    mine = set(descendants(driver))
    found = []
    for f in (out / "watchdog" / "ranks").glob("*_pid*.txt"):
        pid = int(f.stem.rsplit("_pid", 1)[1])
        if pid in mine and state(pid) not in ("T", "Z", "gone"):
            found.append(pid)
    return sorted(found)


class Disk:
    """A tmpfs for ``checkpoint.dir`` that can be filled and emptied (root only)."""

    def __init__(self, where: Path, size_mb: int):
        self.where, self.mounted = where, False
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
                              capture_output=True, text=True)
        self.mounted = done.returncode == 0
        self.why = done.stderr.strip()

    def fill(self) -> None:
        from tests.helpers.faults import fill_filesystem

        fill_filesystem(self.where)

    def empty(self) -> bool:
        filler = self.where / "filler"
        if filler.exists():
            filler.unlink()
            return True
        return False

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.where)], check=False)


def schedule(seed: int, steps: int, faults: int, kinds: list[str]) -> list[tuple[int, str]]:
    """``faults`` (step, kind) pairs: every kind at least once when there are enough faults,
    steps spread over the run (never the first step: a resume needs a checkpoint)."""
    rng = random.Random(seed)
    chosen = [kinds[i % len(kinds)] for i in range(faults)]
    rng.shuffle(chosen)
    at = sorted(rng.sample(range(1, steps), min(faults, steps - 1)))
    return list(zip(at, chosen))


def inject(kind: str, proc: subprocess.Popen, out: Path, hang_dir: Path, disk: Optional[Disk]) -> Optional[str]:
    """Apply one fault now; returns what was hit, or None when there was nothing to hit yet."""
    if kind in ("server_kill", "server_stop"):
        pids = server_pids(proc.pid)
        if not pids:
            return None
        os.kill(pids[0], signal.SIGKILL if kind == "server_kill" else signal.SIGSTOP)
        return f"server pid {pids[0]}"
    if kind == "driver_kill":
        os.killpg(proc.pid, signal.SIGKILL)
        return f"driver pid {proc.pid} and its process group"
    if kind == "rank_stop":
        pids = rank_pids(proc.pid, out)
        if not pids:
            return None
        os.kill(pids[-1], signal.SIGSTOP)
        return f"rank pid {pids[-1]}"
    if kind == "reward_hang":
        (hang_dir / "arm").touch()
        return "the next reward call"
    if kind == "disk_full":
        assert disk is not None
        disk.fill()
        return f"tmpfs {disk.where}"
    raise ValueError(kind)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/megarl_soak"))
    ap.add_argument("--max-restarts", type=int, default=60)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more recipe overrides")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    import shutil

    from tests.helpers.models import make_tiny_chat_model
    from tests.helpers.runs import DEFAULT

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    model = make_tiny_chat_model(args.work / "model")
    notes: list[str] = []
    disk = Disk(args.work / "soak_ckpt", 512) if "disk_full" in kinds else None
    if disk is not None and not disk.mounted:
        notes.append(f"disk_full left out: no tmpfs ({disk.why})")
        kinds.remove("disk_full")
        disk = None
    if "rank_stop" in kinds and not any(x.startswith("cluster.backend=ray") for x in args.set):
        notes.append("rank_stop left out: with cluster.backend local the Megatron rank runs in the driver "
                     "process (--set cluster.backend=ray puts ranks in processes of their own)")
        kinds.remove("rank_stop")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")

    def command(out: Path, ckpt: Path, resume: bool) -> list[str]:
        extra = [*args.set] + (["checkpoint.resume=auto"] if resume else [])
        return [sys.executable, "-m", "megarl", "train", str(DEFAULT), *run_overrides(model, out, ckpt, args.steps, extra)]

    # the reference: never disturbed
    ref_out = args.work / "reference"
    t0 = time.time()
    ref = start(command(ref_out, ref_out / "checkpoints", False), args.work / "reference.log", env)
    if ref.wait() != 0:
        raise SystemExit(f"the reference run failed (rc {ref.returncode}); log {args.work / 'reference.log'}")
    ref_wall = time.time() - t0

    # the soak
    out = args.work / "soak"
    ckpt = disk.where / "checkpoints" if disk else out / "checkpoints"
    hang_dir = args.work / "hang"
    hang_dir.mkdir()
    env_soak = dict(env, SOAK_HANG_DIR=str(hang_dir))
    plan = schedule(args.seed, args.steps, args.faults, kinds)
    pending = list(plan)
    hits: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    t0 = time.time()
    resume = False
    missed: list[list[Any]] = []
    due: Optional[float] = None
    while True:
        proc = start(command(out, ckpt, resume), args.work / "soak.log", env_soak)
        began = checkpoint_step(ckpt)   # where this run resumes
        while proc.poll() is None:
            done = steps_logged(out)
            if pending and done >= pending[0][0]:
                step, kind = pending[0]
                due = due or time.time()
                what = inject(kind, proc, out, hang_dir, disk)
                if what is not None:
                    hits.append({"kind": kind, "at_step": step, "seen_step": done, "hit": what, "t": time.time() - t0})
                    print(f"[soak] {kind} at step {done}: {what}", file=sys.stderr, flush=True)
                if what is not None or time.time() - due > MISS_AFTER_S:   # nothing to hit for long: missed
                    missed += [] if what is not None else [[step, kind]]
                    pending.pop(0)
                    due = None
            time.sleep(0.2)
        reached = steps_logged(out)
        runs.append({"rc": proc.returncode, "from_step": began, "reached": reached})
        if proc.returncode == 0 and reached >= args.steps:
            break
        if disk is not None:
            disk.empty()
        for pid in descendants(proc.pid) + [proc.pid]:   # nothing of a stopped run may linger
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if len(runs) > args.max_restarts:
            raise SystemExit(f"more than {args.max_restarts} restarts; log {args.work / 'soak.log'}")
        resume = True
    soak_wall = time.time() - t0
    if disk is not None:
        export_digests_soak = digests(out / "hf_export")
        disk.close()
    else:
        export_digests_soak = digests(out / "hf_export")

    # what was redone: each restart resumes at the newest checkpoint, below the step the run had reached
    redone = sum(max(0, r["reached"] - nxt["from_step"]) for r, nxt in zip(runs, runs[1:]))
    ref_steps, soak_steps = per_step(ref_out), per_step(out)
    differ = {s: sorted(k for k in set(ref_steps[s]) | set(soak_steps.get(s, {}))
                        if ref_steps[s].get(k) != soak_steps.get(s, {}).get(k)) for s in ref_steps}
    differ = {s: ks for s, ks in differ.items() if ks}
    ref_ledger, soak_ledger = read_ledger(ref_out / LEDGER_FILE), read_ledger(out / LEDGER_FILE)
    same_prompts = {s: v["trained"] for s, v in soak_ledger.steps.items()} == {
        s: v["trained"] for s, v in ref_ledger.steps.items()}
    print(json.dumps({
        "bench": "soak", "steps": args.steps, "seed": args.seed, "faults_planned": len(plan),
        "faults_hit": len(hits), "faults_by_kind": {k: sum(h["kind"] == k for h in hits) for k in KINDS},
        "faults_missed": missed + [list(p) for p in pending], "restarts": len(runs) - 1,
        "exit_codes": [r["rc"] for r in runs], "steps_redone": redone,
        "reference_wall_s": round(ref_wall, 1), "soak_wall_s": round(soak_wall, 1),
        "wall_lost_per_fault_s": round((soak_wall - ref_wall) / max(1, len(hits)), 1),
        "metrics_bit_identical": not differ and set(ref_steps) == set(soak_steps),
        "steps_differing": len(differ), "first_differences": dict(list(differ.items())[:3]),
        "export_sha256_identical": export_digests_soak == digests(ref_out / "hf_export"),
        "ledger_problems": soak_ledger.problems(TRAIN_RECORDS), "ledger_prompts_equal_reference": same_prompts,
        "ledger_runs": soak_ledger.runs, "hits": hits, "notes": notes}))


if __name__ == "__main__":
    main()
