"""Which HF ``config.json`` fields megarl maps to megatron exactly, and which it refuses.

Every field of a supported family's transformers config is in exactly one class here:

* ``MAPPED``: changes the computation and is mapped exactly by ``models/config.py`` /
  ``models/builder.py`` / ``models/routing_replay.py``; ``tests/test_hf_mapping.py`` proves it by
  HF-logit parity over a sweep of valid values of each field;
* ``NO_EFFECT``: does not change a forward or backward pass of megarl's models (token ids, cache
  and output switches, init ranges, storage dtype, derived aliases) or is read by HF only for a
  loss megarl does not use (the router's auxiliary loss);
* refused values: ``refusals`` names every field whose value megarl cannot compute exactly
  (biases megatron has no slot for, sliding windows, dynamic / long-context RoPE, ...), so a run
  fails before any process starts (``config/validate.py``) and ``transformer_config_from_hf``
  raises for anything built another way.

A field of a supported family that is in no class (a new transformers version, a remote-code
config) is refused too: better one clear line than silently different logits.
"""
from __future__ import annotations

from typing import Any

NO_EFFECT = frozenset({
    "_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "chunk_size_feed_forward",
    "dtype", "torch_dtype", "id2label", "label2id", "initializer_range", "is_encoder_decoder", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version", "use_cache", "model_type",
    "tokenizer_class", "output_router_logits", "router_aux_loss_coef",  # HF's auxiliary training loss only
    "pretraining_tp",                  # read by no transformers 5 modeling code
    "max_window_layers", "use_sliding_window",  # only through layer_types / sliding_window (checked)
    "num_nextn_predict_layers", "num_mtp_layers",  # MTP heads: HF computes and loads none (nor megarl)
    "qk_head_dim", "num_local_experts",  # derived / aliases of mapped fields
    "aux_loss_alpha", "seq_aux",       # DeepSeek remote-code training losses
    "ep_size",                         # DeepSeek remote-code deployment hint
    "rope_theta", "rope_scaling",      # folded into rope_parameters by transformers 5
    "generation_config", "use_bfloat16", "tie_encoder_decoder", "task_specific_params", "auto_map",
})

COMMON = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
                    "attention_dropout", "max_position_embeddings", "head_dim"})
MAPPED: dict[str, frozenset] = {
    "llama": COMMON | {"attention_bias", "mlp_bias"},
    "mistral": COMMON | {"sliding_window"},
    "qwen2": COMMON | {"sliding_window", "layer_types"},
    "qwen3": COMMON | {"attention_bias", "sliding_window", "layer_types"},
    "qwen3_moe": COMMON | {"attention_bias", "sliding_window", "decoder_sparse_step", "mlp_only_layers",
                           "moe_intermediate_size", "norm_topk_prob", "num_experts", "num_experts_per_tok"},
    "deepseek_v3": COMMON | {"attention_bias", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
                             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
                             "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob",
                             "num_experts_per_tok", "moe_intermediate_size", "rope_interleave",
                             "moe_layer_freq", "scoring_func", "topk_method"},
}
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")   # yarn: only with attention factor 1 (non-MLA)


def _no_effect_by_name(name: str) -> bool:
    """Special-token ids and provenance paths never change a forward pass."""
    return name.endswith(("_token_id", "_token_ids", "_name_or_path"))


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return getattr(cfg, name, default)


