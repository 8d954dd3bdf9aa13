"""LoRA GRPO vs full-parameter GRPO: peak GPU memory per phase, and adapter-only vs merged push size.

Runs the real trainer (backend ``local``: the Megatron actor in this process, the embedded rollout
engine as a child process on the same GPU, colocated) on a random-init model of ``--shape`` (the
tokenizer, hence the vocabulary, is SmolLM2's) with ``actor.lora.rank=--lora-rank`` (0 = full
parameter), for ``--steps`` GRPO steps with the KL loss (reference: with LoRA the actor's base,
otherwise a reference role). Every phase of every step records

* ``trainer_peak_gib``: ``torch.cuda.max_memory_allocated`` of this process (the Megatron roles)
  during the phase,
* ``device_used_gib``: the whole GPU's used memory at the phase's end (``cudaMemGetInfo``: trainer,
  engine, allocator caches),

and the line reports the per-phase maxima over steps, the trainable parameter count, the merged
push's bytes/seconds (the trainer's own ``sync/*`` metrics) and the adapter-only push's bytes and
sender-side seconds (gather the adapters in PEFT names + build the ``/load_lora_adapter_from_tensors``
body with per-TP-rank payloads and sha256 checksums). With ``--push adapter`` the run itself pushes
adapters only (``actor.lora.push=adapter``: the embedded engine loads each version), so the
``sync/*`` metrics then time the whole adapter push, server side included. An out-of-memory error is reported as ``"oom"`` with the phase it
hit, which is the expected full-parameter result for the 7B shape on one H200.

    python benchmarks/bench_lora.py --shape qwen2.5-7b --tokenizer .whl/smollm2_tok --lora-rank 64
    python benchmarks/bench_lora.py --shape qwen2.5-7b --tokenizer .whl/smollm2_tok --lora-rank 0
    python benchmarks/bench_lora.py --shape qwen2.5-7b --tokenizer .whl/smollm2_tok --lora-rank 64 --push adapter
    python benchmarks/bench_lora.py --shape tiny --tokenizer DIR --device cpu --steps 2     # CPU smoke
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GIB = 1024 ** 3


def _instrument(memory: dict, current: list) -> None:
    """Wrap the trainer's phase timer so each phase also records GPU memory (benchmark only)."""
    import torch

    from megarl import metrics_log

    original = metrics_log.PhaseTimer.__call__

    @contextlib.contextmanager
    def timed(self, phase):
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        current[0] = phase
        with original(self, phase):
            yield
        if cuda:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            m = memory.setdefault(phase, {"trainer_peak_gib": 0.0, "device_used_gib": 0.0})
            m["trainer_peak_gib"] = round(max(m["trainer_peak_gib"], torch.cuda.max_memory_allocated() / GIB), 2)
            m["device_used_gib"] = round(max(m["device_used_gib"], (total - free) / GIB), 2)

    metrics_log.PhaseTimer.__call__ = timed


def adapter_push(trainer, tp_size: int = 1) -> dict:
    """Sender side of an adapter-only push of the trained actor: bytes and seconds."""
    import torch
    import torch.multiprocessing as tmp

    from megarl.models.lora import gather_peft_tensors, peft_config, spec_from_config
    from megarl.sync.adapter import adapter_bytes, adapter_name, load_from_tensors_request

    tmp.set_sharing_strategy("file_system")
    t0 = time.perf_counter()
    tensors = gather_peft_tensors(trainer.groups["actor"])
    body = load_from_tensors_request(adapter_name("bench"), peft_config(spec_from_config(trainer.cfg.actor.lora)),
                                     tensors, tp_size)
    seconds = time.perf_counter() - t0
    return {"adapter_bytes": adapter_bytes(tensors), "adapter_bytes_bf16": adapter_bytes(tensors, torch.bfloat16),
            "adapter_tensors": len(tensors), "sender_s": round(seconds, 3),
            "body_bytes": sum(len(p) for p in body["serialized_named_tensors"])}


def main() -> None:
    from bench_e2e import RECIPE, SHAPES, overrides_for

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", type=Path, required=True, help="SmolLM2 tokenizer files + config.json")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--push", default="merged", choices=["merged", "adapter"], help="actor.lora.push of the run")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/megarl_bench_lora"))
    args = ap.parse_args()
    args.model = None
    args.recipe_defaults = args.recipe_data = False
    args.max_running = 0

    from megarl.config import load_config
    from megarl.trainer import Trainer

    over = overrides_for(args) + [
        f"actor.lora.rank={args.lora_rank}", f"actor.lora.alpha={2 * max(args.lora_rank, 1)}",
        f"actor.lora.push={args.push if args.lora_rank else 'merged'}",
        "ref.enabled=true", "algorithm.kl.mode=loss", "algorithm.kl.coef=0.001", "model.recompute=full",
        "actor.max_tokens_per_micro_batch=8192", f"actor.optim.lr={1e-5 if args.lora_rank else 1e-6}",
        "rollout.mem_fraction=0.35", "sync.bucket_mb=1024", "rollout.logprob_diff_bound=1.0"]
    cfg = load_config(RECIPE, over)
    memory: dict = {}
    current = ["setup"]
    _instrument(memory, current)
    out: dict = {"bench": "lora_grpo_memory", "shape": args.shape, "lora_rank": args.lora_rank, "device": args.device,
                 "steps": args.steps, "samples_per_step": args.prompts * args.n}
    trainer = None
    t0 = time.time()
    try:
        trainer = Trainer(cfg)
        trainer.setup()
        out["trainable_params"] = trainer.groups["actor"].call(
            "probe", lambda w: sum(p.numel() for c in w.chunks for p in c.parameters() if p.requires_grad))[0]
        out["roles"] = sorted(type(g).__name__ + ":" + name for name, g in trainer.groups.items())
        steps = []
        for step in range(args.steps):
            steps.append(trainer.step(step))
        out["result"] = "ok"
        later = steps[1:] or steps
        out[f"{cfg.actor.lora.push}_push"] = {"bytes": later[-1]["sync/bytes"],
                              "seconds": round(sum(s["sync/seconds"] for s in later) / len(later), 3)}
        out["step_s"] = round(sum(s["time/step_s"] for s in later) / len(later), 2)
        out["reward_curve"] = [round(s["reward/mean"], 3) for s in steps]
        if args.lora_rank and args.push == "merged":
            out["adapter_push"] = adapter_push(trainer, cfg.rollout.tp)
            out["push_bytes_ratio_merged_over_adapter"] = round(out["merged_push"]["bytes"] /
                                                                out["adapter_push"]["adapter_bytes"], 1)
    except Exception as e:  # noqa: BLE001  (a benchmark line either way)
        oom = "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError"
        out["result"] = "oom" if oom else f"error: {type(e).__name__}: {str(e)[:300]}"
        out["failed_phase"] = current[0]
    finally:
        out["phase_memory"] = memory
        out["wall_s"] = round(time.time() - t0, 1)
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
