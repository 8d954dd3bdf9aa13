"""HF ``config.json`` -> megatron-core ``TransformerConfig`` for the supported families."""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from .fusions import fusions_enabled
from .hf_audit import check_hf_config

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
# vision-language: built and HF-exact (models/qwen2_vl.py), not yet taken by RL runs (hf_audit refuses)
MULTIMODAL_FAMILIES = ("qwen2_5_vl",)

_MODEL_TYPE_TO_FAMILY = {
    "llama": "llama", "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    "qwen2_5_vl": "qwen2_5_vl",
}


def load_hf_config(hf_config: Union[str, os.PathLike, Any]):
    """Accept a transformers PretrainedConfig, a dict, a config.json path or an HF folder."""
    if hasattr(hf_config, "model_type") and not isinstance(hf_config, dict):
        return hf_config
    from transformers import AutoConfig
    if isinstance(hf_config, dict):
        d = dict(hf_config)
        mt = d.pop("model_type")
        return AutoConfig.for_model(mt, **d)
    p = pathlib.Path(hf_config)
    if p.is_file():
        p = p.parent
    return AutoConfig.from_pretrained(str(p), local_files_only=True)


def detect_family(hf_config) -> str:
    """'llama' | 'qwen2' | 'qwen3' | 'qwen3_moe' | 'deepseek_v3' | 'qwen2_5_vl' (ValueError otherwise)."""
    cfg = load_hf_config(hf_config)
    fam = _MODEL_TYPE_TO_FAMILY.get(getattr(cfg, "model_type", None))
    if fam is None:
        raise ValueError(f"unsupported model_type {getattr(cfg, 'model_type', None)!r}; "
                         f"supported: {sorted(_MODEL_TYPE_TO_FAMILY)}")
    return fam


def rope_params(cfg) -> dict:
    """transformers 5 keeps rope settings in ``rope_parameters``; older configs in rope_scaling."""
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    if not rp:
        rp = dict(getattr(cfg, "rope_scaling", None) or {})
        rp.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``: the tanh approximation (not exact ``F.gelu``)."""
    return F.gelu(x, approximate="tanh")


def _activation(cfg):
    act = getattr(cfg, "hidden_act", "silu")
    if act in ("silu", "swish"):
        return F.silu
    if act == "gelu":
        return F.gelu
    if act == "gelu_pytorch_tanh":
        return _gelu_tanh
    raise ValueError(f"unsupported hidden_act {act!r}")


def moe_layer_pattern(cfg, family: str) -> Optional[list]:
    """1 = MoE layer, 0 = dense, per decoder layer (None for dense families)."""
    n = cfg.num_hidden_layers
    if family == "qwen3_moe":
        mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        return [0 if (i in mlp_only or (i + 1) % step != 0) else 1 for i in range(n)]
    if family == "deepseek_v3":
        k = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
        freq = int(getattr(cfg, "moe_layer_freq", 1) or 1)
        return [1 if (i >= k and i % freq == 0) else 0 for i in range(n)]
    return None


def renormalized_top1(cfg) -> bool:
    """Qwen3-MoE top-1 with ``norm_topk_prob``: HF's gate is p / p = 1 (no gradient to the router);
    megatron needs pre-softmax routing at top-1, so the router hook renormalises the gate."""
    return (getattr(cfg, "model_type", None) == "qwen3_moe" and bool(getattr(cfg, "norm_topk_prob", False))
            and int(getattr(cfg, "num_experts_per_tok", 0) or 0) == 1)


def qwen3_moe_pre_softmax(cfg) -> bool:
    """megatron's ``moe_router_pre_softmax`` for a Qwen3-MoE config (see the mapping)."""
    return not bool(getattr(cfg, "norm_topk_prob", False)) or renormalized_top1(cfg)


