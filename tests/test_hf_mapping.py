"""Every computation-changing HF config field is mapped to megatron exactly or refused by name.

* Sweep: for each family, each mapped field takes several valid values (one field at a time off a
  tiny base config, plus DeepSeek-V3 routing-group combinations, YaRN, shared experts, q-LoRA
  off, ...); megatron logits (build_model + load_hf_weights, fp32) equal transformers' logits.
* Refusals: a config with a field megarl cannot compute exactly fails ``check_hf_config``,
  ``transformer_config_from_hf`` and ``validate_config`` (before any process), naming the field.
"""
from __future__ import annotations

import json

import pytest
import torch

from dist_utils import make_tiny_hf, sample_ids, tiny_hf_config

from megarl.models.hf_audit import check_hf_config, refusals

TOL = 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

SWEEP: list[tuple[str, dict]] = [
    ("llama", {"hidden_act": "silu"}), ("llama", {"hidden_act": "gelu"}),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}), ("llama", {"tie_word_embeddings": True}),
    ("llama", {"head_dim": 24}), ("llama", {"num_key_value_heads": 1}), ("llama", {"num_key_value_heads": 4}),
    ("llama", {"rms_norm_eps": 0.5}), ("llama", {"attention_bias": False, "mlp_bias": False}),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 77.0}}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}}),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "attention_factor": 1.0}}),
    ("mistral", {"sliding_window": None}), ("mistral", {"sliding_window": 256}),
    ("qwen2", {"tie_word_embeddings": False}), ("qwen2", {"num_key_value_heads": 1}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 8}),
    ("qwen3", {"head_dim": 8}), ("qwen3", {"tie_word_embeddings": True}), ("qwen3", {"hidden_act": "gelu"}),
    ("qwen3_moe", {"norm_topk_prob": False}), ("qwen3_moe", {"num_experts_per_tok": 1}),
    ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 3}), ("qwen3_moe", {"decoder_sparse_step": 2}),
    ("qwen3_moe", {"mlp_only_layers": [0]}), ("qwen3_moe", {"moe_intermediate_size": 48}),
    ("deepseek_v3", {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}),
    ("deepseek_v3", {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}),
    ("deepseek_v3", {"n_routed_experts": 8, "n_group": 2, "topk_group": 2, "num_experts_per_tok": 4}),
    ("deepseek_v3", {"n_routed_experts": 6, "n_group": 3, "topk_group": 2, "num_experts_per_tok": 3}),
    ("deepseek_v3", {"n_routed_experts": 8, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 3}),
    ("deepseek_v3", {"n_routed_experts": 8, "n_group": 4, "topk_group": 3, "num_experts_per_tok": 5}),
    ("deepseek_v3", {"routed_scaling_factor": 1.0}), ("deepseek_v3", {"n_shared_experts": 0}),
    ("deepseek_v3", {"n_shared_experts": 2}), ("deepseek_v3", {"q_lora_rank": None}),
    ("deepseek_v3", {"first_k_dense_replace": 0}), ("deepseek_v3", {"tie_word_embeddings": True}),
    ("deepseek_v3", {"rope_parameters": dict(YARN)}),
    ("deepseek_v3", {"rope_parameters": dict(YARN, mscale=0.707, mscale_all_dim=0.707, factor=8.0)}),
    ("deepseek_v3", {"qk_rope_head_dim": 16, "head_dim": 16, "v_head_dim": 8, "kv_lora_rank": 24}),
]


def _make(family: str, overrides: dict, out_dir):
    if family == "mistral":
        from transformers import AutoModelForCausalLM, MistralConfig

        from dist_utils import randomize_
        base = tiny_hf_config("llama")
        kw = {k: getattr(base, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "intermediate_size", "max_position_embeddings",
                                              "rms_norm_eps")}
        cfg = MistralConfig(**kw, **overrides)
        torch.manual_seed(0)
        model = randomize_(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)).eval()
        model.save_pretrained(str(out_dir))
        return model
    return make_tiny_hf(family, out_dir, **overrides)


def _parity_sweep(rank, world, cases, ids):
    from megarl.models import build_model, forward_logits, load_hf_weights
    from megarl.parallel import destroy_model_parallel, init_model_parallel

    out = []
    for hf_dir, ref in cases:
        init_model_parallel(tp=1)
        chunks = build_model(hf_dir)
        load_hf_weights(chunks, hf_dir)
        out.append((hf_dir, (forward_logits(chunks, ids) - ref).abs().max().item()))
        destroy_model_parallel()
    return out


def test_mapped_fields_match_hf_logits_over_a_sweep(tmp_path):
    from megarl.parallel import spawn

    ids = sample_ids()
    cases, names = [], {}
    for i, (family, overrides) in enumerate(SWEEP):
        d = tmp_path / f"{i:02d}_{family}"
        model = _make(family, overrides, d)
        assert refusals(model.config) == [], (family, overrides, refusals(model.config))
        with torch.no_grad():
            cases.append((str(d), model(ids).logits.float()))
        names[str(d)] = (family, overrides)
    diffs = spawn(_parity_sweep, 1, cases, ids)[0]
    bad = {str(names[d]): diff for d, diff in diffs if not diff < TOL}
    assert not bad, bad
    assert len(diffs) == len(SWEEP)


REFUSED: list[tuple[str, dict, str]] = [
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"hidden_act": "relu"}, "hidden_act"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "dynamic"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64}}, "attention_factor"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("mistral", {"sliding_window": 16}, "sliding_window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "sliding"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window"),
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("deepseek_v3", {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
    ("deepseek_v3", {"n_routed_experts": 4, "n_group": 4, "topk_group": 1}, "n_group"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ("qwen2", {"some_new_field": 3}, "some_new_field"),
]


@pytest.mark.parametrize("family,overrides,field", REFUSED, ids=[f"{f}-{n}" for f, _, n in REFUSED])
def test_unmappable_fields_are_refused_by_name(family, overrides, field):
    from megarl.models import transformer_config_from_hf

    if family == "mistral":
        from transformers import MistralConfig
        cfg = MistralConfig(max_position_embeddings=256, **overrides)
    else:
        cfg = tiny_hf_config(family, **overrides)
    assert any(field in line for line in refusals(cfg)), refusals(cfg)
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        check_hf_config(cfg)
    with pytest.raises(ValueError, match="unsupported HF config"):
        transformer_config_from_hf(cfg)


def test_validation_refuses_before_any_process_naming_the_field(tmp_path):
    """``load_config`` validates: the refusal comes with the recipe, naming model.hf_path and the field."""
    from megarl.config import ConfigError, load_config
    from tests.helpers.runs import ARCH_FROM_CONFIG_JSON, DEFAULT

    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama", attention_bias=True).to_dict()))
    with pytest.raises(ConfigError, match=r"model.hf_path: .*attention_bias=True") as err:
        load_config(DEFAULT, [f"model.hf_path={tmp_path}", *ARCH_FROM_CONFIG_JSON])
    assert len(str(err.value).strip().splitlines()) == 2  # the header and that one line
