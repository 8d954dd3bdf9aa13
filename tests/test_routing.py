"""MoE routing against transformers' own routers, and routing replay (R3) in megatron.

* DeepSeek-V3 group-limited routing: megatron's router with megarl's hook picks the same experts
  with the same gates as transformers' ``DeepseekV3TopkRouter`` for EVERY valid
  ``(n_routed_experts, n_group, topk_group, num_experts_per_tok)`` with up to 16 experts (HF needs
  >= 2 experts per group; top-k within the selected groups); megatron's own ``group_limited_topk``
  does not (it scores a group by its top ``topk // topk_group`` experts).
* Qwen3-MoE routing vs ``Qwen3MoeTopKRouter`` for both ``norm_topk_prob`` and every top-k.
* Replay: megatron logits with forced experts == HF logits with the same experts forced (TP1, EP2
  on 2 gloo ranks); the router still gets gradients, equal to normal routing's when the forced
  experts are the router's own.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import make_tiny_hf, sample_ids

from megarl.models.routing_replay import RouterHook, hf_group_limited_topk, layer_targets, overlap


def _valid_deepseek_combos(max_experts: int = 16):
    for experts in range(2, max_experts + 1):
        for groups in range(1, experts + 1):
            if experts % groups or experts // groups < 2:
                continue
            for topk_group in range(1, groups + 1):
                for top_k in range(2, topk_group * (experts // groups) + 1):
                    yield experts, groups, topk_group, top_k


def _megatron_routing(logits, bias, top_k, groups, topk_group, scaling, hook):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(logits, top_k, use_pre_softmax=True, num_groups=groups,
                                            group_topk=topk_group, scaling_factor=scaling, score_function="sigmoid",
                                            expert_bias=bias, router_replay=hook)


def test_deepseek_group_routing_equals_transformers_for_all_valid_configs():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    combos = list(_valid_deepseek_combos())
    assert len(combos) > 500
    native_differs = 0
    g = torch.Generator().manual_seed(0)
    for experts, groups, topk_group, top_k in combos:
        cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=experts, n_group=groups, topk_group=topk_group,
                               num_experts_per_tok=top_k, norm_topk_prob=True, routed_scaling_factor=2.5)
        router = DeepseekV3TopkRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(experts, 16, generator=g))
            router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.3)
        hidden = torch.randn(48, 16, generator=g)
        with torch.no_grad():
            logits, weights, idx = router(hidden)
        ref = torch.zeros(48, experts).scatter(1, idx, weights)
        probs, routing_map = _megatron_routing(logits, router.e_score_correction_bias, top_k, groups, topk_group,
                                               2.5, RouterHook(0))
        case = (experts, groups, topk_group, top_k)
        assert torch.equal(routing_map, ref > 0), case
        assert torch.allclose(probs, ref, atol=1e-6, rtol=1e-5), case
        native, _ = _megatron_routing(logits, router.e_score_correction_bias, top_k, groups, topk_group, 2.5, None)
        native_differs += int(not torch.allclose(native, ref, atol=1e-6, rtol=1e-5))
    # the hook is needed: megatron's own group scoring differs from HF's for many valid configs
    assert native_differs > len(combos) // 10, native_differs


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_routing_equals_transformers(norm):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Qwen3MoeConfig

    from megarl.models.config import qwen3_moe_pre_softmax, renormalized_top1
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(1)
    for experts in (2, 4, 6, 8):
        for top_k in range(1, experts + 1):
            router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=16, num_experts=experts, num_experts_per_tok=top_k,
                                                       norm_topk_prob=norm))
            with torch.no_grad():
                router.weight.copy_(torch.randn(experts, 16, generator=g))
                logits, weights, idx = router(torch.randn(32, 16, generator=g))
            ref = torch.zeros(32, experts).scatter(1, idx, weights)
            # megarl's mapping (models/config.py)
            hf_cfg = Qwen3MoeConfig(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
            hook = RouterHook(0, renormalize=renormalized_top1(hf_cfg))
            probs, _ = topk_routing_with_score_function(logits, top_k, use_pre_softmax=qwen3_moe_pre_softmax(hf_cfg),
                                                        score_function="softmax", router_replay=hook)
            assert torch.allclose(probs, ref, atol=1e-6), (experts, top_k, norm)


def test_hook_replays_recorded_experts_and_counts_agreement():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(10, 6, generator=g)
    natural = torch.topk(scores, 2, dim=1).indices
    forced = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(10)])
    valid = torch.ones(10, dtype=torch.bool)
    valid[-2:] = False                             # e.g. the last position of a sequence: no record
    hook = RouterHook(3)
    hook.set(forced, valid, replay=True, measure=True)
    gates, used = hook.get_replay_topk(scores, 2)
    assert torch.equal(used[:8], forced[:8]) and torch.equal(used[8:], natural[8:])
    assert torch.equal(gates, scores.gather(1, used))
    natural_overlap, exact, used_overlap, tokens = hook.take_stats().tolist()
    assert tokens == 8 and used_overlap == 8.0
    assert natural_overlap == pytest.approx(overlap(natural, forced)[:8].sum().item() / 2)
    assert exact == (overlap(natural, forced)[:8] == 2).sum().item()
    hook.set(forced, valid, replay=False, measure=True)  # measure only: the router keeps its choice
    gates, used = hook.get_replay_topk(scores, 2)
    assert torch.equal(used, natural)
    assert hook.take_stats()[2].item() == pytest.approx(natural_overlap)


def test_layer_targets_follow_megatron_token_order():
    routes = [torch.arange(3 * 2 * 1).view(3, 2, 1), torch.arange(100, 102).view(1, 2, 1)]  # [n_i, layers, k]
    experts, valid = layer_targets(routes, layer=1, batch=2, seq_len=4, top_k=1)
    # megatron flattens [s, b]: row = s * batch + b
    assert experts[:, 0].tolist() == [1, 101, 3, 0, 5, 0, 0, 0]
    assert valid.tolist() == [True, True, True, False, True, False, False, False]
    experts, valid = layer_targets(routes, layer=0, batch=2, seq_len=4, top_k=1, seq_slice=slice(2, 4))
    assert experts[:, 0].tolist() == [4, 0, 0, 0] and valid.tolist() == [True, False, False, False]


# ------------------------------------------------------------------------------------------------
# replay in a real megatron model vs HF with the same experts forced
# ------------------------------------------------------------------------------------------------

def _force_hf_routes(model, routes_by_layer: dict[int, torch.Tensor]):
    """Make each HF MoE router use the given experts ([b*s, k], HF's b-major token order) with
    its own gates for them, as replay does on the megatron side."""
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or i not in routes_by_layer:
            continue
        forced = routes_by_layer[i]

        def forward(hidden, gate=gate, forced=forced):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            w = probs.gather(1, forced)
            if gate.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(logits.dtype), forced
        gate.forward = forward


def _random_routes(b, s, layers, experts, k, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(layers)])
                         for _ in range(s)]) for _ in range(b)]        # per sample [s, layers, k]


def _replay_rank(rank, world, hf_dir, ids, routes, layouts):
    from megarl.models import build_model, forward_logits, load_hf_weights
    from megarl.models.routing_replay import set_routes, take_stats
    from megarl.parallel import destroy_model_parallel, init_model_parallel

    out = []
    for lay in layouts:
        init_model_parallel(**lay)
        chunks = build_model(hf_dir)
        load_hf_weights(chunks, hf_dir)
        natural = forward_logits(chunks, ids)
        set_routes(chunks[0], routes, tuple(ids.shape), replay=True, measure=True)
        replayed = forward_logits(chunks, ids)
        stats = take_stats(chunks[0])
        set_routes(chunks[0], None, tuple(ids.shape), replay=False, measure=False)
        out.append({"layout": lay, "natural": natural, "replayed": replayed, "stats": stats})
        destroy_model_parallel()
    return out


def test_replayed_megatron_logits_equal_hf_with_the_same_experts(tmp_path):
    from megarl.parallel import spawn

    hf = make_tiny_hf("qwen3_moe", tmp_path, mlp_only_layers=[])
    ids = sample_ids()
    b, s = ids.shape
    cfg = hf.config
    routes = _random_routes(b, s, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, seed=5)
    with torch.no_grad():
        natural_ref = hf(ids).logits
    _force_hf_routes(hf, {l: torch.cat([r[:, l] for r in routes]) for l in range(cfg.num_hidden_layers)})
    with torch.no_grad():
        forced_ref = hf(ids).logits
    assert (forced_ref - natural_ref).abs().max() > 1e-2  # the forced experts really change the output
    results = spawn(_replay_rank, 1, str(tmp_path), ids, routes, [dict(tp=1)])
    results += spawn(_replay_rank, 2, str(tmp_path), ids, routes, [dict(ep=2)])
    for rank_results in results:
        for r in rank_results:
            assert (r["natural"] - natural_ref).abs().max() < 1e-4, r["layout"]
            assert (r["replayed"] - forced_ref).abs().max() < 1e-4, r["layout"]
            # every token of every layer used the replayed experts
            for layer, (nat, exact, used, tokens) in r["stats"].items():
                assert tokens == b * s and used == tokens, (r["layout"], layer)


def _grad_rank(rank, world, hf_dir, ids, random_routes):
    from megarl.models import build_model, load_hf_weights
    from megarl.models.routing_replay import router_hooks, set_routes
    from megarl.parallel import init_model_parallel

    init_model_parallel(tp=1)
    model = build_model(hf_dir)[0]
    load_hf_weights([model], hf_dir)
    model.train()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)

    def router_grads(routes, record=False):
        model.zero_grad()
        for h in router_hooks(model):
            h.clear()
        if routes is not None:
            set_routes(model, routes, tuple(ids.shape), replay=True, measure=False)
        model(ids, pos, None).float().logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n}

    # the router's own choices, recorded in the [b, s] layout replay takes
    natural = {}
    for h in router_hooks(model):
        def grab(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None, h=h):
            gates, idx = torch.topk(scores, topk, dim=1)
            natural[h.layer] = idx.view(ids.shape[1], ids.shape[0], topk).transpose(0, 1)
            return gates, idx
        h.get_replay_topk = grab
    with torch.no_grad():
        model(ids, pos, None)
    for h in router_hooks(model):
        del h.get_replay_topk
    own = [torch.stack([natural[layer][i] for layer in sorted(natural)], dim=1) for i in range(ids.shape[0])]
    free = router_grads(None)
    replay_own = router_grads(own)
    replay_random = router_grads(random_routes)
    return free, replay_own, replay_random


def test_router_gets_gradients_under_replay(tmp_path):
    from megarl.parallel import spawn

    hf = make_tiny_hf("qwen3_moe", tmp_path)
    ids = sample_ids()
    cfg = hf.config
    routes = _random_routes(*ids.shape, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, seed=9)
    free, replay_own, replay_random = spawn(_grad_rank, 1, str(tmp_path), ids, routes)[0]
    assert free and free.keys() == replay_own.keys() == replay_random.keys()
    for name in free:
        assert free[name].abs().sum() > 0
        # replaying the router's own choices is normal routing, gradients included
        assert torch.allclose(free[name], replay_own[name], atol=1e-6), name
        # replaying other experts: the gates of those experts are trained instead
        assert torch.isfinite(replay_random[name]).all() and replay_random[name].abs().sum() > 0
        assert not torch.allclose(free[name], replay_random[name], atol=1e-6), name