def _rope_refusals(cfg: Any, family: str) -> list[str]:
    from .config import rope_params

    rp = rope_params(cfg)
    rtype = rp.get("rope_type", "default") or "default"
    out = []
    if float(rp.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        out.append(f"rope_parameters.partial_rotary_factor={rp['partial_rotary_factor']}: partial rotary embeddings "
                   f"are not mapped")
    if family == "deepseek_v3":
        if rtype not in ("default", "yarn"):
            out.append(f"rope_parameters.rope_type={rtype!r}: DeepSeek-V3 (MLA) maps default and yarn RoPE only")
        return out
    if rtype not in STATIC_ROPE:
        why = {"dynamic": "its frequencies change with the sequence length at run time",
               "longrope": "it switches short/long factors with the sequence length"}.get(rtype, "not mapped")
        out.append(f"rope_parameters.rope_type={rtype!r}: {why}; megatron's RoPE is static")
        return out
    if rtype != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        try:
            _, factor = ROPE_INIT_FUNCTIONS[rtype](cfg, "cpu")
        except Exception as err:  # noqa: BLE001 - transformers' own validation of the parameters
            return [f"rope_parameters: transformers cannot build {rtype!r} RoPE from it: {err}"]
        if abs(float(factor) - 1.0) > 1e-12:
            out.append(f"rope_parameters.rope_type={rtype!r} scales attention by {float(factor):.6g} "
                       f"(attention_factor/mscale): megatron's GPT RoPE has no such factor")
    return out


def _moe_refusals(cfg: Any, family: str) -> list[str]:
    out = []
    if family == "deepseek_v3":
        experts, groups = int(_get(cfg, "n_routed_experts") or 0), _get(cfg, "n_group")
        topk_group, top_k = _get(cfg, "topk_group"), int(_get(cfg, "num_experts_per_tok") or 0)
        if not groups or not topk_group:
            out.append(f"n_group={groups}, topk_group={topk_group}: transformers' DeepSeek-V3 router needs both")
        elif experts % groups or experts // groups < 2:
            out.append(f"n_group={groups}: n_routed_experts={experts} must split into groups of >= 2 experts "
                       f"(transformers' router takes each group's best two)")
        elif not 1 <= topk_group <= groups:
            out.append(f"topk_group={topk_group}: must be in [1, n_group={groups}]")
        if not 1 <= top_k <= experts:
            out.append(f"num_experts_per_tok={top_k}: must be in [1, n_routed_experts={experts}]")
        if not _get(cfg, "norm_topk_prob", True) and top_k > 1:
            out.append("norm_topk_prob=False: megatron always renormalises sigmoid gates of top-k > 1")
        if _get(cfg, "norm_topk_prob", True) and top_k == 1:
            out.append("num_experts_per_tok=1 with norm_topk_prob=True: HF's gate is 1.0, megatron's the sigmoid "
                       "score")
        if int(_get(cfg, "moe_layer_freq", 1) or 1) != 1:
            out.append(f"moe_layer_freq={_get(cfg, 'moe_layer_freq')}: transformers' DeepSeek-V3 ignores it (MoE from "
                       f"first_k_dense_replace on) while DeepSeek's own code does not: ambiguous")
        if _get(cfg, "scoring_func", "sigmoid") != "sigmoid":
            out.append(f"scoring_func={_get(cfg, 'scoring_func')!r}: DeepSeek-V3 routing is sigmoid (transformers "
                       f"ignores this field, DeepSeek's code does not)")
        if _get(cfg, "topk_method", "noaux_tc") != "noaux_tc":
            out.append(f"topk_method={_get(cfg, 'topk_method')!r}: only noaux_tc (group-limited, bias-corrected) "
                       f"is what transformers computes")
        if _get(cfg, "rope_interleave", True) is False:
            out.append("rope_interleave=False: megatron's MLA RoPE takes the interleaved layout only")
    if family == "qwen3_moe":
        experts, top_k = int(_get(cfg, "num_experts") or 0), int(_get(cfg, "num_experts_per_tok") or 0)
        if not 1 <= top_k <= experts:
            out.append(f"num_experts_per_tok={top_k}: must be in [1, num_experts={experts}]")
    return out


def refusals(cfg: Any) -> list[str]:
    """One line per field of this transformers config that megarl cannot compute exactly."""
    from .config import _MODEL_TYPE_TO_FAMILY

    model_type = _get(cfg, "model_type")
    family = _MODEL_TYPE_TO_FAMILY.get(model_type)
    if family is None:
        return [f"model_type={model_type!r}: unsupported (supported: {sorted(_MODEL_TYPE_TO_FAMILY)})"]
    if family == "qwen2_5_vl":
        from .qwen2_vl import vl_refusals

        # the model is HF-exact (tests/test_qwen2_vl_model.py) but runs cannot take it yet
        return vl_refusals(cfg) + [
            "model_type='qwen2_5_vl': RL runs do not take vision-language models yet (rollout engine, batches "
            "and weight sync are text-only); megarl.models.qwen2_vl builds the megatron model"]
    known = MAPPED["mistral" if model_type == "mistral" else family]
    fields = set(cfg.to_dict()) if hasattr(cfg, "to_dict") else set(vars(cfg))
    out = [f"{name}: a field megarl has not audited for {model_type} (not known to change nothing, not mapped)"
           for name in sorted(fields - known - NO_EFFECT)
           if name != "quantization_config" and not _no_effect_by_name(name)]
    if "quantization_config" in fields and _get(cfg, "quantization_config"):
        out.append("quantization_config: quantized checkpoints are not imported; dequantize to bf16/fp32 first")
    act = _get(cfg, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        out.append(f"hidden_act={act!r}: mapped are {', '.join(ACTIVATIONS)}")
    if _get(cfg, "mlp_bias", False):
        out.append("mlp_bias=True: megatron's MLP biases come only with biases on every linear layer")
    if _get(cfg, "attention_bias", False) and family != "qwen2":
        out.append(f"attention_bias=True: {model_type} puts a bias on o_proj too, megatron adds q/k/v biases only")
    window = _get(cfg, "sliding_window")
    if family in ("qwen2", "qwen3"):
        if "sliding_attention" in (_get(cfg, "layer_types") or []):
            out.append(f"layer_types/use_sliding_window: sliding-window attention (window {window}) is not mapped")
    elif window is not None and (family == "qwen3_moe" or int(window) < int(_get(cfg, "max_position_embeddings", 0))):
        out.append(f"sliding_window={window}: sliding-window attention is not mapped (null, or >= "
                   f"max_position_embeddings, means none)")
    out += _rope_refusals(cfg, family)
    out += _moe_refusals(cfg, family)
    return out


def check_hf_config(cfg: Any) -> None:
    """Raise ``ValueError`` naming every refused field (``refusals``)."""
    problems = refusals(cfg)
    if problems:
        raise ValueError(f"unsupported HF config ({_get(cfg, 'model_type')}): " + "; ".join(problems))
