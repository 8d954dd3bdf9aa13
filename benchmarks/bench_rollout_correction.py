"""Rollout corrections compared on the FP8-rollout recipe: held-out accuracy and mismatch per mode.

The default GRPO recipe (real SmolLM2-135M-Instruct, reasoning-gym arithmetic, 31 held-out prompts)
with the servers serving the model's block-FP8 copy while the trainer computes in full precision,
so rollout and training differ on every token. Each mode of ``algorithm.rollout_correction`` runs
for the same seeds; ``none`` (no correction) is the baseline measured in the same invocation:

* ``none``       -- ``enabled=false``
* ``token_tis``  -- token ratio truncated at 2 (TIS; the FP8 default)
* ``seq_mask``   -- the sequence's ratio, masked outside [0.5, 2] (sequence-level MIS)
* ``icepop``     -- token ratio, masked outside [0.5, 5] (IcePop)

Every run is a subprocess running the trainer (backend local); several run at once with
``--parallel`` (one GPU holds several 135M runs). One JSON line: per mode the held-out accuracy
at each eval step (mean over seeds and per seed), the last steps' train reward, the mismatch
(KL(rollout || train) k3, the share of tokens truncated or masked), and the final accuracy as a
ratio to ``none``'s.

    python benchmarks/bench_rollout_correction.py --device cuda --steps 20 --seeds 1,2,3 --parallel 4
    python benchmarks/bench_rollout_correction.py --device cpu --steps 2 --seeds 1 --eval-interval 1   # smoke
    python benchmarks/bench_rollout_correction.py --write-data .whl/corr_data --seeds 1,2,3   # for a GPU box
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml"
RC = "algorithm.rollout_correction."
MODES: dict[str, list[str]] = {
    "none": [RC + "enabled=false"],
    "token_tis": [RC + "enabled=true", RC + "level=token", RC + "mode=truncate", RC + "upper=2.0"],
    "seq_mask": [RC + "enabled=true", RC + "level=sequence", RC + "mode=mask", RC + "lower=0.5", RC + "upper=2.0"],
    "icepop": [RC + "enabled=true", RC + "level=token", RC + "mode=mask", RC + "lower=0.5", RC + "upper=5.0"],
}


def run_one(args: argparse.Namespace, model: str, fp8: Path, mode: str, seed: int) -> dict[str, Any]:
    """One training run; its per-step metrics from ``metrics.jsonl``."""
    out = args.work / f"{mode}_seed{seed}"
    gpu = args.device == "cuda"
    overrides = [f"model.hf_path={model}", f"rollout.model_path={fp8}", f"output_dir={out}", f"seed={seed}",
                 f"trainer.total_steps={args.steps}", f"trainer.eval_interval={args.eval_interval}",
                 "cluster.backend=local", "checkpoint.interval=0", "checkpoint.resume=none", "checkpoint.final=false",
                 "checkpoint.export_hf=false", "logging.progress_bar=false", f"cluster.device={args.device}",
                 f"cluster.gpus_per_node={1 if gpu else 0}", f"rollout.gpus={1 if gpu else 0}",
                 f"model.dtype={'bfloat16' if gpu else 'float32'}", *MODES[mode], *args.set]
    if gpu:
        overrides.append(f"rollout.mem_fraction={0.6 / max(1, args.parallel):.3f}")
    if args.data_dir is not None:   # the recipe's prompts written on a host with reasoning-gym (--write-data)
        folder = args.data_dir / f"seed{seed}"
        overrides += ["data.source=jsonl", f"data.path={folder / 'train.jsonl'}", f"data.eval_path={folder / 'eval.jsonl'}"]
    log = args.work / f"{mode}_seed{seed}.log"
    found = args.work / f"{mode}_seed{seed}.jsonl"
    t0 = time.time()
    with log.open("w") as f:
        done = subprocess.run([sys.executable, __file__, "--child", str(found), *overrides], cwd=ROOT,
                              stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode != 0:
        tail = log.read_text()[-2000:]
        raise SystemExit(f"{mode} seed {seed} failed (rc {done.returncode}), log {log}:\n{tail}")
    lines = [json.loads(x) for x in found.read_text().splitlines() if x.strip()]
    return {"lines": lines, "wall_s": time.time() - t0}


def child(found: Path, overrides: list[str]) -> None:
    """One run in this process: every line the trainer logs (steps and evals) into ``found``."""
    from megarl.config import load_config
    from megarl.metrics_log import MetricsLogger
    from megarl.trainer import Trainer

    lines: list[dict[str, Any]] = []
    log = MetricsLogger.log

    def recording(self: MetricsLogger, step: int, metrics: Any, console: bool = True) -> None:
        lines.append({"step": step, **metrics})
        log(self, step, metrics, console)

    MetricsLogger.log = recording   # type: ignore[method-assign]
    Trainer(load_config(RECIPE, overrides)).run()
    found.write_text("".join(json.dumps(x) + "\n" for x in lines))


def summarize(runs: dict[tuple[str, int], dict[str, Any]], modes: list[str], seeds: list[int]) -> dict[str, Any]:
    """Per mode: accuracy curve (mean over seeds), last-5-step reward, mismatch metrics."""
    out: dict[str, Any] = {}
    for mode in modes:
        curves, rewards, kl, bounded = [], [], [], []
        for seed in seeds:
            lines = runs[(mode, seed)]["lines"]
            curves.append({int(x["step"]): x["eval/accuracy"] for x in lines if "eval/accuracy" in x})
            steps = [x for x in lines if "reward/mean" in x]
            rewards.append(statistics.mean(x["reward/mean"] for x in steps[-5:]))
            kl += [x["actor/rollout_kl_k3"] for x in steps if "actor/rollout_kl_k3" in x]
            bounded += [x.get("actor/rollout_is_truncated_frac", x.get("actor/rollout_is_masked_frac", 0.0))
                        for x in steps]
        at = sorted(set.intersection(*(set(c) for c in curves)))
        out[mode] = {"eval_steps": at, "accuracy_mean": [round(statistics.mean(c[s] for c in curves), 4) for s in at],
                     "accuracy_per_seed": [[round(c[s], 4) for s in at] for c in curves],
                     "final_accuracy_mean": round(statistics.mean(c[at[-1]] for c in curves), 4),
                     "last5_reward_mean": round(statistics.mean(rewards), 4),
                     "rollout_kl_k3_mean": statistics.mean(kl) if kl else None,
                     "bounded_token_frac_mean": statistics.mean(bounded) if bounded else None}
    base = out.get("none", {}).get("final_accuracy_mean")
    for mode in modes:
        out[mode]["final_accuracy_vs_none"] = round(out[mode]["final_accuracy_mean"] / base, 3) if base else None
    return out


def write_data(folder: Path, seeds: list[int]) -> None:
    """The recipe's reasoning-gym train and held-out prompts for each seed as JSONL (prompt,
    answer), for machines without reasoning-gym (the rule reward needs only the answer)."""
    from megarl.config import load_config
    from megarl.data import load_split

    for seed in seeds:
        cfg = load_config(RECIPE, [f"seed={seed}"])
        out = folder / f"seed{seed}"
        out.mkdir(parents=True, exist_ok=True)
        for split, name in (("train", "train.jsonl"), ("eval", "eval.jsonl")):
            rows = [{"prompt": r.prompt, "answer": r.answer} for r in load_split(cfg.data, cfg.seed, split)]
            (out / name).write_text("".join(json.dumps(x) + "\n" for x in rows))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(ROOT))
        return child(Path(sys.argv[2]), sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct", help="HF folder or builtin:smollm2-135m-instruct")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-interval", type=int, default=5)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--parallel", type=int, default=1, help="runs at once")
    ap.add_argument("--work", type=Path, default=Path("/tmp/megarl_bench_correction"))
    ap.add_argument("--fp8", type=Path, default=None, help="where the FP8 copy goes (default: WORK/fp8_copy)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more recipe overrides")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="prompts written by --write-data (SEED/train.jsonl, eval.jsonl) instead of reasoning-gym")
    ap.add_argument("--write-data", type=Path, default=None, metavar="DIR",
                    help="write the recipe's prompts for --seeds to DIR and exit (on a host with reasoning-gym)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.write_data is not None:
        return write_data(args.write_data, [int(s) for s in args.seeds.split(",")])
    from megarl.checkpoint.fp8_convert import convert_hf_to_fp8
    from megarl.workers.model_source import resolve_hf_path

    args.work.mkdir(parents=True, exist_ok=True)
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; known: {list(MODES)}")
    model = str(resolve_hf_path(args.model))
    fp8 = args.fp8 or args.work / "fp8_copy"
    if not (fp8 / "config.json").is_file():
        convert_hf_to_fp8(model, str(fp8), "fp32", verbose=False)
    jobs = [(m, s) for s in seeds for m in modes]
    t0 = time.time()
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:   # each run's lines stay in WORK (a cut-off run keeps them)
        found = dict(zip(jobs, pool.map(lambda job: run_one(args, model, fp8, *job), jobs)))
    print(json.dumps({"bench": "rollout_correction_fp8", "device": args.device, "steps": args.steps,
                      "seeds": seeds, "wall_s": round(time.time() - t0, 1),
                      "modes": summarize(found, modes, seeds)}), flush=True)


if __name__ == "__main__":
    main()
