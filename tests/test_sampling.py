"""The embedded engine's batched seeded sampler: right distribution, reproducible per request
whatever the batch it runs in, filters respected."""
from __future__ import annotations

import torch

from megarl.engine.engine import Request, Sampling, sample


def _req(seed: int, produced: int = 0, **params) -> Request:
    r = Request(input_ids=[1], sampling=Sampling.from_dict({"sampling_seed": seed, **params}))
    r.output_ids = [0] * produced
    return r


def test_sampled_frequencies_match_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    probs = torch.softmax(logits[0] / 0.7, -1)
    counts = torch.zeros(5)
    for seed in range(4000):
        (token,), _ = sample(logits, [_req(seed, temperature=0.7)], torch.Generator().manual_seed(0))
        counts[token] += 1
    freq = counts / counts.sum()
    assert (freq - probs).abs().max() < 0.03, (freq, probs)  # 4000 draws: std <= 0.008


def test_same_seed_and_step_same_token_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    gen = torch.Generator().manual_seed(0)
    alone = [sample(logits[i:i + 1], [_req(100 + i, produced=i)], gen)[0][0] for i in range(6)]
    batched, _ = sample(logits, [_req(100 + i, produced=i) for i in range(6)], gen)
    assert alone == batched
    other_step, _ = sample(logits[:1], [_req(100, produced=7)], gen)
    different = sum(sample(logits[:1], [_req(100, produced=k)], gen)[0][0] != alone[0] for k in range(1, 30))
    assert different > 10  # the noise changes with the step
    assert isinstance(other_step[0], int)


def test_top_k_and_top_p_exclude_tokens_and_logprobs_stay_unfiltered():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    seen_k, seen_p = set(), set()
    for seed in range(300):
        (t,), (lp,) = sample(logits, [_req(seed, top_k=2)], torch.Generator())
        seen_k.add(t)
        assert abs(lp - torch.log_softmax(logits[0], -1)[t].item()) < 1e-6
        (t,), _ = sample(logits, [_req(seed, top_p=0.5)], torch.Generator())
        seen_p.add(t)
    assert seen_k == {0, 1}
    assert seen_p == {0}  # p(token 0) = 0.64 > 0.5 alone


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0]])
    tokens, _ = sample(logits, [_req(1, temperature=0.0), _req(2, top_k=1)], torch.Generator())
    assert tokens == [1, 0]


def test_fast_noise_has_the_reference_bits():
    """The int32 hash path the sampler uses gives exactly the int64 reference's noise (and so the
    tokens seeded requests got before it)."""
    from megarl.engine.sampler import _fast_ok, _gumbel_fast, _gumbel_reference, seeded_gumbel

    g = torch.Generator().manual_seed(3)
    seeds = torch.cat([torch.randint(0, 2**31 - 1, (6,), generator=g), torch.tensor([0, 2**31 - 1, -5, 2**40])])
    steps = torch.randint(0, 5000, (10,), generator=g)
    ref = _gumbel_reference(seeds, steps, 49152)
    assert _fast_ok(seeds.device)
    assert torch.equal(_gumbel_fast(seeds, steps, 49152), ref)
    assert torch.equal(seeded_gumbel(seeds, steps, 49152), ref)
