"""End-to-end GRPO steps of the default recipe's loop: per-phase time, in-loop rollout tokens/s.

Full mode runs the real trainer (backend ``local``: Megatron actor in-process, embedded rollout
server as a child process, weights pushed every step) and prints one JSON line with the phase
times of the steps after the first (which pays graph capture and compilation).

``--rollout-only`` runs just the trainer's rollout phase (`RolloutPipeline.collect`: the same prompts,
chat template, per-sample seeds, sampling and reward as in the loop) against two servers started
with the trainer's own flags, alternating between them step by step so both see the same load:
  * "after": this checkout's server and the batched manager;
  * "before": one request per sample (``tests/helpers/per_sample.py``) to a server without
    prefix sharing (``--disable-radix-cache``), or, with ``--baseline-code DIR``, to the server of
    another checkout (e.g. ``git worktree add /tmp/main main``: the code before batched group requests).
Both modes draw the same prompts with the same seeds; the line says whether their tokens agreed.
Reported per mode: median/min wall seconds of the rollout phase, generated tokens/s, and the
server's own CPU seconds (on a shared CPU box the wall time is inflated by other jobs; CPU seconds
are not), plus the after/before ratios.

Model: ``--model DIR|builtin:smollm2-135m-instruct`` (real weights) or ``--shape`` (random init,
with ``--tokenizer``). Data: arithmetic prompts from a JSONL file, or ``--recipe-data`` for the
recipe's own (reasoning-gym). ``--recipe-defaults`` keeps the recipe's batch, sampling and server
sizes (the CPU recipe's rollout phase as `megarl train` runs it).

    python benchmarks/bench_e2e.py --rollout-only --recipe-defaults --recipe-data --device cpu
    python benchmarks/bench_e2e.py --rollout-only --model builtin:smollm2-135m-instruct --device cuda \\
        --prompts 64 --n 8 --new-tokens 128 --steps 4
    python benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer DIR --steps 6 --device cuda
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # Qwen/Qwen2.5-7B config.json (its own vocabulary; SmolLM2's tokenizer covers the first 49152 ids)
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, rope_theta=1000000.0),
}
RECIPE = ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml"


def make_model(out: Path, shape: str, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (out / "config.json").is_file():
        return out
    base = json.loads((tokenizer_dir / "config.json").read_text())
    shape_cfg = {"vocab_size": base["vocab_size"], "tie_word_embeddings": True, **SHAPES[shape]}
    cfg = LlamaConfig(max_position_embeddings=4096, bos_token_id=base.get("bos_token_id"),
                      eos_token_id=base.get("eos_token_id"), **shape_cfg)
    torch.manual_seed(0)
    # initialised on the GPU when there is one (a 7B random init takes minutes on CPU cores)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    for f in tokenizer_dir.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


def write_prompts(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"Calculate {a} + {b}.", "answer": str(a + b)}) + "\n")
    return path


def overrides_for(args: argparse.Namespace) -> list[str]:
    """Recipe overrides: the model, device, data and sizes of this benchmark run."""
    args.work.mkdir(parents=True, exist_ok=True)
    gpu = args.device == "cuda"
    recipe_model = args.model is None and args.tokenizer is None and args.recipe_defaults
    if recipe_model:
        model, tag = None, "recipe"
    elif args.model:
        model = args.model
        tag = Path(model).name if not model.startswith("builtin:") else model.split(":", 1)[1]
    else:
        if args.tokenizer is None:
            raise SystemExit("--shape needs --tokenizer (a folder with SmolLM2's tokenizer files + config.json)")
        model, tag = str(make_model(args.work / f"model_{args.shape}", args.shape, args.tokenizer)), args.shape
    out = [] if model is None else [f"model.hf_path={model}"]
    out += [f"output_dir={args.work / ('run_' + tag)}", "checkpoint.resume=none",
           f"model.dtype={'bfloat16' if gpu else 'float32'}", f"cluster.device={args.device}",
           f"cluster.gpus_per_node={1 if gpu else 0}", "cluster.backend=local", f"rollout.gpus={1 if gpu else 0}",
           f"trainer.total_steps={args.steps}", "checkpoint.interval=0", "checkpoint.export_hf=false",
           "trainer.eval_before_after=false", "logging.progress_bar=false"]
    if not args.recipe_data:
        data = write_prompts(args.work / "train.jsonl", 4096, 1)
        out += ["data.source=jsonl", f"data.path={data}", "reward.kind=function",
                "reward.function=tests.helpers.rewards:distinct_token_reward"]
    if not args.recipe_defaults:
        out += [f"batch.prompts_per_step={args.prompts}", f"rollout.n_per_prompt={args.n}",
                f"batch.global_batch_size={max(1, args.prompts * args.n // 4)}",
                f"rollout.sampling.max_new_tokens={args.new_tokens}",
                f"rollout.max_running_requests={args.max_running or args.prompts * args.n}",
                "actor.max_tokens_per_micro_batch=16384", "actor.optim.lr=1e-6"]  # step-0 bound: calibrated
    out += list(getattr(args, "set", []))   # bench_lora reuses this with its own arguments
    if not args.model and not recipe_model:   # a random shape: the architecture comes from the HF config
        out += [f"model.arch.{k}=0" for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                              "num_kv_heads", "vocab_size")] + ["model.arch.tie_word_embeddings=false"]
    return out


# ---------------------------------------------------------------------------------------------
# rollout only
# ---------------------------------------------------------------------------------------------

class _Server:
    """One embedded server with the trainer's flags, importing megarl from ``code`` (``-P``: the
    working directory is not put first on sys.path)."""

    def __init__(self, cfg: Any, model_dir: Path, code: Path, extra: list[str], log: Path, index: int):
        from megarl.wire.addresses import free_port
        from megarl.rollout.launch import LaunchSpec, ServerHost, embedded_args

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        weights = log.parent / f"weights_{index}"
        cmd = [sys.executable, "-P", "-m", "megarl.engine"] + embedded_args(
            cfg, model_dir, LaunchSpec(index, "127.0.0.1", self.port), weights) + extra
        env = dict(os.environ, PYTHONPATH=str(code), HF_HUB_OFFLINE="1")
        env.pop("MEGARL_API_KEY", None)
        self.host = ServerHost()
        self.host.start(cmd, env, str(log))

    def wait(self, timeout_s: float = 600.0) -> None:
        self.host.wait_healthy(self.url, timeout_s)

    def cpu_s(self) -> Optional[float]:
        """The server's CPU seconds so far (its own stat, or /proc for an older server)."""
        try:
            with urllib.request.urlopen(self.url + "/get_model_info", timeout=30) as r:
                cpu = json.loads(r.read()).get("megarl_stats", {}).get("cpu_s")
            if cpu is not None:
                return float(cpu)
        except OSError:
            pass
        try:
            import psutil

            t = psutil.Process(self.host.proc.pid).cpu_times()
            return t.user + t.system
        except Exception:  # noqa: BLE001
            return None


