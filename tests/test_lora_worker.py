"""A LoRA actor as megarl runs it (MegatronWorker at PP2 over gloo ranks, megatron's DDP and
optimizer): the frozen base has no gradient buffer and no optimizer state, training moves the
adapters only, the reference pass (adapters off) is the base model bit for bit, the merged weights
a push sends equal ``peft``'s ``merge_and_unload`` of the exported adapter, and a checkpoint holds
the adapters and their optimizer state only and resumes them exactly."""
from __future__ import annotations

import torch

from megarl.parallel import spawn
from tests.dist_utils import make_tiny_hf
from tests.test_packing import ALGO, ROOT, _hf_logprobs, random_batch

RANK, ALPHA = 4, 16.0


def _cfg(hf_dir: str, world: int, parallel: dict | None = None):
    from megarl.config import load_config

    over = [f"model.hf_path={hf_dir}", "cluster.backend=ray", f"actor.gpus={world}",
            "actor.optim.lr=5e-2", "actor.optim.clip_grad=1.0", "trainer.total_steps=2", "batch.global_batch_size=8",
            f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}", "actor.max_tokens_per_micro_batch=40"]
    over += [f"actor.parallel.{k}={v}" for k, v in ({"pp": 2} if parallel is None else parallel).items()]
    over += [f"model.arch.{k}=0" for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                           "num_kv_heads", "vocab_size", "head_dim")]
    return load_config(ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml", over)


def _worker(cfg, rank, world):
    from megarl.workers import MegatronWorker, WorkerSpec

    worker = MegatronWorker(WorkerSpec(role="actor", cfg=cfg, rank=rank, world_size=world, master_addr="127.0.0.1",
                                       master_port=0, trainable=True, value_head=False))
    info = worker.setup()
    return worker, info


def _shard(worker, batch, fields=(), dens=None):
    from megatron.core import parallel_state as mpu

    from megarl.data.packing import plan_shards
    from megarl.workers.dispatch import make_shards
    from megarl.workers.group import token_budget

    plan = plan_shards(batch.seq_lens.tolist(), [list(range(len(batch)))], mpu.get_data_parallel_world_size(),
                       packed=True, max_tokens=token_budget(worker.cfg, "actor"), micro_batch_size=1)
    return make_shards(batch, plan, fields, dens)[mpu.get_data_parallel_rank()]


def _optimizer_state_numel(optimizer) -> int:
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(v.numel() for o in opts for st in o.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _lora_run(rank, world, hf_dir, batch, ckpt):
    from megarl.models.lora import is_adapter_param
    from megarl.parallel import destroy_model_parallel

    cfg = _cfg(hf_dir, world)
    worker, info = _worker(cfg, rank, world)
    named = {n: p for c in worker.chunks for n, p in c.named_parameters()}
    base = {n: p.detach().clone() for n, p in named.items() if not is_adapter_param(n)}
    out = {"trainable": info["trainable"],
           "adapter_numel": sum(p.numel() for n, p in named.items() if is_adapter_param(n)),
           "requires_grad": sorted(n for n, p in named.items() if p.requires_grad),
           "grad_buffer_numel": sum(b.numel_unpadded for c in worker.chunks for b in c.buffers)}
    out["before"] = worker.compute_logprobs(_shard(worker, batch))
    mask = batch.response_mask()
    dens = [{"num_tokens": float(mask.sum()), "num_seqs": float(len(batch))}]
    fields = ("old_logprobs", "advantages", "rollout_logprobs")
    for _ in range(2):
        out.setdefault("train", []).append(worker.train_batch(_shard(worker, batch, fields, dens), ALGO))
    out["optimizer_state_numel"] = _optimizer_state_numel(worker.optimizer)
    out["base_unchanged"] = all(torch.equal(p.detach(), base[n]) for n, p in named.items() if n in base)
    out["after"] = worker.compute_logprobs(_shard(worker, batch))
    out["ref"] = worker.compute_ref_logprobs(_shard(worker, batch))
    out["merged"] = worker.hf_state_dict()
    out["adapters"] = worker.adapter_tensors()
    adapters_now = {n: p.detach().clone() for n, p in named.items() if is_adapter_param(n)}
    opt_now = worker.optimizer.state_dict()
    worker.save_checkpoint(ckpt)
    destroy_model_parallel()
    # a fresh actor resumes the adapters and their optimizer state
    again, _ = _worker(cfg, rank, world)
    again.load_checkpoint(ckpt)
    named2 = {n: p for c in again.chunks for n, p in c.named_parameters()}
    out["resumed_adapters"] = all(torch.equal(named2[n].detach(), t) for n, t in adapters_now.items())
    st1, st2 = (sd.get("optimizer", sd)["state"] for sd in (opt_now, again.optimizer.state_dict()))
    out["resumed_optimizer"] = len(st1) > 0 and st1.keys() == st2.keys() and all(
        torch.equal(st1[k][f], st2[k][f]) for k in st1 for f in ("exp_avg", "exp_avg_sq"))
    destroy_model_parallel()
    return out


def test_lora_actor_trains_adapters_only_refs_the_base_merges_like_peft_and_resumes(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from megarl.models.lora import peft_config, spec_from_config

    hf_dir = tmp_path / "hf"
    make_tiny_hf("qwen2", hf_dir)   # tied embeddings: the frozen embedding is shared by both PP stages
    batch = random_batch(8, seed=5)
    res = spawn(_lora_run, 2, str(hf_dir), batch, str(tmp_path / "ckpt"), timeout_s=600)
    for r in res:
        assert r["requires_grad"] and all(".lora.adapters." in n for n in r["requires_grad"])
        assert r["trainable"] == r["adapter_numel"] > 0
        assert r["grad_buffer_numel"] == r["adapter_numel"], "DDP allocated gradient memory for the frozen base"
        assert r["optimizer_state_numel"] == 2 * r["adapter_numel"], "Adam state for more than the adapters"
        assert r["base_unchanged"]
    last = [r for r in res if r["before"] is not None][0]
    before, after, ref = (last[k]["token"]["logprobs"] for k in ("before", "after", "ref"))
    assert (before == ref).all(), "the reference (adapters off) is not the base model"
    assert abs(after - before).max() > 1e-3, "the adapters did not learn"
    # checkpoint: adapters and their optimizer state only, resumed exactly
    assert all(r["resumed_adapters"] and r["resumed_optimizer"] for r in res)
    saved = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    assert saved < sum(f.stat().st_size for f in hf_dir.glob("*.safetensors")), "the checkpoint holds the base"
    # merged weights (what a merged push sends) == peft's merge of the exported adapter
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    save_file({k: v for r in res for k, v in r["adapters"].items()}, str(adapter_dir / "adapter_model.safetensors"))
    import json
    (adapter_dir / "adapter_config.json").write_text(json.dumps(peft_config(spec_from_config(_cfg(str(hf_dir), 2).actor.lora))))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                           adapter_dir).eval()
    # the trained actor's logprobs == HF + peft with the exported adapter
    assert (_hf_logprobs(peft_model, batch) - torch.as_tensor(after)).abs().max() < 1e-4
    merged = peft_model.merge_and_unload().state_dict()
    ours = {k: v for r in res for k, v in r["merged"].items()}
    assert set(ours) == set(load_file(str(hf_dir / "model.safetensors")))
    for name, t in ours.items():
        torch.testing.assert_close(t, merged[name], rtol=1e-5, atol=1e-6, msg=name)



def _train_only(rank, world, hf_dir, batch, parallel):
    from megarl.models.lora import peft_state_dict
    from megarl.parallel import destroy_model_parallel

    # Adam's eps well above the smallest gradients: the update is then a continuous function of the
    # gradient, so summation-order noise stays noise (at eps 1e-8 a near-zero gradient's sign is the update)
    cfg = _cfg(hf_dir, world, parallel)
    cfg.actor.optim.adam_eps = 1e-3
    worker, _ = _worker(cfg, rank, world)
    mask = batch.response_mask()
    dens = [{"num_tokens": float(mask.sum()), "num_seqs": float(len(batch))}]
    metrics = [worker.train_batch(_shard(worker, batch, ("old_logprobs", "advantages", "rollout_logprobs"), dens), ALGO)
               for _ in range(2)]
    adapters = peft_state_dict(worker.chunks)
    destroy_model_parallel()
    return {"adapters": adapters, "grad_norm": [m.get("grad_norm") for m in metrics]}


def test_lora_training_at_tp2_equals_one_rank(tmp_path):
    """Two optimizer steps (grad-norm clipping on): TP2's adapters and grad norms equal one rank's
    (the TP reductions of the adapters, and each replicated adapter counted once in the norm)."""
    make_tiny_hf("qwen2", tmp_path)
    batch = random_batch(8, seed=6)
    one = spawn(_train_only, 1, str(tmp_path), batch, {})[0]
    two = spawn(_train_only, 2, str(tmp_path), batch, {"tp": 2})
    assert one["grad_norm"][0] > 0
    assert max(float(v.abs().max()) for k, v in one["adapters"].items() if "lora_B" in k) > 1e-3   # they trained
    for r in two:
        if r["grad_norm"][0] is not None:
            for a, b in zip(one["grad_norm"], r["grad_norm"]):
                assert abs(a - b) < 1e-5 * max(1.0, a), (one["grad_norm"], r["grad_norm"])
        assert r["adapters"].keys() == one["adapters"].keys()
        for k, v in one["adapters"].items():
            torch.testing.assert_close(r["adapters"][k], v, rtol=0, atol=2e-5, msg=k)
