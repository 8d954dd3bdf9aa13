"""End-to-end GRPO steps of the default recipe's loop at a GPU size: per-phase time and reward.

Runs the real trainer (backend ``local``: Megatron actor in-process, embedded rollout server as a
child process on the same GPU, weights pushed by CUDA IPC handles) on a random-init model of a
given shape with SmolLM2's tokenizer, on arithmetic prompts written to a JSONL file. Random
weights never answer correctly, so the reward is a non-constant text statistic
(``tests.helpers.rewards:distinct_token_reward``) that keeps gradients flowing: the point here is
the time of each phase, not learning. Prints one JSON line; the ratio is train tokens/s of the
whole step against the rollout phase alone.

    python benchmarks/bench_e2e.py --shape smollm2-135m --tokenizer DIR --steps 6 --device cuda
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}


def make_model(out: Path, shape: str, tokenizer_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (out / "config.json").is_file():
        return out
    base = json.loads((tokenizer_dir / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=base["vocab_size"], max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"), **SHAPES[shape])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with SmolLM2 tokenizer files + config.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/megarl_bench_e2e"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--resume-check", action="store_true", help="afterwards resume from the final checkpoint for one step")
    args = ap.parse_args()

    from megarl.config import load_config
    from megarl.trainer import Trainer

    args.work.mkdir(parents=True, exist_ok=True)
    model = make_model(args.work / f"model_{args.shape}", args.shape, args.tokenizer)
    data = write_prompts(args.work / "train.jsonl", 4096, 1)
    gpu = args.device == "cuda"
    overrides = [
        f"model.hf_path={model}", f"output_dir={args.work / ('run_' + args.shape)}", "checkpoint.resume=none",
        f"model.dtype={'bfloat16' if gpu else 'float32'}", f"cluster.device={args.device}",
        f"cluster.gpus_per_node={1 if gpu else 0}", "cluster.backend=local", f"rollout.gpus={1 if gpu else 0}",
        "data.source=jsonl", f"data.path={data}", "reward.kind=function",
        "reward.function=tests.helpers.rewards:distinct_token_reward", f"trainer.total_steps={args.steps}",
        f"batch.prompts_per_step={args.prompts}", f"rollout.n_per_prompt={args.n}",
        f"batch.global_batch_size={args.prompts * args.n // 4}", f"rollout.sampling.max_new_tokens={args.new_tokens}",
        "rollout.max_running_requests=256", "actor.max_tokens_per_micro_batch=16384", "checkpoint.interval=0",
        "checkpoint.export_hf=false", "trainer.eval_before_after=false", "logging.progress_bar=false",
        "actor.optim.lr=1e-6",  # step-0 bound: calibrated from the dtypes (megarl/algos/fidelity.py)
    ] + [f"model.arch.{k}=0" for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                       "num_kv_heads", "vocab_size")] + ["model.arch.tie_word_embeddings=false"]
    cfg = load_config(ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml", overrides)
    t0 = time.time()
    trainer = Trainer(cfg)
    results = trainer.run()
    steps = results["steps"][1:] or results["steps"]  # step 1 includes CUDA-graph capture and warm-up
    mean = lambda k: sum(s[k] for s in steps) / len(steps)  # noqa: E731
    phases = {k[len("time/"):-2]: round(mean(k), 3) for k in steps[0] if k.startswith("time/")}
    out = {"bench": "e2e_grpo", "shape": args.shape, "device": args.device, "samples_per_step": args.prompts * args.n,
           "max_new_tokens": args.new_tokens, "steps_timed": len(steps), "phase_s": phases,
           "response_tokens_per_step": mean("batch/response_tokens"),
           "rollout_tokens_per_s": round(mean("throughput/rollout_tokens_per_s"), 1),
           "train_tokens_per_s": round(mean("throughput/train_tokens_per_s"), 1),
           "step_tokens_per_s": round(mean("batch/response_tokens") / mean("time/step_s"), 1),
           "ratio_step_vs_rollout_only": round(mean("time/rollout_s") / mean("time/step_s"), 3),
           "logprob_diff_mean": mean("rollout/logprob_diff_mean"), "logprob_diff_max": max(s["rollout/logprob_diff_max"] for s in steps),
           "sync_s": round(mean("sync/seconds"), 3), "sync_GBps": round(mean("sync/bytes_per_s") / 1e9, 2),
           "reward_curve": [round(s["reward/mean"], 3) for s in results["steps"]],
           "wall_s": round(time.time() - t0, 1)}
    # the end-of-run checkpoint (model + optimizer state); --resume-check loads it in a new trainer
    # and runs one more step from it
    from megarl.trainer import latest_checkpoint
    ckpt = latest_checkpoint(trainer.ckpt_dir)
    out["checkpoint"] = None if ckpt is None else {"path": str(ckpt), "bytes": sum(
        f.stat().st_size for f in ckpt.rglob("*") if f.is_file())}
    if args.resume_check:
        more = load_config(ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml",
                           overrides + ["checkpoint.resume=auto", f"trainer.total_steps={args.steps + 1}"])
        resumed = Trainer(more).run()["steps"]
        out["resume_check"] = {"steps_run_after_resume": len(resumed),  # 1 = it went on from step `steps`
                               "reward": [round(s["reward/mean"], 3) for s in resumed]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