class _UrlsOnly:
    """Servers this benchmark started itself, as the trainer's pipeline sees them."""

    def __init__(self, urls: list[str]):
        self.urls, self.api_key, self.restartable = urls, None, False


def rollout_only(args: argparse.Namespace, cfg: Any) -> dict:
    from megarl.rollout.manager import RolloutManager
    from megarl.trainer import Trainer
    from tests.helpers.per_sample import PerSampleManager

    trainer = Trainer(cfg)
    trainer.setup_data()
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    r = cfg.rollout
    base_code = args.baseline_code or ROOT
    servers = {"after": _Server(cfg, trainer.model_dir, ROOT, [], logs / "server_after.log", 0),
               "before": _Server(cfg, trainer.model_dir, base_code, [] if args.baseline_code else ["--disable-radix-cache"],
                                 logs / "server_before.log", 1)}
    for s in servers.values():
        s.wait()
    managers = {k: (PerSampleManager if k == "before" else RolloutManager)(
        [s.url], max_concurrency=r.max_running_requests, timeout_s=r.request_timeout_s) for k, s in servers.items()}
    modes = ("before", "after")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    agree = True

    trainer.setup_rollout(_UrlsOnly([servers["after"].url]))   # the trainer's pipeline; managers swapped per mode
    trainer.rollout.manager.close()
    try:
        for rep in range(args.steps + 1):                  # rep 0: warm-up (graph capture), not timed
            state = trainer.loader.state_dict()
            outs = {}
            for mode in (modes if rep % 2 else modes[::-1]):
                trainer.loader.load_state_dict(state)
                trainer.rollout.manager = managers[mode]
                cpu0 = servers[mode].cpu_s()
                t0 = time.perf_counter()
                samples, _ = trainer.rollout.collect(trainer.loader, rep)
                wall = time.perf_counter() - t0
                cpu1 = servers[mode].cpu_s()
                tokens = sum(len(s.response_ids) for s in samples)
                outs[mode] = [s.response_ids for s in samples]
                if rep:
                    runs[mode].append({"wall_s": wall, "tokens": tokens, "samples": len(samples),
                                       "server_cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
                                       "requests": managers[mode].requests})
                print(json.dumps({"rep": rep, "mode": mode, "wall_s": round(wall, 3), "tokens": tokens,
                                  "server_cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 2)}),
                      file=sys.stderr, flush=True)
            agree = agree and outs["before"] == outs["after"]
    finally:
        for m in managers.values():
            m.close()
        for s in servers.values():
            s.host.stop()

    def summary(rs: list[dict]) -> dict:
        walls = [x["wall_s"] for x in rs]
        cpus = [x["server_cpu_s"] for x in rs if x["server_cpu_s"] is not None]
        toks = statistics.median(x["tokens"] for x in rs)
        return {"rollout_s_median": round(statistics.median(walls), 3), "rollout_s_min": round(min(walls), 3),
                "tokens_per_step": toks, "tokens_per_s": round(toks / statistics.median(walls), 1),
                "tokens_per_s_best": round(max(x["tokens"] / x["wall_s"] for x in rs), 1),
                "server_cpu_s_median": round(statistics.median(cpus), 2) if cpus else None,
                "samples_per_step": rs[0]["samples"]}
    before, after = summary(runs["before"]), summary(runs["after"])
    return {"bench": "e2e_rollout_only", "model": str(cfg.model.hf_path), "device": args.device,
            "samples_per_step": after["samples_per_step"], "n_per_prompt": r.n_per_prompt,
            "max_new_tokens": r.sampling.max_new_tokens, "max_running_requests": r.max_running_requests,
            "steps_timed": args.steps, "baseline": str(args.baseline_code) if args.baseline_code else
            "per-sample requests, --disable-radix-cache", "before": before, "after": after,
            "speedup_wall_median": round(before["rollout_s_median"] / after["rollout_s_median"], 2),
            "speedup_server_cpu": (round(before["server_cpu_s_median"] / after["server_cpu_s_median"], 2)
                                   if before["server_cpu_s_median"] and after["server_cpu_s_median"] else None),
            "same_tokens_before_after": agree}


# ---------------------------------------------------------------------------------------------
# the whole loop
# ---------------------------------------------------------------------------------------------

def full(args: argparse.Namespace, cfg: Any, overrides: list[str]) -> dict:
    from megarl.config import load_config
    from megarl.checkpoint.manager import latest_checkpoint
    from megarl.trainer import Trainer

    class EngineTimed(Trainer):
        """Reads the embedded servers' own time counters after every step (megarl_stats)."""

        def _step_or_checkpoint(self, step: int) -> dict[str, float]:
            metrics = super()._step_or_checkpoint(step)
            self.engine_stats.append(_engine_seconds(self.rollout.manager))
            return metrics

    t0 = time.time()
    trainer = EngineTimed(cfg)
    trainer.engine_stats = []
    device_peak = _DevicePeak(args.device == "cuda")
    with device_peak:
        results = trainer.run()
    steps = results["steps"][1:] or results["steps"]  # step 1 includes CUDA-graph capture and warm-up
    mean = lambda k: sum(s[k] for s in steps) / len(steps)  # noqa: E731
    phases = {k[len("time/"):-2]: round(mean(k), 3) for k in steps[0] if k.startswith("time/")}
    checked = [s for s in steps if "rollout/logprob_diff_mean" in s] or results["steps"][:1]
    out = {"bench": "e2e_grpo", "model": str(cfg.model.hf_path), "device": args.device,
           "samples_per_step": cfg.batch.prompts_per_step * cfg.rollout.n_per_prompt,
           "max_new_tokens": cfg.rollout.sampling.max_new_tokens, "steps_timed": len(steps), "phase_s": phases,
           "response_tokens_per_step": mean("batch/response_tokens"),
           "rollout_tokens_per_s": round(mean("throughput/rollout_tokens_per_s"), 1),
           "train_tokens_per_s": round(mean("throughput/train_tokens_per_s"), 1),
           "step_tokens_per_s": round(mean("batch/response_tokens") / mean("time/step_s"), 1),
           "ratio_step_vs_rollout_only": round(mean("time/rollout_s") / mean("time/step_s"), 3),
           # (algorithm.old_logprobs=rollout: only step 1 compares rollout and trainer logprobs)
           "logprob_diff_mean": sum(s["rollout/logprob_diff_mean"] for s in checked) / len(checked),
           "logprob_diff_max": max(s["rollout/logprob_diff_max"] for s in checked),
           "sync_s": round(mean("sync/seconds"), 3), "sync_GBps": round(mean("sync/bytes_per_s") / 1e9, 2),
           "reward_curve": [round(s["reward/mean"], 3) for s in results["steps"]],
           "wall_s": round(time.time() - t0, 1)}
    seen = trainer.engine_stats
    if len(seen) >= 2 and all(seen):
        # inside the engine per timed step (summed over servers): the rest of the rollout phase is
        # HTTP, the client, prompt building and scoring
        timed = len(seen) - 1
        out["engine_s_per_step"] = {k: round((seen[-1][k] - seen[0][k]) / timed, 3) for k in seen[0]}
    memory = {k[len("memory/"):]: round(max(s.get(k, 0.0) for s in results["steps"]), 3)
              for k in sorted({k for s in results["steps"] for k in s if k.startswith("memory/")})}
    if memory or device_peak.peak:
        out["memory"] = memory    # per-phase allocator peaks (GiB) of the trainer, offload/onload bytes and s
        out["device_used_GiB_max"] = round(device_peak.peak / 2 ** 30, 2)   # the whole GPU: trainer + engine
        out["actor_losses"] = [round(s["actor/pg_loss"], 6) for s in results["steps"]]
        out["actor_grad_norms"] = [round(s["actor/grad_norm"], 6) for s in results["steps"]]
    # the end-of-run checkpoint (model + optimizer state); --resume-check loads it in a new trainer
    # and runs one more step from it
    ckpt = latest_checkpoint(trainer.ckpt_dir)
    out["checkpoint"] = None if ckpt is None else {"path": str(ckpt), "bytes": sum(
        f.stat().st_size for f in ckpt.rglob("*") if f.is_file())}
    if args.resume_check:
        more = load_config(RECIPE, overrides + ["checkpoint.resume=auto", f"trainer.total_steps={args.steps + 1}"])
        resumed = Trainer(more).run()["steps"]
        out["resume_check"] = {"steps_run_after_resume": len(resumed),  # 1 = it went on from step `steps`
                               "reward": [round(s["reward/mean"], 3) for s in resumed]}
    return out


def _engine_seconds(manager: Any) -> dict[str, float]:
    """The embedded servers' admit/decode seconds, admission count and decode graph captures so
    far, summed ({} for servers without them)."""
    total = {"admit": 0.0, "decode": 0.0, "admissions": 0.0, "graph_captures": 0.0}
    for info in manager.call_all("get_model_info").values():
        stats = info.get("megarl_stats") if isinstance(info, dict) else None
        if not stats or "admit_s" not in stats:
            return {}
        total["admit"] += stats["admit_s"]
        total["decode"] += stats["decode_s"]
        total["admissions"] += stats.get("admissions", 0)
        total["graph_captures"] += stats.get("graph_captures", 0)
    return total


class _DevicePeak:
    """The GPU's used memory (every process: trainer and engine), polled at 20 Hz in a thread."""

    def __init__(self, cuda: bool):
        self.cuda, self.peak, self._stop = cuda, 0, None

    def __enter__(self) -> "_DevicePeak":
        if self.cuda:
            import threading

            import torch

            self._stop = threading.Event()

            def poll() -> None:
                while not self._stop.wait(0.05):
                    free, total = torch.cuda.mem_get_info()
                    self.peak = max(self.peak, total - free)
            self._thread = threading.Thread(target=poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stop is not None:
            self._stop.set()
            self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="real weights: an HF folder or builtin:smollm2-135m-instruct")
    ap.add_argument("--tokenizer", type=Path, default=None, help="with --shape: SmolLM2 tokenizer files + config.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/megarl_bench_e2e"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=0, help="rollout.max_running_requests (0: every sample)")
    ap.add_argument("--recipe-defaults", action="store_true", help="keep the recipe's batch/sampling/server sizes")
    ap.add_argument("--recipe-data", action="store_true", help="keep the recipe's data and reward")
    ap.add_argument("--rollout-only", action="store_true", help="only the rollout phase, before vs after")
    ap.add_argument("--baseline-code", type=Path, default=None,
                    help="--rollout-only: the 'before' server runs this checkout's megarl (e.g. main)")
    ap.add_argument("--resume-check", action="store_true", help="afterwards resume from the final checkpoint for one step")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more recipe overrides, e.g. --set actor.offload.params=true (repeatable)")
    args = ap.parse_args()

    from megarl.config import load_config

    overrides = overrides_for(args)
    cfg = load_config(RECIPE, overrides)
    out = rollout_only(args, cfg) if args.rollout_only else full(args, cfg, overrides)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