def transformer_config_from_hf(hf_config, *, tp: int = 1, pp: int = 1, ep: int = 1,
                               etp: Optional[int] = 1, vpp: Optional[int] = None, cp: int = 1,
                               params_dtype: torch.dtype = torch.float32,
                               sequence_parallel: bool = False, perform_initialization: bool = True,
                               use_cpu_initialization: Optional[bool] = None,
                               recompute: Optional[str] = None, first_stage_layers: int = 0,
                               last_stage_layers: int = 0, **overrides):
    """Build the megatron ``TransformerConfig`` (``MLATransformerConfig`` for DeepSeek-V3).

    Dropout is taken from the HF config (0 for all supported families); of the fusions only
    megatron's compiled SwiGLU (``bias_activation_fusion``) is on, and only where
    :func:`megarl.models.fusions.fusions_enabled` (CUDA); the others need TE/apex kernels.
    ``use_cpu_initialization`` defaults to "no CUDA". ``overrides`` are set on
    the config dataclass verbatim (e.g. ``moe_token_dispatcher_type="allgather"``).
    ``first_stage_layers`` / ``last_stage_layers`` (0 = even): an uneven pipeline, as megatron's
    ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cfg = load_hf_config(hf_config)
    family = detect_family(cfg)
    if family == "qwen2_5_vl":   # the decoder's config (qwen2 + M-RoPE), audited there
        from .qwen2_vl import text_transformer_config

        return text_transformer_config(
            cfg, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, cp=cp, params_dtype=params_dtype,
            sequence_parallel=sequence_parallel, perform_initialization=perform_initialization,
            use_cpu_initialization=use_cpu_initialization, recompute=recompute,
            first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers, **overrides)[0]
    check_hf_config(cfg)   # every field mapped exactly or refused, naming it (models/hf_audit.py)
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    kw: dict = dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=_activation(cfg),
        add_bias_linear=False,
        hidden_dropout=float(getattr(cfg, "hidden_dropout", 0.0) or 0.0),
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(getattr(cfg, "initializer_range", 0.02)),
        # megatron fuses SwiGLU exactly; its fused GeGLU is the tanh approximation, so gelu is not fused
        bias_activation_fusion=fusions_enabled() and _activation(cfg) is F.silu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        attention_softmax_in_fp32=True,
        num_layers_in_first_pipeline_stage=(first_stage_layers or None) if pp > 1 else None,
        num_layers_in_last_pipeline_stage=(last_stage_layers or None) if pp > 1 else None,
    )
    if recompute:
        kw.update(recompute_granularity=recompute,
                  recompute_method="uniform" if recompute == "full" else None,
                  recompute_num_layers=1 if recompute == "full" else None)
    cls = TransformerConfig
    if family in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        kw["num_query_groups"] = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        kw["kv_channels"] = head_dim(cfg)
        kw["add_qkv_bias"] = bool(getattr(cfg, "attention_bias", False)) or family == "qwen2"
        kw["qk_layernorm"] = family in ("qwen3", "qwen3_moe")
    if family == "qwen3_moe":
        kw.update(
            num_moe_experts=cfg.num_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_layer_freq=moe_layer_pattern(cfg, family),
            # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob.
            # megatron: pre_softmax=False == top-k logits then softmax (== renormalised); megatron
            # refuses that for top-1, where the router hook renormalises instead (gate 1.0, as HF)
            moe_router_pre_softmax=qwen3_moe_pre_softmax(cfg),
            moe_router_score_function="softmax",
        )
    if family == "deepseek_v3":
        cls = MLATransformerConfig
        rp = rope_params(cfg)
        rtype = rp.get("rope_type", "default")
        n_shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        kw.update(
            num_query_groups=cfg.num_attention_heads,
            multi_latent_attention=True,
            q_lora_rank=getattr(cfg, "q_lora_rank", None),
            kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_nope_head_dim,
            qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            kv_channels=cfg.v_head_dim,
            qk_layernorm=True,  # q_a_layernorm / kv_a_layernorm
            rope_type="yarn" if rtype == "yarn" else "rope",
            rotary_base=float(rp.get("rope_theta", 10000.0)),
            rotary_scaling_factor=float(rp.get("factor", 1.0)),
            original_max_position_embeddings=int(rp.get("original_max_position_embeddings", 4096)),
            beta_fast=float(rp.get("beta_fast", 32)), beta_slow=float(rp.get("beta_slow", 1)),
            mscale=float(rp.get("mscale", 1.0)), mscale_all_dim=float(rp.get("mscale_all_dim", 0.0)),
            num_moe_experts=cfg.n_routed_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_shared_expert_intermediate_size=(cfg.moe_intermediate_size * n_shared) or None,
            moe_layer_freq=moe_layer_pattern(cfg, family),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_pre_softmax=True,
            moe_router_topk_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0),
            moe_router_num_groups=getattr(cfg, "n_group", None),
            moe_router_group_topk=getattr(cfg, "topk_group", None),
            moe_router_dtype="fp32",
        )
    if kw.get("num_moe_experts"):
        kw.update(
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
    kw.update(overrides)
    tc = cls(**kw)
    return tc


def hf_config_json(hf_dir) -> dict:
    with open(pathlib.Path(hf_dir) / "config.json") as f:
        return json.load(f)
