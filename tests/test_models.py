"""megarl.models: megatron logits == HF transformers logits for every family, at TP1 and at TP2,
PP2 (+VPP for llama) and EP2 (MoE families); iter_hf_weights returns the exact HF tensors from
every layout; critic value head; naming transforms; config mapping."""
import os

import pytest
import torch

from dist_utils import hf_logits, make_tiny_hf, sample_ids, tiny_hf_config

from megarl.parallel import spawn

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]
TOL = 1e-4


def test_detect_family_and_config_mapping():
    from megarl.models import detect_family, transformer_config_from_hf
    for fam in FAMILIES:
        cfg = tiny_hf_config(fam)
        assert detect_family(cfg) == fam
        tc = transformer_config_from_hf(cfg, tp=1, pp=1, ep=1, etp=1, vpp=None,
                                        params_dtype=torch.float32)
        assert tc.num_layers == cfg.num_hidden_layers and tc.hidden_size == 64
        assert tc.normalization == "RMSNorm" and tc.gated_linear_unit
    assert transformer_config_from_hf(tiny_hf_config("qwen2")).add_qkv_bias
    assert transformer_config_from_hf(tiny_hf_config("qwen3")).qk_layernorm
    moe = transformer_config_from_hf(tiny_hf_config("qwen3_moe", mlp_only_layers=[1]))
    assert moe.num_moe_experts == 4 and moe.moe_layer_freq == [1, 0]
    ds = transformer_config_from_hf(tiny_hf_config("deepseek_v3"))
    assert ds.multi_latent_attention and ds.moe_router_score_function == "sigmoid"
    assert ds.moe_router_enable_expert_bias and ds.moe_layer_freq == [0, 1]
    assert ds.moe_router_num_groups == 2 and ds.moe_router_group_topk == 1
    assert ds.moe_shared_expert_intermediate_size == 32
    with pytest.raises(ValueError, match="unsupported model_type"):
        from transformers import GPT2Config
        detect_family(GPT2Config())


def test_qkv_and_glu_transforms_roundtrip():
    from megarl.models.naming import Rule, hf_to_local, local_to_hf, fuse_qkv, split_qkv
    cfg = tiny_hf_config("llama")  # 4 heads, 2 kv groups, head_dim 16
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    fused = fuse_qkv(q, k, v, cfg)
    # group 0 = q heads 0,1 then k0 then v0
    assert torch.equal(fused[:32], q[:32]) and torch.equal(fused[32:48], k[:16])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, cfg), (q, k, v)))
    rule = Rule("x", ["g", "u"], "glu")
    g, u = torch.randn(8, 4), torch.randn(8, 4)
    shards = [hf_to_local(rule, [g, u], cfg, tp_rank=r, tp_size=2, partition_dim=0,
                          local_shape=(8, 4)) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([g[4:], u[4:]]))
    g2, u2 = local_to_hf(rule, shards, cfg, partition_dim=0)
    assert torch.equal(g, g2) and torch.equal(u, u2)


def _parity(rank, world, hf_dir, ids, ref, layouts, ref_state, mask_case):
    """For each layout: build, load HF weights, compare logits on the last stage, and re-export
    every HF tensor with iter_hf_weights."""
    from megarl.models import build_model, forward_logits, iter_hf_weights, load_hf_weights
    from megarl.parallel import destroy_model_parallel, init_model_parallel
    out = []
    for lay in layouts:
        init_model_parallel(**lay)
        chunks = build_model(hf_dir, vpp=lay.get("vpp"))
        load_hf_weights(chunks, hf_dir)
        logits = forward_logits(chunks, ids)
        diff = None if logits is None else (logits - ref).abs().max().item()
        exported = {n: t for n, t in iter_hf_weights(chunks)}
        bad = [n for n, t in exported.items() if not torch.equal(t, ref_state[n])]
        masked = None
        if mask_case is not None and logits is not None:
            m_ids, m_mask, m_ref = mask_case
            # megatron mask convention: True = masked; [b, 1, s, s] from key padding
            key_pad = ~m_mask.bool()
            am = key_pad[:, None, None, :].expand(-1, 1, m_ids.shape[1], -1)
            pos = (m_mask.cumsum(-1) - 1).clamp(min=0)
            lg = forward_logits(chunks, m_ids, position_ids=pos, attention_mask=am)
            keep = m_mask.bool()
            masked = (lg[keep] - m_ref[keep]).abs().max().item()
        out.append({"layout": lay, "diff": diff, "names": sorted(exported), "bad": bad,
                    "masked": masked})
        destroy_model_parallel()
    return out


