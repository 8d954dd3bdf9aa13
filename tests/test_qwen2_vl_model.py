"""Qwen2.5-VL on megatron-core (megarl/models/qwen2_vl.py) against transformers'
``Qwen2_5_VLForConditionalGeneration``: a tiny random model (2 decoder layers, a 4-block vision
tower with one full-attention block, two images of different grids, one of them spanning two
attention windows) saved with ``save_pretrained``, loaded into megatron at TP1, TP2 and PP2 (gloo):
fp32 logits with images (and the text-only path through ``forward_logits``), the tower alone,
bit-exact export back to HF names, transformers 5's in-memory names accepted on load, the frozen
tower gets no gradients, an unfrozen one gets HF's gradients (every parameter), the M-RoPE index
equals HF's ``get_rope_index``, and the config audit refuses what is not mapped.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import randomize_

from megarl.parallel import spawn

TOL = 1e-5
GRAD_TOL = 1e-4   # max |megatron - HF| / max |HF| per parameter gradient, fp32
IMG, VID, VS, VE = 120, 121, 122, 123
GRIDS = [(1, 6, 4), (1, 4, 8)]        # (t, h, w) patches; LM tokens = t*h*w/4: 6 and 8
PATCH_DIM = 3 * 2 * 4 * 4             # channels * temporal_patch * patch * patch


def _hf_config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[2]),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        tie_word_embeddings=False)


def _inputs():
    """Two sequences of 24 tokens: text, <vs> image <ve>, text; image 0 in row 0, image 1 in row 1."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, (t, h, w) in enumerate(GRIDS):
        n_img = t * h * w // 4
        pre = 3 + 2 * i
        post = 24 - pre - n_img - 2
        txt = torch.randint(0, 110, (pre + post,), generator=g)
        rows.append(torch.cat([txt[:pre], torch.tensor([VS] + [IMG] * n_img + [VE]), txt[pre:]]))
    ids = torch.stack(rows)
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=g)
    return ids, pixels, grid


def _mm_types(ids):
    return (ids == IMG).int() + 2 * (ids == VID).int()


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    d = tmp_path_factory.mktemp("qwen2_5_vl")
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(_hf_config()).float().eval()
    randomize_(model, seed=0)
    model.save_pretrained(d)
    ids, pixels, grid = _inputs()
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=_mm_types(ids)).logits
        # the case is sensitive to what is tested: 1-D positions or no image features change the logits
        flat = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits   # no mm types: 1-D RoPE
        text_only = model(input_ids=ids).logits
    assert (flat - ref).abs().max() > 1e-3 and (text_only - ref).abs().max() > 1e-3
    # the tower alone on one 4x4-patch image: a single window == the whole image (unpadded segments)
    px_one = torch.randn(16, PATCH_DIM, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        tower_ref = model.model.visual(px_one, grid_thw=torch.tensor([[1, 4, 4]])).pooler_output
    # HF's gradients of a fixed linear function of the logits, under Hub names, for the unfrozen tower too
    w_loss = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    (model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=_mm_types(ids)).logits
     * w_loss).sum().backward()
    hub = {"model.language_model.": "model.", "model.visual.": "visual."}
    grads = {}
    for n, p in model.named_parameters():
        for mem, h in hub.items():
            n = h + n[len(mem):] if n.startswith(mem) else n
        grads[n] = p.grad.detach().clone()
    model.zero_grad()
    # the same weights under transformers 5's in-memory names (model.language_model.*, model.visual.*)
    from safetensors.torch import save_file
    mem = d / "memory_names"
    mem.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(mem / "model.safetensors"))
    (mem / "config.json").write_text((d / "config.json").read_text())
    from megarl.models.naming import SafetensorsSource
    src = SafetensorsSource(d)
    return {"dir": str(d), "mem_dir": str(mem), "ref": ref, "inputs": (ids, pixels, grid),
            "state": dict(src.read(src.names())), "model": model, "w_loss": w_loss, "grads": grads,
            "tower_case": (px_one, tower_ref), "text_only": text_only}


