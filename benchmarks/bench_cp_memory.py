"""Activation memory of one long packed sequence: measured vs ``megarl plan``'s figure.

One JSON line: for one sequence of ``--tokens`` tokens through megarl's actor path (build_model:
local spec + megarl's attention, packed THD micro-batch built by workers/batch.py, vocab-parallel
logprobs + entropy, backward), at context-parallel size ``--cp``:

* ``saved_bytes``: bytes of the tensors autograd keeps for the backward (``saved_tensors_hooks``,
  unique storages, parameters excluded), per rank -- what the planner's ``activations + logits``
  model; measurable on CPU and GPU alike;
* ``cuda_peak_bytes`` (``--device cuda``): allocator peak during forward + backward minus what was
  allocated before it (parameters and their gradients, allocated by a warm-up step);
* ``plan_bytes``: ``plan_role(...).activations + .logits`` for the same shape, dtype, tokens, cp
  (recompute none, tp 1), and the ratios.

    python benchmarks/bench_cp_memory.py                                   # CPU: tiny shape, 2048 tokens
    python benchmarks/bench_cp_memory.py --cp 2                            # CPU: two gloo ranks splitting it
    python benchmarks/bench_cp_memory.py --device cuda --shape qwen3-8b --layers 4 --tokens 32768   # H200

``--layers`` cuts the model to its first layers (activations scale per layer; the planner is given
the same count), so a 32k sequence of an 8B shape fits one GPU in bf16 with its logits.
``--cp > 1`` runs on CPU (gloo ranks of one host).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import use_cuda  # noqa: E402

SHAPES = {
    # Qwen/Qwen3-8B config.json
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False),
}


def hf_config(shape: str, layers: int | None):
    from transformers import Qwen3Config

    kw = dict(SHAPES[shape])
    if layers:
        kw["num_hidden_layers"] = layers
    return Qwen3Config(max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, **kw)


def plan_bytes(cfg, tokens: int, cp: int, dtype: str) -> dict:
    """The planner's activations and logits for this shape, one sequence of ``tokens`` at ``cp``."""
    from megarl.config import load_config
    from megarl.planning.memory import plan_role

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    arch = {"num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "ffn_hidden_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": "false"}
    over = [f"model.arch.{k}={v}" for k, v in arch.items()] + [
        "model.hf_path=/nonexistent", f"model.dtype={dtype}", "model.recompute=none", f"actor.gpus={cp}",
        f"actor.parallel.cp={cp}", f"actor.max_tokens_per_micro_batch={-(-tokens // cp)}",
        "rollout.max_prompt_len=1", f"rollout.sampling.max_new_tokens={tokens - 1}", "actor.packing=true"]
    role = plan_role(load_config(os.path.join(root, "recipes", "smollm2-135m-grpo-cpu.yaml"), over), "actor")
    return {"activations": role.activations, "logits": role.logits, "total": role.activations + role.logits,
            "tokens_per_rank": -(-tokens // cp), "cp_kv_bytes_per_layer": role.cp_kv_bytes_per_layer}


def measure(rank: int, world: int, a) -> dict:
    """One rank: forward + backward of the sequence, saved-for-backward bytes and the CUDA peak."""
    from megarl.data.batch import TokenBatch
    from megarl.models import build_model
    from megarl.parallel import init_distributed, init_model_parallel
    from megarl.workers.batch import micro_inputs
    from megarl.workers.vocab_parallel import logprobs_and_entropy

    cuda = a.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if world == 1:
        from megarl.wire.addresses import free_port

        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(free_port())})
        init_distributed()
    init_model_parallel(cp=world, check=False)
    cfg = hf_config(a.shape, a.layers)
    model = build_model(cfg, params_dtype=dtype)[0].to(device)
    model.config.variable_seq_lengths = True
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (a.tokens,), generator=g)
    batch = TokenBatch.from_sequences([ids[:1].tolist()], [ids[1:].tolist()], {})
    mi = micro_inputs(batch, True, cp=world, cp_rank=rank).to(device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step(record: dict | None) -> None:
        def pack(t):
            if record is not None:
                s = t.untyped_storage()
                if s.data_ptr() not in params:
                    record[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(mi.input_ids, mi.position_ids, None, packed_seq_params=mi.packed)
            rows = out.reshape(-1, out.shape[-1])
            lp, ent = logprobs_and_entropy(rows, mi.next_ids, cfg.vocab_size, with_entropy=True)
            loss = mi.global_rows(lp)[mi.pred_index].sum() + mi.global_rows(ent)[mi.pred_index].mean()
        loss.backward()

    step(None)                     # warm-up: parameters' gradients now exist
    for p in model.parameters():
        p.grad.zero_()
    base = 0
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    saved: dict = {}
    step(saved)
    res = {"rank": rank, "saved_bytes": sum(saved.values()), "tokens_on_rank": int(mi.input_ids.numel())}
    if cuda:
        torch.cuda.synchronize()
        res["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="first N layers only (default: all)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the one sequence")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks (> 1: CPU gloo ranks)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    use_cuda(a.device)
    if a.device == "cuda" and a.cp > 1:
        raise SystemExit("--cp > 1 runs on CPU ranks only (one GPU here); the CP>1 GPU figures come from the planner")
    if a.device == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if a.cp > 1:
        from megarl.parallel import spawn

        ranks = spawn(measure, a.cp, a, timeout_s=1800)
    else:
        ranks = [measure(0, 1, a)]
    cfg = hf_config(a.shape, a.layers)
    plan = plan_bytes(cfg, a.tokens, a.cp, "bfloat16" if a.device == "cuda" else "float32")
    worst = max(ranks, key=lambda r: r["saved_bytes"])
    out = {"bench": "cp_memory", "device": a.device, "shape": a.shape, "layers": cfg.num_hidden_layers,
           "tokens": a.tokens, "cp": a.cp, "measured_saved_bytes": worst["saved_bytes"],
           "measured_saved_per_rank": [r["saved_bytes"] for r in ranks], "plan": plan,
           "saved_over_plan": round(worst["saved_bytes"] / plan["total"], 4)}
    if a.device == "cuda":
        out["measured_cuda_peak_bytes"] = worst["cuda_peak_bytes"]
        out["cuda_peak_over_plan"] = round(worst["cuda_peak_bytes"] / plan["total"], 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