def _check(results, hf_names):
    by_layout = {}
    for rank_res in results:
        for r in rank_res:
            by_layout.setdefault(str(r["layout"]), []).append(r)
    for lay, rs in by_layout.items():
        diffs = [r["diff"] for r in rs if r["diff"] is not None]
        assert diffs, f"{lay}: no rank produced logits"
        assert max(diffs) < TOL, f"{lay}: max |megatron - HF| = {max(diffs)}"
        names = [n for r in rs for n in r["names"]]
        assert len(names) == len(set(names)), f"{lay}: a tensor was yielded by two ranks"
        assert set(names) == hf_names, f"{lay}: {sorted(set(names) ^ hf_names)}"
        assert not [b for r in rs for b in r["bad"]], f"{lay}: re-exported tensors differ"
        for r in rs:
            if r["masked"] is not None:
                assert r["masked"] < TOL, f"{lay}: padded batch differs: {r['masked']}"


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_tp1_tp2_pp2_ep2(family, tmp_path):
    from megarl.models.naming import SafetensorsSource
    kw = {"num_hidden_layers": 4} if family == "llama" else {}
    model = make_tiny_hf(family, tmp_path, **kw)
    ids = sample_ids()
    ref = hf_logits(model, ids)
    src = SafetensorsSource(tmp_path)
    ref_state = dict(src.read(src.names()))
    mask_case = None
    if family in ("llama", "qwen2"):  # left-padded batch with an attention mask
        m_ids = sample_ids(seed=3)
        m_mask = torch.ones_like(m_ids)
        m_mask[0, :4] = 0
        with torch.no_grad():
            m_ref = model(m_ids, attention_mask=m_mask).logits
        mask_case = (m_ids, m_mask, m_ref)
    _check(spawn(_parity, 1, str(tmp_path), ids, ref, [dict(tp=1)], ref_state, mask_case),
           set(ref_state))
    layouts = [dict(tp=2), dict(pp=2)]
    if family == "llama":
        layouts.append(dict(pp=2, vpp=2))
    if family in ("qwen3_moe", "deepseek_v3"):
        layouts.append(dict(ep=2))
        layouts.append(dict(tp=2, ep=2))
    _check(spawn(_parity, 2, str(tmp_path), ids, ref, layouts, ref_state, None), set(ref_state))


def _critic(rank, world, hf_dir, ids):
    from megarl.models import build_model, forward_logits, iter_hf_weights, load_hf_weights
    from megarl.parallel import init_model_parallel
    init_model_parallel(tp=2)
    chunks = build_model(hf_dir, value_head=True)
    load_hf_weights(chunks, hf_dir)  # trunk from the LM; score.weight absent -> keeps init
    with torch.no_grad():
        chunks[0].output_layer.weight.fill_(0.01)
    values = forward_logits(chunks, ids)
    names = [n for n, _ in iter_hf_weights(chunks)]
    return tuple(values.shape), "score.weight" in names, "lm_head.weight" in names, \
        bool(torch.isfinite(values).all())


def test_critic_value_head(tmp_path):
    make_tiny_hf("qwen2", tmp_path)
    ids = sample_ids()
    res = spawn(_critic, 2, str(tmp_path), ids)
    assert res[0] == ((2, 12), True, False, True)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_compiled_fusions_keep_hf_parity(family, tmp_path):
    """The CUDA fusion path (compiled RMSNorm incl. Qwen3's q/k norms, compiled RoPE, megatron's
    compiled SwiGLU) forced on and compiled by inductor's CPU backend: same weight names, logits
    equal HF's (fp32)."""
    from megarl.models.naming import SafetensorsSource
    model = make_tiny_hf(family, tmp_path)
    ids = sample_ids()
    src = SafetensorsSource(tmp_path)
    ref_state = dict(src.read(src.names()))
    _check(spawn(_fused_parity, 1, str(tmp_path), ids, hf_logits(model, ids), ref_state), set(ref_state))


def _fused_parity(rank, world, hf_dir, ids, ref, ref_state):
    # set here, in the rank: a forkserver started by an earlier test would not see the parent's env
    os.environ["MEGARL_FUSIONS"] = "force"
    from megarl.models import build_model
    from megarl.models.fusions import CompiledRMSNorm
    from megarl.parallel import destroy_model_parallel, init_model_parallel
    from megatron.core.models.common.embeddings import rope_utils

    out = _parity(rank, world, hf_dir, ids, ref, [dict(tp=1)], ref_state, None)
    init_model_parallel(tp=1)
    model = build_model(hf_dir)[0]
    destroy_model_parallel()
    norms = [m for m in model.modules() if isinstance(m, CompiledRMSNorm)]
    layer0 = model.decoder.layers[0]
    assert norms and isinstance(layer0.input_layernorm, CompiledRMSNorm)
    assert model.config.bias_activation_fusion
    assert getattr(rope_utils._apply_rotary_pos_emb_bshd, "_megarl_compiled", False)
    return out
