"""`megarl plan` with LoRA: the adapter count per GPU equals what megarl's modules really hold
(built at TP2 and PP2), the frozen base carries no gradients or optimizer state, no reference role
is planned, and the 7B recipe fits one H200 with LoRA but not full-parameter."""
from __future__ import annotations

from megarl.config import load_config
from megarl.parallel import spawn
from megarl.planning.lora import adapter_params
from megarl.planning.memory import make_plan
from megarl.planning.params import stage_layers
from tests.dist_utils import make_tiny_hf
from tests.helpers.runs import ROOT

RECIPE_7B = str(ROOT / "recipes" / "qwen2.5-7b-lora-grpo.yaml")
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def _count(rank, world, hf_dir, layout):
    from megarl.models import build_model, load_hf_weights
    from megarl.models.lora import LoRASpec, apply_lora
    from megarl.parallel import init_model_parallel

    init_model_parallel(**layout)
    chunks = build_model(hf_dir)
    load_hf_weights(chunks, hf_dir)
    return apply_lora(chunks, LoRASpec(rank=4, alpha=8.0, targets=tuple(TARGETS)))


def test_planned_adapters_per_gpu_equal_the_built_modules(tmp_path):
    make_tiny_hf("llama", tmp_path, num_hidden_layers=4)
    over = [f"model.hf_path={tmp_path}", "actor.lora.rank=4", "actor.gpus=2", "model.arch.tie_word_embeddings=false", f"actor.lora.target_modules=[{','.join(TARGETS)}]"]
    over += [f"model.arch.{k}=0" for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                           "num_kv_heads", "vocab_size", "head_dim")]
    for layout in (dict(tp=2), dict(pp=2)):
        cfg = load_config(ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml",
                          over + [f"actor.parallel.{k}={v}" for k, v in layout.items()])
        p = cfg.actor.parallel
        planned = [adapter_params(cfg.model.arch, cfg.actor.lora, p.tp, layers)
                   for layers in stage_layers(cfg.model.arch.num_layers, p)]
        built = spawn(_count, 2, str(tmp_path), layout)
        expected = built[:1] * len(planned) if p.tp == 2 else built
        assert planned == expected, (layout, planned, built)


def test_7b_lora_plan_fits_one_h200_full_parameter_does_not():
    lora = make_plan(load_config(RECIPE_7B))
    full = make_plan(load_config(RECIPE_7B, ["actor.lora.rank=0"]))
    assert "ref" not in lora.roles and "ref" in full.roles
    actor = lora.roles["actor"]
    cfg = load_config(RECIPE_7B)
    trainable = adapter_params(cfg.model.arch, cfg.actor.lora, 1, range(28))
    assert trainable == 28 * 64 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))
    assert actor.grads == 4 * trainable and actor.optimizer == (4 + 8) * trainable
    assert full.roles["actor"].grads == 4 * full.roles["actor"].params_on_gpu
    assert lora.fits and not full.fits


def test_bad_lora_fields_are_refused_naming_the_field():
    import pytest

    from megarl.config import ConfigError

    cases = {"actor.lora.rank=-1": "actor.lora.rank:", "actor.lora.target_modules=[q_proj,qkv]":
             "actor.lora.target_modules: ['qkv']", "actor.lora.dropout=1.5": "actor.lora.dropout:",
             "critic.lora.rank=4": "critic.lora.rank:", "actor.lora.alpha=0": "actor.lora.alpha:",
             "ref.model_path=/elsewhere": "ref.model_path:"}
    for override, field in cases.items():
        extra = [] if override.startswith("actor.lora.rank") or override.startswith("critic") else ["actor.lora.rank=8"]
        with pytest.raises(ConfigError) as e:
            load_config(RECIPE_7B, [override, *extra])
        assert field in str(e.value), (override, str(e.value))