def _worker(rank, world, layouts, hf_dir, mem_dir, inputs, ref, ref_state, w_loss, hf_grads, tower_case,
            text_only):
    from megarl.models import build_model, forward_logits
    from megarl.models.naming import iter_hf_weights, load_hf_weights, local_to_hf, param_infos
    from megarl.models.qwen2_vl import Qwen2VLModel, build_qwen2_vl, vl_forward_logits
    from megarl.parallel import destroy_model_parallel, init_model_parallel

    ids, pixels, grid = inputs
    results = []
    for lay in layouts:
        init_model_parallel(**lay)
        out = {"layout": str(lay)}
        (model,) = build_model(hf_dir)        # detect_family -> qwen2_5_vl -> build_qwen2_vl
        assert isinstance(model, Qwen2VLModel)
        load_hf_weights([model], hf_dir)
        logits = vl_forward_logits([model], ids, pixel_values=pixels, image_grid_thw=grid)
        out["diff"] = None if logits is None else (logits - ref).abs().max().item()
        # megarl's text path (forward_logits: 2-D positions, no pixels) equals HF given input_ids only
        text = forward_logits([model], ids)
        out["text_diff"] = None if text is None else (text - text_only).abs().max().item()
        exported = dict(iter_hf_weights([model], yield_on_all_ranks=True))
        out["names"] = sorted(exported)
        out["bad"] = [n for n, t in exported.items() if not torch.equal(t, ref_state[n])]
        # transformers 5's in-memory layout loads into the same parameters
        (model2,) = build_qwen2_vl(mem_dir)
        load_hf_weights([model2], mem_dir)
        p1 = dict(model.named_parameters())
        out["mem_bad"] = [n for n, p in model2.named_parameters() if not torch.equal(p, p1[n])]
        if model.vision_model is not None:
            with torch.no_grad():
                tower = model.vision_model(tower_case[0], torch.tensor([[1, 4, 4]]))
            out["tower_diff"] = (tower - tower_case[1]).abs().max().item()
        if lay.get("pp", 1) == 1:
            # freeze_vision (default): one backward, the tower has no grads, the decoder has
            model.train()
            model(ids, pixel_values=pixels, image_grid_thw=grid).float().pow(2).mean().backward()
            out["vision_grads"] = [n for n, p in model.vision_model.named_parameters() if p.grad is not None]
            out["vision_trainable"] = [n for n, p in model.vision_model.named_parameters() if p.requires_grad]
            out["decoder_grad"] = model.decoder.layers[0].self_attention.linear_qkv.weight.grad is not None
        if world == 1:   # an unfrozen tower trains: every gradient equals HF's (decoder, merge, tower)
            (model3,) = build_qwen2_vl(hf_dir, freeze_vision=False)
            load_hf_weights([model3], hf_dir)
            (model3(ids, pixel_values=pixels, image_grid_thw=grid).float() * w_loss).sum().backward()
            out["unfrozen_no_grad"] = [n for n, p in model3.vision_model.named_parameters() if p.grad is None]
            rel = {}
            for info in param_infos(model3):
                got = local_to_hf(info.rule, [info.tensor.grad], model3.hf_config, partition_dim=None,
                                  vocab_size=model3.vocab_size)
                for n, g in zip(info.rule.hf_names, got):
                    rel[n] = ((g - hf_grads[n]).abs().max() / hf_grads[n].abs().max().clamp(min=1e-30)).item()
            out["grad_rel"] = rel
        destroy_model_parallel()
        results.append(out)
    return results


