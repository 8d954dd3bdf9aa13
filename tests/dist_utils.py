"""Helpers for megarl model / checkpoint tests: tiny random HF models of each family.

Other engineers may import these: ``tiny_hf_config(family)``, ``make_tiny_hf(family, dir)``.
"""
from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 160  # not a multiple of 64; divisible by 2 (TP2)


def tiny_hf_config(family: str, **kw):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if family == "llama":
        from transformers import LlamaConfig
        c = dict(common, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32})
        c.update(kw)
        return LlamaConfig(**c)
    if family == "qwen2":
        from transformers import Qwen2Config
        c = dict(common, intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        c.update(kw)
        return Qwen2Config(**c)
    if family == "qwen3":
        from transformers import Qwen3Config
        c = dict(common, intermediate_size=96, num_key_value_heads=2, head_dim=24,
                 tie_word_embeddings=False)
        c.update(kw)
        return Qwen3Config(**c)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        c = dict(common, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
                 head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
        c.update(kw)
        return Qwen3MoeConfig(**c)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        c = dict(common, intermediate_size=96, moe_intermediate_size=32,
                 num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                 num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                 routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                 rope_interleave=True, tie_word_embeddings=False, num_nextn_predict_layers=0)
        c.update(kw)
        return DeepseekV3Config(**c)
    raise ValueError(family)


def randomize_(model, seed: int = 0, std: float = 0.08):
    """Give every parameter and float buffer (biases, norms, router bias) non-trivial values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + [
                (n, b) for n, b in model.named_buffers() if "e_score_correction_bias" in n]:
            r = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            if "norm" in n:
                r = r + 1.0
            p.copy_(r.to(p.dtype))
    return model


def make_tiny_hf(family: str, out_dir, seed: int = 0, **kw):
    """Save a tiny random fp32 HF model of ``family`` to ``out_dir``; returns the model (eval)."""
    from transformers import AutoModelForCausalLM
    cfg = tiny_hf_config(family, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    model.eval()
    model.save_pretrained(str(out_dir))
    return model


def hf_logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits.float()


def sample_ids(b=2, s=12, seed=1, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s), generator=g)
