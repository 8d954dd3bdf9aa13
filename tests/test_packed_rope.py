"""RoPE on packed (THD) micro-batches: megarl's replacement of megatron's THD RoPE gives megatron's
own result, gathers each micro-batch's per-token frequencies once for all layers (the launch count
of the train phase, benchmarks/RESULTS.md, train phase host cost), and never reuses them across a changed
``cu_seqlens`` or from ``inference_mode`` into a graph that needs a backward. The model-level check
compares a packed megatron forward with HF transformers' forward of each sequence alone."""
from __future__ import annotations

import pytest
import torch

from dist_utils import make_tiny_hf

from megarl.parallel import spawn
from megarl.profiling import OpCounter


class _OneRank:
    """The two calls megatron's THD RoPE makes on its ``cp_group`` (context parallel size 1)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _stock_thd():
    from megarl.models import packed
    packed.install_thd_rope()
    return packed._ORIGINAL_THD


def _freqs(max_len: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    ang = torch.outer(torch.arange(max_len).float(), inv)
    return torch.cat([ang, ang], -1)[:, None, None, :]


def test_packed_rope_equals_megatron_and_reuses_rows_only_for_the_same_micro_batch():
    from megarl.models.packed import apply_rotary_pos_emb_thd, pack_params, token_freqs

    stock = _stock_thd()
    lens = [5, 1, 9, 3]
    params = pack_params(lens)
    cu = params.cu_seqlens_q
    total = sum(lens)
    freqs = _freqs(16, 8)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, 3, 8, generator=g)
    k = torch.randn(total, 1, 8, generator=g)
    for t in (q, k):
        ours = apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_OneRank())
        theirs = stock(t, cu, freqs, cp_group=_OneRank())
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)

    rows = token_freqs(freqs, cu, total)
    assert token_freqs(freqs, cu, total) is rows  # the same micro-batch: gathered once
    # another frequency table (another rotary length) is not served the old rows
    other = _freqs(20, 8) * 2
    torch.testing.assert_close(token_freqs(other, cu, total), other[[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                      0, 1, 2]])
    # the same cu_seqlens tensor rewritten in place (other lengths, same total): rows follow it
    cu.copy_(pack_params([2, 16]).cu_seqlens_q[[0, 1, 2, 2, 2]])
    t2 = torch.randn(total, 3, 8, generator=g)
    torch.testing.assert_close(apply_rotary_pos_emb_thd(t2, cu, freqs, cp_group=_OneRank()),
                               stock(t2, cu, freqs, cp_group=_OneRank()), rtol=0, atol=1e-6)


def test_kept_rows_are_one_micro_batch_and_die_with_it():
    """Only the running micro-batch's rows are kept: the next micro-batch's replace them (a phase's
    micro-batches all live on the device together), and they go when its cu_seqlens goes."""
    import gc
    import weakref

    from megarl.models.packed import pack_params, token_freqs

    freqs = _freqs(16, 8)
    first, second = pack_params([5, 9]), pack_params([7, 3, 4])
    rows_first = weakref.ref(token_freqs(freqs, first.cu_seqlens_q, 14))
    assert rows_first() is not None                         # kept while its micro-batch runs
    rows_second = weakref.ref(token_freqs(freqs, second.cu_seqlens_q, 14))
    gc.collect()
    assert rows_first() is None and rows_second() is not None  # replaced, though `first` still lives
    del second
    gc.collect()
    assert rows_second() is None                            # gone with its micro-batch
    # and a live micro-batch whose rows were replaced gets correct rows again
    torch.testing.assert_close(token_freqs(freqs, first.cu_seqlens_q, 14),
                               freqs[[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8]])


def test_rows_gathered_in_inference_mode_are_not_used_for_a_backward():
    from megarl.models.packed import apply_rotary_pos_emb_thd, pack_params

    params = pack_params([4, 6])
    freqs = _freqs(8, 4)
    x = torch.randn(10, 2, 4)
    with torch.inference_mode():
        apply_rotary_pos_emb_thd(x, params.cu_seqlens_q, freqs, cp_group=_OneRank())
    xg = x.clone().requires_grad_(True)
    out = apply_rotary_pos_emb_thd(xg, params.cu_seqlens_q, freqs, cp_group=_OneRank())
    out.square().sum().backward()  # raises if an inference tensor was saved for backward
    ref = _stock_thd()(x, params.cu_seqlens_q, freqs, cp_group=_OneRank())
    torch.testing.assert_close(out.detach(), ref, rtol=0, atol=1e-6)


def _packed_forward(rank, world, hf_dir, seqs):
    from megarl.models import build_model, load_hf_weights
    from megarl.models.packed import pack_sequences
    from megarl.parallel import destroy_model_parallel, init_model_parallel

    init_model_parallel(tp=1)
    model = build_model(hf_dir)[0]
    load_hf_weights([model], hf_dir)
    ids, pos, params = pack_sequences(seqs)
    layers = len(model.decoder.layers)
    counter = OpCounter()
    with counter:
        with torch.no_grad():  # the workers' forward-only passes (old / reference logprobs)
            first = model(ids, pos, None, packed_seq_params=params)
        logits = model(ids, pos, None, packed_seq_params=params)
    logits.float().square().mean().backward()  # the train pass on the same micro-batch
    destroy_model_parallel()
    return {"logits": logits.detach().reshape(ids.shape[1], -1)[:, :first.shape[-1]].clone(),
            "same_as_no_grad": bool(torch.equal(first, logits.detach())),
            "searchsorted": counter.ops["aten.searchsorted"], "host_reads": counter.host_reads, "layers": layers}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_forward_gathers_rope_rows_once_and_equals_hf_per_sequence(family, tmp_path):
    hf = make_tiny_hf(family, tmp_path)
    g = torch.Generator().manual_seed(3)
    lens = [7, 3, 11]
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in lens]
    res = spawn(_packed_forward, 1, str(tmp_path), [s.tolist() for s in seqs])[0]
    assert res["layers"] >= 2
    # the per-token rows of the micro-batch: gathered once for both passes, not for q and k of
    # every layer in each pass (that was 2 x layers x 2 searchsorted)
    assert res["searchsorted"] == 1, res
    assert res["same_as_no_grad"]
    assert res["host_reads"] == 0, res  # megatron's own THD RoPE reads cu_seqlens back per layer
    start = 0
    for s in seqs:
        with torch.no_grad():
            ref = hf(s[None]).logits[0].float()
        ours = res["logits"][start:start + len(s), :ref.shape[-1]]
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)
        start += len(s)