def _check(per_rank, ref_state):
    by_layout: dict = {}
    for results in per_rank:
        for r in results:
            by_layout.setdefault(r["layout"], []).append(r)
    for lay, rs in by_layout.items():
        diffs = [r["diff"] for r in rs if r["diff"] is not None]
        assert diffs and max(diffs) < TOL, f"{lay}: max |megatron - HF| logits = {diffs}"
        text = [r["text_diff"] for r in rs if r["text_diff"] is not None]
        assert text and max(text) < TOL, f"{lay}: text-only logits differ from HF's: {text}"
        names = {n for r in rs for n in r["names"]}
        assert names == set(ref_state), f"{lay}: {sorted(names ^ set(ref_state))}"
        for r in rs:
            assert not r["bad"], f"{lay}: re-exported tensors differ: {r['bad']}"
            assert not r["mem_bad"], f"{lay}: in-memory-named checkpoint loaded differently: {r['mem_bad']}"
            if "tower_diff" in r:
                assert r["tower_diff"] < TOL, f"{lay}: tower alone differs from HF's visual: {r['tower_diff']}"
            if "vision_grads" in r:
                assert not r["vision_grads"] and not r["vision_trainable"], r["vision_grads"] or r["vision_trainable"]
                assert r["decoder_grad"]
            assert not r.get("unfrozen_no_grad"), r.get("unfrozen_no_grad")
            if "grad_rel" in r:
                assert set(r["grad_rel"]) == set(ref_state)
                worst = max(r["grad_rel"].items(), key=lambda kv: kv[1])
                assert worst[1] < GRAD_TOL, f"{lay}: gradient differs from HF's: {worst}"


def _run(case, world, layouts):
    return spawn(_worker, world, layouts, case["dir"], case["mem_dir"], case["inputs"], case["ref"], case["state"],
                 case["w_loss"], case["grads"], case["tower_case"], case["text_only"], timeout_s=300)


def test_logits_export_freeze_tp1(hf_case):
    _check(_run(hf_case, 1, [dict(tp=1)]), hf_case["state"])


def test_logits_export_tp2_pp2(hf_case):
    """TP2 (vision heads, MLPs and merger split over 2 gloo ranks) and PP2 (tower on stage 0)."""
    _check(_run(hf_case, 2, [dict(tp=2), dict(pp=2)]), hf_case["state"])


def test_mrope_index_matches_hf(hf_case):
    from megarl.models.qwen2_vl_vision import mrope_position_ids

    hf = hf_case["model"].model
    ids, _, grid = hf_case["inputs"]
    ref, ref_d = hf.get_rope_index(ids, _mm_types(ids), image_grid_thw=grid)
    pos, d = mrope_position_ids(ids, grid, IMG, 2)
    assert torch.equal(pos, ref) and torch.equal(d, ref_d)
    # left padding
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ref, ref_d = hf.get_rope_index(ids, _mm_types(ids), image_grid_thw=grid, attention_mask=mask)
    pos, d = mrope_position_ids(ids, grid, IMG, 2, attention_mask=mask)
    assert torch.equal(pos, ref) and torch.equal(d, ref_d)


def test_vision_qkv_layout_roundtrip():
    from megarl.models.naming import vision_qkv_from_heads, vision_qkv_to_heads

    cfg = _hf_config()
    w = torch.randn(96, 32)
    b = torch.randn(96)
    for t in (w, b):
        h = vision_qkv_to_heads(t, cfg)
        assert torch.equal(vision_qkv_from_heads(h, cfg), t)
        # head 0 of the per-head layout is (q0, k0, v0)
        assert torch.equal(h[:48], torch.cat([t[0:16], t[32:48], t[64:80]]))


def test_config_audit():
    """The family is detected; the tiny config's fields are all audited (only the "runs do not take
    VL yet" line is refused); values megarl cannot compute are refused by name."""
    from transformers import Qwen2_5_VLConfig

    from megarl.models import detect_family
    from megarl.models.hf_audit import refusals
    from megarl.models.qwen2_vl import vl_refusals

    cfg = _hf_config()
    assert detect_family(cfg) == "qwen2_5_vl"
    assert vl_refusals(cfg) == []
    assert len(refusals(cfg)) == 1 and "RL runs do not take" in refusals(cfg)[0]
    d = cfg.to_dict()
    d["vision_config"]["hidden_act"] = "gelu"
    d["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    d["vision_config"]["new_field"] = 1
    bad = vl_refusals(Qwen2_5_VLConfig(**{k: v for k, v in d.items() if k != "model_type"}))
    for field in ("vision_config.hidden_act", "mrope_section", "vision_config.new_field"):
        assert any(field in line for line in bad), bad
