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
        # a (non-persistent) buffer, so ``model.cuda()`` moves it (megatron keeps a plain attribute)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cp_group = mpu.get_context_parallel_group(check_initialized=False)


# vision_config fields that change the tower's computation, all mapped by VisionTower
_VISION_MAPPED = frozenset({"depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels",
                            "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
                            "out_hidden_size", "fullatt_block_indexes", "rope_parameters"})
_VIDEO_ONLY = frozenset({"tokens_per_second"})   # temporal spacing of video positions; images only here
_TOP_MAPPED = frozenset({"text_config", "vision_config", "tie_word_embeddings"})


def _synth_qwen2(cfg):
    """The decoder as a ``Qwen2Config`` (same computation but the 1-D RoPE): what the qwen2
    mapping and its audit take."""
    from transformers import Qwen2Config

    from .config import rope_params

    tc = cfg.text_config
    return Qwen2Config(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                       num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
                       num_key_value_heads=tc.num_key_value_heads, hidden_act=tc.hidden_act,
                       max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                       attention_dropout=tc.attention_dropout, tie_word_embeddings=bool(cfg.tie_word_embeddings),
                       rope_parameters={"rope_type": "default",
                                        "rope_theta": float(rope_params(tc).get("rope_theta", 1e6))},
                       bos_token_id=None, eos_token_id=None)


def vl_refusals(cfg) -> List[str]:
    """One line per field of a Qwen2.5-VL config megarl does not compute exactly (the
    ``hf_audit.refusals`` contract): unaudited fields of the top level, ``text_config`` (qwen2's
    mapped set + M-RoPE) and ``vision_config``; refused values (non-default text RoPE, sliding
    windows, a non-SiLU tower, non-axial vision RoPE, a bad ``mrope_section``)."""
    from .config import rope_params
    from .hf_audit import MAPPED, NO_EFFECT, _no_effect_by_name, refusals

    def unknown(where: str, fields, known) -> List[str]:
        return [f"{where}{n}: a field megarl has not audited for qwen2_5_vl" for n in sorted(set(fields) - known - NO_EFFECT)
                if not _no_effect_by_name(n)]

    tc, vc = cfg.text_config, cfg.vision_config
    out = unknown("", cfg.to_dict(), _TOP_MAPPED)
    out += unknown("text_config.", tc.to_dict(), MAPPED["qwen2"] | {"max_window_layers", "use_sliding_window"})
    out += unknown("vision_config.", vc.to_dict(), _VISION_MAPPED | _VIDEO_ONLY)
    rp = rope_params(tc)
    if rp.get("rope_type", "default") != "default":
        out.append(f"text_config.rope_parameters.rope_type={rp.get('rope_type')!r}: M-RoPE is mapped with default "
                   f"frequencies only")
    section = list(rp.get("mrope_section") or [])
    hd = tc.hidden_size // tc.num_attention_heads
    if len(section) != 3 or 2 * sum(section) != hd:
        out.append(f"text_config.rope_parameters.mrope_section={section}: needs 3 parts summing to head_dim/2 = {hd // 2}")
    if getattr(tc, "use_sliding_window", False) or "sliding_attention" in (getattr(tc, "layer_types", None) or []):
        out.append("text_config.use_sliding_window/layer_types: sliding-window attention is not mapped")
    out += [f"text_config.{line}" for line in refusals(_synth_qwen2(cfg))]
    if getattr(vc, "hidden_act", "silu") not in ("silu", "swish"):
        out.append(f"vision_config.hidden_act={vc.hidden_act!r}: the tower's MLP is SwiGLU (silu) only")
    vrp = dict(getattr(vc, "rope_parameters", None) or {})
    if vrp.get("rope_type", "axial") != "axial":
        out.append(f"vision_config.rope_parameters.rope_type={vrp.get('rope_type')!r}: axial only")
    return out


def text_transformer_config(cfg, **kw):
    """``(TransformerConfig, synthesized Qwen2Config, mrope_section)`` for the decoder: Qwen2.5-VL's
    text model is Qwen2 (q/k/v biases, SwiGLU, RMSNorm) with M-RoPE, so it goes through the qwen2
    mapping plus ``mrope_section``. Raises naming every field :func:`vl_refusals` refuses."""
    from .config import rope_params, transformer_config_from_hf

    problems = vl_refusals(cfg)
    if problems:
        raise ValueError("unsupported HF config (qwen2_5_vl): " + "; ".join(problems))
    section = list(rope_params(cfg.text_config)["mrope_section"])
    q2 = _synth_qwen2(cfg)
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
        self.video_token_id = int(hf_config.video_token_id)
        self.spatial_merge = int(hf_config.vision_config.spatial_merge_size)
        self.freeze_vision = freeze_vision
        self.vision_model = VisionTower(tconf, hf_config.vision_config) if pre_process else None
        if self.vision_model is not None and freeze_vision:
            for p in self.vision_model.parameters():
                p.requires_grad_(False)

    def rope_index(self, input_ids: Tensor, image_grid_thw: Optional[Tensor],
                   attention_mask_2d: Optional[Tensor] = None) -> Tensor:
        """``[3, b, s]`` M-RoPE positions (see :func:`mrope_position_ids`); video is not supported yet."""
        if bool((input_ids == self.video_token_id).any()):
            raise NotImplementedError("Qwen2VLModel: video inputs (video_token_id) are not supported yet")
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


def vl_forward_logits(chunks, input_ids: Tensor, *, pixel_values: Optional[Tensor] = None,
                      image_grid_thw: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                      attention_mask: Optional[Tensor] = None) -> Optional[Tensor]:
    """Forward only, like :func:`megarl.models.builder.forward_logits` but with images: ``[b, s, vocab]``
    logits (TP-gathered, vocab padding removed) on the last pipeline stage, ``None`` elsewhere.

    M-RoPE positions are computed once here (every stage needs them; only the first has the tower).
    With pp > 1 it runs megatron's ``get_forward_backward_func()`` (one micro-batch, forward only),
    so activations travel between stages by megatron's p2p. Every rank of the model-parallel group
    calls it with the same inputs."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from .builder import unwrap

    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    if len(chunks) != 1:
        raise NotImplementedError("vl_forward_logits: virtual pipeline stages")
    model = unwrap(chunks[0])
    if position_ids is None:
        position_ids = model.rope_index(input_ids, image_grid_thw)
    kw = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw)

    def post(out: Tensor) -> Tensor:
        return gather_from_tensor_model_parallel_region(out)[..., :model.vocab_size]

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if mpu.get_pipeline_model_parallel_world_size() == 1:
                return post(model(input_ids, position_ids, attention_mask, **kw))

            def step(data_iter, m):
                next(data_iter)
                out = m(input_ids, position_ids, attention_mask, **kw)
                return out, lambda output, non_loss_data=True: post(output)

            b, s = input_ids.shape
            res = get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter([None]), model=model, num_microbatches=1,
                seq_length=s, micro_batch_size=b, forward_only=True, collect_non_loss_data=True)
        return res[0] if mpu.is_pipeline_last_stage(ignore_virtual=True) else None
    finally:
        model.train(was_training)
