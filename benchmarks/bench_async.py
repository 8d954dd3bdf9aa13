"""Rollout modes side by side: ``sync``, ``one_step_off`` and ``async`` on the same recipe and seed.

Each mode runs the real trainer (backend ``local``: Megatron actor in-process, one rollout server
as its own process, placement ``disaggregated`` -- on one GPU both share the device, on CPU the
cores) in a fresh process, for the same number of steps. Printed, as ONE JSON line:

* per mode: wall seconds from the end of step 0 (which pays compilation/graph capture) to the end
  of the last step, the samples trained in that window, samples/s, the reward curve (mean reward
  per step), held-out greedy accuracy after the run, staleness (mean/max versions), partial
  rollouts (requests resumed after an abort, share of mixed-version samples), stale groups dropped,
  and the mean |trainer - rollout| logprob of fresh tokens (a push that reached the server sits at
  the dtype noise floor);
* the ideal speedup ``(rollout + train_side) / max(rollout, train_side)`` from the ``sync`` run's
  own phase times (mean over steps >= 1; train side = old/ref logprobs, values, train, weight push),
  and for each off-policy mode the achieved speedup ``wall_sync / wall_mode``, its fraction of the
  ideal (``achieved / ideal``) and the fraction of the possible gain (``(achieved - 1) / (ideal - 1)``).

On CPU (2 shared cores) the trainer and the server compete for the same cores: the line shows the
modes run and train, not the speed of overlap. On one GPU:

    python benchmarks/bench_async.py --model builtin:smollm2-135m-instruct --device cuda \\
        --steps 10 --prompts 64 --n 8 --new-tokens 128 --recipe-data --lr 5e-6
    python benchmarks/bench_async.py --device cpu            # tiny random model, distinct-token reward
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("sync", "one_step_off", "async")
TRAIN_SIDE = ("old_logprobs", "ref_logprobs", "values", "train", "sync")
ARCH_FROM_CONFIG_JSON = [f"model.arch.{k}=0" for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                        "num_attention_heads", "num_kv_heads", "vocab_size")] + [
    "model.arch.tie_word_embeddings=false"]


def overrides(args: argparse.Namespace, mode: str) -> list[str]:
    """The recipe overrides of one mode's run: bench_e2e's (model, device, data, sizes), then the
    placement, the rollout mode and what this benchmark fixes."""
    from bench_e2e import overrides_for

    e2e = argparse.Namespace(work=args.work, device=args.device, model=args.model_path, tokenizer=None,
                             recipe_defaults=False, shape="tiny", steps=args.steps, recipe_data=args.recipe_data,
                             prompts=args.prompts, n=args.n, new_tokens=args.new_tokens, max_running=args.max_running)
    out = overrides_for(e2e)
    if args.model == "tiny":
        out += ARCH_FROM_CONFIG_JSON
    if not args.recipe_data:   # bench_e2e's arithmetic JSONL: held-out prompts from another seed
        from bench_e2e import write_prompts

        out.append(f"data.eval_path={write_prompts(args.work / 'eval.jsonl', args.eval_prompts, 2)}")
    out += [f"output_dir={args.work / ('run_' + mode)}", f"seed={args.seed}", "placement.mode=disaggregated",
            f"rollout.mode={mode}", f"rollout.max_staleness={1 if mode != 'async' else args.max_staleness}",
            f"rollout.interrupt={args.interrupt}", f"actor.optim.lr={args.lr}", "trainer.eval_before_after=true",
            f"data.num_eval={args.eval_prompts}"]
    return out + list(args.override)


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One mode in this process: the trainer's run with each step's end time recorded."""
    from megarl.config import load_config, validate_config
    from megarl.trainer import Trainer

    class Timed(Trainer):
        def _step_or_checkpoint(self, step: int) -> dict[str, float]:
            metrics = super()._step_or_checkpoint(step)
            self.step_ends.append(time.time())
            self.thread_cpu.append(python_threads_cpu_s())
            return metrics

    cfg = validate_config(load_config(ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml", overrides(args, mode)))
    trainer = Timed(cfg)
    trainer.step_ends, trainer.thread_cpu = [], []
    results = trainer.run()
    steps = results["steps"]
    ends = trainer.step_ends
    timed = steps[1:]
    mean = lambda k: statistics.mean(s.get(k, 0.0) for s in timed)  # noqa: E731
    samples = sum(s["batch/samples"] for s in timed)
    wall = ends[-1] - ends[0]
    out = {"mode": mode, "steps": len(steps), "samples_timed": samples, "wall_s": round(wall, 2),
           "samples_per_s": round(samples / wall, 2) if wall > 0 else None,
           "step_s_mean": round(wall / max(len(timed), 1), 3),
           "phase_s": {p: round(mean(f"time/{p}_s"), 3) for p in ("rollout",) + TRAIN_SIDE},
           "reward_curve": [round(s["reward/mean"], 4) for s in steps],
           "eval_accuracy_before": results.get("eval_before", {}).get("eval/accuracy"),
           "eval_accuracy_after": results.get("eval_after", {}).get("eval/accuracy"),
           "eval_reward_after": results.get("eval_after", {}).get("eval/reward_mean")}
    # the trainer process's Python threads: what the rollout client, scoring and rewards take of
    # the interpreter lock the trainer's kernel launches need (CPU seconds per timed step)
    cpu = trainer.thread_cpu
    if len(cpu) >= 2:
        names = sorted(set(cpu[-1]) | set(cpu[0]))
        out["trainer_threads_cpu_s_per_step"] = {
            n: round((cpu[-1].get(n, 0.0) - cpu[0].get(n, 0.0)) / (len(cpu) - 1), 3) for n in names}
    if mode != "sync":
        out.update({"staleness_mean": round(mean("offpolicy/staleness_mean"), 3),
                    "staleness_max": max(s["offpolicy/staleness_max"] for s in steps),
                    "offpolicy_token_frac": round(mean("offpolicy/offpolicy_token_frac"), 3),
                    "mixed_version_frac": round(mean("offpolicy/mixed_version_frac"), 3),
                    "resumed_requests": sum(s.get("rollout/resumed_requests", 0) for s in steps),
                    "stale_groups_dropped": sum(s.get("rollout/stale_groups_dropped", 0) for s in steps),
                    "fresh_logprob_diff_mean": max((s["offpolicy/fresh_logprob_diff_mean"] for s in steps
                                                    if "offpolicy/fresh_logprob_diff_mean" in s), default=None)})
    return out


def python_threads_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system, from /proc) of this process's Python threads so far, summed by
    name without the pool index (``megarl-reward_0`` and ``_1`` -> ``megarl-reward``). Threads
    that ended are not counted."""
    import os
    import re
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            fields = open(f"/proc/self/task/{t.native_id}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        name = re.sub(r"_\d+$", "", t.name)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def summarize(args: argparse.Namespace, runs: dict[str, dict]) -> dict[str, Any]:
    sync = runs["sync"]
    rollout = sync["phase_s"]["rollout"]
    train_side = sum(sync["phase_s"][p] for p in TRAIN_SIDE)
    ideal = (rollout + train_side) / max(rollout, train_side, 1e-9)
    out: dict[str, Any] = {
        "bench": "async_modes", "model": args.model, "device": args.device, "seed": args.seed, "steps": args.steps,
        "samples_per_step": args.prompts * args.n, "max_new_tokens": args.new_tokens,
        "max_staleness_async": args.max_staleness, "interrupt": args.interrupt,
        "sync_rollout_s": round(rollout, 3), "sync_train_side_s": round(train_side, 3),
        "ideal_speedup": round(ideal, 3), "modes": runs}
    for mode, r in runs.items():
        if mode == "sync" or not r.get("wall_s"):
            continue
        achieved = sync["wall_s"] / r["wall_s"]
        out[f"{mode}_speedup"] = round(achieved, 3)
        out[f"{mode}_fraction_of_ideal"] = round(achieved / ideal, 3)
        out[f"{mode}_fraction_of_gain"] = round((achieved - 1) / (ideal - 1), 3) if ideal > 1.001 else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (random, 2 layers) | builtin:smollm2-135m-instruct | HF folder")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/megarl_bench_async"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--max-running", type=int, default=0, help="rollout.max_running_requests (0: every sample)")
    ap.add_argument("--max-staleness", type=int, default=1, help="async's rollout.max_staleness")
    ap.add_argument("--interrupt", default="abort", choices=["abort", "retract", "none"])
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts scored after each run")
    ap.add_argument("--recipe-data", action="store_true", help="the recipe's data and reward (arithmetic, exact answer)")
    ap.add_argument("--override", action="append", default=[], help="extra dotted override (repeatable)")
    ap.add_argument("--one-mode", default=None, help=argparse.SUPPRESS)   # internal: run one mode, print its JSON
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.model == "tiny":
        from tests.helpers.models import make_tiny_chat_model

        args.model_path = str(make_tiny_chat_model(args.work / "tinychat"))
    else:
        args.model_path = args.model
    if args.one_mode:
        print("BENCH_MODE " + json.dumps(run_mode(args, args.one_mode)), flush=True)
        return
    runs: dict[str, dict] = {}
    for mode in args.modes.split(","):
        # a fresh process per mode: no state (compiled graphs, process groups, caches) carried over
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one-mode", mode], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_MODE ")]
        if proc.returncode or not found:
            raise SystemExit(f"bench_async: mode {mode} failed (exit {proc.returncode}); see its stderr above")
        runs[mode] = json.loads(found[-1][len("BENCH_MODE "):])
        print(json.dumps({"mode_done": mode, "wall_s": runs[mode]["wall_s"]}), file=sys.stderr, flush=True)
    print(json.dumps(summarize(args, runs) if "sync" in runs else {"bench": "async_modes", "modes": runs}))


if __name__ == "__main__":
    main()
