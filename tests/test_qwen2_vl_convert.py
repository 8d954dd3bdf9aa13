"""Qwen2.5-VL through megarl's checkpoint conversion: HF folder -> megatron torch_dist at TP2 (gloo)
-> HF folder at TP1. The exported tensors equal the source bit for bit (the vision MLP's fused
gate/up and the per-head vision qkv re-shard across TP sizes), and transformers loads the export
with ``from_pretrained`` and computes the same logits. Kept apart from test_qwen2_vl_model.py so
each file stays short (this one ~30 s on 2 CPU cores).
"""
from __future__ import annotations

import torch

from dist_utils import randomize_
from test_qwen2_vl_model import _hf_config, _inputs, _mm_types


def test_convert_tp2_roundtrip_bit_exact(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
    from megarl.models.naming import SafetensorsSource

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(_hf_config()).float().eval()
    randomize_(model, seed=0)
    model.save_pretrained(tmp_path / "hf")
    ids, pixels, grid = _inputs()
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=_mm_types(ids)).logits

    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=2, verbose=False, timeout_s=300)
    convert_megatron_to_hf(tmp_path / "mg", tmp_path / "back", tp=1, verbose=False, timeout_s=300)

    src, back = SafetensorsSource(tmp_path / "hf"), SafetensorsSource(tmp_path / "back")
    assert back.names() == src.names()
    a, b = dict(src.read(src.names())), dict(back.read(back.names()))
    assert not [n for n in a if not torch.equal(a[n], b[n])]
    again = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        out = again(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=_mm_types(ids)).logits
    assert torch.equal(out, ref)
