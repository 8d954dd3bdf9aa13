"""Qwen2.5-VL on megatron-core: ``GPTModel`` decoder with multimodal RoPE + the vision tower.

:class:`Qwen2VLModel` *is* a ``GPTModel`` (so ``megarl.models.naming``, ``forward_logits``,
``unwrap`` and checkpointing see ``embedding.*`` / ``decoder.layers.*`` / ``output_layer.*`` as for
the text families) with one extra submodule, ``vision_model``
(:class:`~megarl.models.qwen2_vl_vision.VisionTower`, first pipeline stage only).

Forward: token embeddings -> image-placeholder rows (``image_token_id``) replaced by the tower's
features (batch-major order, as HF's ``masked_scatter``) -> ``GPTModel.forward(decoder_input=...)``
with ``position_ids [3, b, s]``. In megatron-core 0.16 ``GPTModel._preprocess`` hands
``position_ids`` unchanged to ``MultimodalRotaryEmbedding(position_ids, mrope_section)`` when
``position_embedding_type == "mrope"``; that class's ``__init__`` calls
``torch.cuda.current_device()``, so the model is built with ``"rope"`` and the rotary module is
swapped for :class:`_MRoPE` (same forward, CPU-safe init, HF's inverse frequencies).

Weights: ``naming.py`` family ``qwen2_5_vl`` maps the Hub layout (``model.layers.*``,
``model.embed_tokens``, ``lm_head``, ``visual.*``, which ``save_pretrained`` writes too);
``SafetensorsSource`` also accepts transformers 5's in-memory names (``model.language_model.*``,
``model.visual.*``).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt.gpt_model import GPTModel

from .qwen2_vl_vision import VisionTower, mrope_position_ids

FAMILY = "qwen2_5_vl"


class _MRoPE(MultimodalRotaryEmbedding):
    """megatron's multimodal RoPE with a device-agnostic ``__init__`` (the stock one allocates
    ``inv_freq`` on ``torch.cuda.current_device()``, which fails on CPU)."""

    def __init__(self, inv_freq: Tensor):
        torch.nn.Module.__init__(self)
        from megatron.core import parallel_state as mpu

        self.rotary_interleaved = False
        self.seq_len_interpolation_factor = None
        self.inv_freq = inv_freq
        self.cp_group = mpu.get_context_parallel_group(check_initialized=False)


def text_transformer_config(cfg, **kw):
    """The decoder's ``TransformerConfig``: Qwen2.5-VL's text model is Qwen2 (q/k/v biases, SwiGLU,
    RMSNorm) with M-RoPE, so it goes through the qwen2 mapping (and its field audit) plus
    ``mrope_section``. Refuses what the mapping cannot compute exactly."""
    from transformers import Qwen2Config

    from .config import rope_params, transformer_config_from_hf

    tc = cfg.text_config
    rp = rope_params(tc)
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"qwen2_5_vl: text rope_type {rp.get('rope_type')!r} is not supported (default only)")
    if getattr(tc, "use_sliding_window", False) or "sliding_attention" in (getattr(tc, "layer_types", None) or []):
        raise ValueError("qwen2_5_vl: sliding-window attention is not supported")
    section = list(rp.get("mrope_section") or [16, 24, 24])
    hd = tc.hidden_size // tc.num_attention_heads
    if 2 * sum(section) != hd:
        raise ValueError(f"qwen2_5_vl: mrope_section {section} must sum to head_dim/2 = {hd // 2}")
    q2 = Qwen2Config(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                     num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
                     num_key_value_heads=tc.num_key_value_heads, hidden_act=tc.hidden_act,
                     max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                     attention_dropout=tc.attention_dropout, tie_word_embeddings=bool(cfg.tie_word_embeddings),
                     rope_parameters={"rope_type": "default", "rope_theta": float(rp.get("rope_theta", 1e6))},
                     bos_token_id=None, eos_token_id=None)
    return transformer_config_from_hf(q2, mrope_section=section, **kw), q2, section


class Qwen2VLModel(GPTModel):
    """``GPTModel`` + Qwen2.5-VL vision tower; see the module docstring."""

    def __init__(self, hf_config, tconf, spec, *, vocab_size: int, pre_process: bool, post_process: bool,
                 tied: bool, section: List[int], freeze_vision: bool = True, vp_stage: Optional[int] = None):
        tc = hf_config.text_config
        super().__init__(config=tconf, transformer_layer_spec=spec, vocab_size=vocab_size,
                         max_sequence_length=int(tc.max_position_embeddings), pre_process=pre_process,
                         post_process=post_process, parallel_output=True,
                         share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                         vp_stage=vp_stage)
        theta = float(tc.rope_parameters.get("rope_theta", 1e6))
        hd = tconf.kv_channels
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.position_embedding_type = "mrope"
        self.mrope_section = section
        self.rotary_pos_emb = _MRoPE(inv)
        self.image_token_id = int(hf_config.image_token_id)
        self.spatial_merge = int(hf_config.vision_config.spatial_merge_size)
        self.freeze_vision = freeze_vision
        self.vision_model = VisionTower(tconf, hf_config.vision_config) if pre_process else None
        if self.vision_model is not None and freeze_vision:
            for p in self.vision_model.parameters():
                p.requires_grad_(False)

    def rope_index(self, input_ids: Tensor, image_grid_thw: Optional[Tensor],
                   attention_mask_2d: Optional[Tensor] = None) -> Tensor:
        """``[3, b, s]`` M-RoPE positions (see :func:`mrope_position_ids`)."""
        return mrope_position_ids(input_ids, image_grid_thw, self.image_token_id, self.spatial_merge,
                                  attention_mask_2d)[0]

    def embed(self, input_ids: Tensor, pixel_values: Optional[Tensor], image_grid_thw: Optional[Tensor]) -> Tensor:
        """``[s, b, h]`` decoder input: token embeddings with the image rows replaced."""
        if self.config.sequence_parallel:
            raise NotImplementedError("Qwen2VLModel: sequence parallelism (the merge needs whole sequences)")
        emb = self.embedding(input_ids=input_ids, position_ids=None)          # [s, b, h]
        if pixel_values is None:
            return emb
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_vision):
            feats = self.vision_model(pixel_values, image_grid_thw)
        mask = input_ids == self.image_token_id                               # [b, s]
        if int(mask.sum()) != feats.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens but {feats.shape[0]} image features")
        # batch-major fill, as HF's masked_scatter over [b, s, h]
        emb = emb.transpose(0, 1).clone()
        emb[mask] = feats.to(emb.dtype)
        return emb.transpose(0, 1).contiguous()

    def forward(self, input_ids: Tensor, position_ids: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, decoder_input: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, *, pixel_values: Optional[Tensor] = None,
                image_grid_thw: Optional[Tensor] = None, **kwargs):
        """``position_ids``: ``[3, b, s]`` M-RoPE ids, ``[b, s]`` text positions (broadcast to the
        three axes), or None (computed from ``input_ids`` / ``image_grid_thw``; no padding)."""
        if position_ids is None:
            position_ids = self.rope_index(input_ids, image_grid_thw)
        elif position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if decoder_input is None and self.pre_process:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                               labels=labels, **kwargs)


def build_qwen2_vl(hf_config, *, params_dtype: torch.dtype = torch.float32, freeze_vision: bool = True,
                   attention_backend: str = "sdpa", perform_initialization: bool = True,
                   **config_overrides) -> List[Qwen2VLModel]:
    """Model chunks for this rank (one; no virtual pipeline yet), built like ``build_model``:
    megarl's layer spec (SDPA core attention), vocab padded to a multiple of TP, TP attributes
    set for conversion, ``hf_config`` / ``family`` / ``vocab_size`` / ``value_head`` attributes."""
    from megatron.core import parallel_state as mpu

    from .builder import _ensure_tp_attributes, layer_block_spec, padded_vocab_size
    from .config import load_hf_config

    cfg = load_hf_config(hf_config)
    if getattr(cfg, "model_type", None) != FAMILY:
        raise ValueError(f"build_qwen2_vl: model_type {cfg.model_type!r}, expected {FAMILY!r}")
    tp = mpu.get_tensor_model_parallel_world_size()
    pp = mpu.get_pipeline_model_parallel_world_size()
    tconf, q2, section = text_transformer_config(
        cfg, tp=tp, pp=pp, cp=mpu.get_context_parallel_world_size(), params_dtype=params_dtype,
        perform_initialization=perform_initialization, **config_overrides)
    spec = layer_block_spec(tconf, attention_backend=attention_backend)
    model = Qwen2VLModel(cfg, tconf, spec, vocab_size=padded_vocab_size(q2.vocab_size, tp),
                         pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage(),
                         tied=bool(cfg.tie_word_embeddings), section=section, freeze_vision=freeze_vision)
    _ensure_tp_attributes(model)
    model.hf_config = cfg
    model.family = FAMILY
    model.vocab_size = q2.vocab_size
    model.value_head = False
    model.vp_stage = None
    return [model]
