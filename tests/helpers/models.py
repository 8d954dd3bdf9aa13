"""Small real-tokenizer models for tests and CPU smoke runs.

A random tiny Llama with SmolLM2's tokenizer and chat template: the whole RL loop (chat
templates, reasoning-gym prompts, decoding, rewards) runs exactly as with the real model, at a
fraction of the cost.
"""
from __future__ import annotations

import shutil
from pathlib import Path


def make_tiny_chat_model(path: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                         seed: int = 0, tie: bool = True, family: str = "llama") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    from megarl.checkpoint.smollm2 import smollm2_hf_dir

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    src = Path(smollm2_hf_dir())
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[family]
    import json

    base = json.loads((src / "config.json").read_text())
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, norm_topk_prob=True,
               head_dim=hidden // heads) if family == "qwen3_moe" else {}
    cfg = config_cls(vocab_size=base["vocab_size"], hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                     max_position_embeddings=1024, tie_word_embeddings=tie, bos_token_id=base.get("bos_token_id"),
                     eos_token_id=base.get("eos_token_id"), rope_theta=10000.0, **moe)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def make_distill_pair(root: str | Path) -> tuple[Path, Path]:
    """(teacher, student) for on-policy distillation tests: a tiny chat model whose output is far
    from uniform (projections ~ N(0, 0.05), final norm 6: logits of std ~3 over SmolLM2's 49152
    tokens), and the same model with Gaussian noise of half each weight matrix's std added (reverse
    KL ~2 nats per sampled token). Both carry SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    root = Path(root)
    teacher, student = root / "teacher", root / "student"
    if (teacher / "config.json").is_file() and (student / "config.json").is_file():
        return teacher, student
    base = make_tiny_chat_model(root / "base")
    for out, seed, noise in ((teacher, 1, None), (student, 7, 0.5)):
        model = AutoModelForCausalLM.from_pretrained(base if noise is None else teacher)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() != 2:
                    continue
                if noise is None:
                    p.normal_(0, 0.05, generator=gen)
                else:
                    p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
            if noise is None:
                model.model.norm.weight.fill_(6.0)
        model.save_pretrained(out)
        for f in base.iterdir():
            if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
                shutil.copy(f, out / f.name)
    return teacher, student
