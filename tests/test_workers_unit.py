"""Worker building blocks (packed/padded inputs and shards are in test_packing.py): token-budget micro-batches, vocab-parallel logprobs
against a full-vocabulary reference (TP2 on 2 gloo ranks), mini-batching, pools."""
from __future__ import annotations

import pytest
import torch

from megarl.config import load_config
from megarl.placement import plan_pools
from megarl.data.packing import denominators, minibatches
from megarl.data.packing import split_by_token_budget
from tests.helpers.runs import DEFAULT


def test_token_budget_split_respects_budget_and_covers_all():
    lengths = [100, 20, 30, 90, 10, 300, 25, 25]
    groups = split_by_token_budget(lengths, max_tokens=200)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 200
    assert [5] in groups  # longer than the budget: alone
    assert groups == split_by_token_budget(lengths, max_tokens=200)


def test_minibatches_and_global_denominators():
    mbs = minibatches(10, 4, seed=0)
    assert sorted(sum(mbs, [])) == list(range(10)) and [len(b) for b in mbs] == [4, 6]
    mask = torch.tensor([[1, 1, 0]] * 5 + [[1, 0, 0]] * 5, dtype=torch.float32)
    dens = denominators(mask, [[0, 1], [5, 6, 7]])
    assert dens == [{"num_tokens": 4.0, "num_seqs": 2.0}, {"num_tokens": 3.0, "num_seqs": 3.0}]


def test_pools_colocated_and_disaggregated():
    cfg = load_config(DEFAULT.parent / "deepseek-v3-671b-grpo.yaml")
    pools = plan_pools(cfg)
    assert {n: (p.bundles, p.roles) for n, p in pools.items()} == {"actor": (128, ["actor"]), "rollout": (64, [])}
    cfg = load_config(DEFAULT.parent / "llama3.1-8b-ppo.yaml")
    (pool,) = plan_pools(cfg).values()
    assert pool.bundles == 8 and pool.roles == ["actor", "critic", "ref", "reward_model"] and pool.gpus_per_bundle == 1.0


def _vocab_parallel_rank(rank, world_size, logits, targets, vocab):
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.workers.vocab_parallel import logprobs_and_entropy

    apply_cpu_shim()
    init_model_parallel(tp=world_size)
    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(local, targets, vocab)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return lp.detach(), ent.detach(), local.grad


def test_vocab_parallel_logprobs_entropy_and_grads_match_full_softmax():
    from megarl.parallel import spawn

    torch.manual_seed(0)
    vocab, padded = 13, 16  # 3 padding rows on the second TP rank
    logits = torch.randn(2, 5, padded) * 3
    targets = torch.randint(0, vocab, (2, 5))
    out = spawn(_vocab_parallel_rank, 2, logits, targets, vocab)
    full = logits[..., :vocab].clone().requires_grad_(True)
    logp = torch.log_softmax(full, -1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    grad = torch.cat([out[0][2], out[1][2]], dim=-1)
    for lp, ent, _ in out:
        assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert torch.allclose(grad[..., :vocab], full.grad, atol=1e-5)
    assert grad[..., vocab:].abs().max() == 0  # padding rows get no gradient


@pytest.mark.parametrize("dtype,atol,with_entropy,fusions", [
    (torch.float32, 1e-5, True, "0"), (torch.float32, 1e-5, False, "0"), (torch.bfloat16, 2e-2, True, "0"),
    (torch.bfloat16, 2e-2, True, "force")])
def test_fused_logprobs_match_log_softmax_across_row_chunks(monkeypatch, dtype, atol, with_entropy, fusions):
    """The chunked fused function equals log_softmax/entropy and their autograd gradients, also when
    the rows are split into several uneven chunks, and returns the gradient in the logits' dtype;
    ``force`` runs the torch.compile'd chunk kernels (CUDA's path) through inductor's CPU backend."""
    import megarl.workers.vocab_parallel as vp

    monkeypatch.setenv("MEGARL_FUSIONS", fusions)

    monkeypatch.setattr(vp, "_CHUNK_ELEMENTS", 3 * 50)  # 3 rows of 50 columns per chunk: 7 rows -> 3 chunks
    monkeypatch.setattr(vp, "_COMPILED_CHUNK_ELEMENTS", 3 * 50)
    torch.manual_seed(1)
    logits = (torch.randn(7, 50) * 4).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 50, (7,))
    w_lp, w_ent = torch.randn(7), torch.randn(7)
    lp, ent = vp.logprobs_and_entropy(logits, targets, 50, with_entropy=with_entropy)
    loss = (w_lp * lp).sum() + ((w_ent * ent).sum() if with_entropy else 0)
    loss.backward()
    ref_in = logits.detach().float().requires_grad_(True)
    logp = torch.log_softmax(ref_in, -1)
    ref_lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ((w_lp * ref_lp).sum() + ((w_ent * ref_ent).sum() if with_entropy else 0)).backward()
    assert lp.dtype == torch.float32 and logits.grad.dtype == dtype
    assert torch.allclose(lp, ref_lp, atol=1e-5)
    assert (ent is None) != with_entropy
    if with_entropy:
        assert torch.allclose(ent, ref_ent, atol=1e-5)
    assert torch.allclose(logits.grad.float(), ref_in.grad, atol=atol)
