"""The embedded engine's Triton decode step (engine/kernels.py, engine/fused_decode.py).

Checked on CPU under Triton's own interpreter (TRITON_INTERPRET=1 runs the same kernel code on CPU
tensors) against independent references: torch's scaled_dot_product_attention, the engine's torch
decode body (the path every other forward uses) and HF transformers' generate. On a GPU the same
tests run compiled (no interpreter) when CUDA is there.
"""
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.servers import make_tiny_hf_model

CUDA = torch.cuda.is_available()


@pytest.fixture
def kernels():
    """megarl.engine.kernels: compiled on a GPU machine, interpreted on CPU (tests/conftest.py sets
    TRITON_INTERPRET before triton is first imported: it cannot be switched on afterwards)."""
    if not CUDA:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run under tests/conftest.py (TRITON_INTERPRET=1)"
    import megarl.engine.kernels as k
    return k


DEV = "cuda" if CUDA else "cpu"


def _model(path, mode):
    from transformers import AutoConfig

    from megarl.engine.model import DecoderModel
    m = DecoderModel(AutoConfig.from_pretrained(path), device=DEV, dtype=torch.float32)
    m.load_hf_dir(path)
    m.decode_kernels = mode
    m.use_cuda_graphs = False
    m.alloc_cache(6, 320)
    return m


# "triton-proj": the projections in Triton too (proj_kernels.py; half a head >= 16 columns), with
# their input norms made in their prologues (up to 16 rows here) or by the separate norm kernel (0)
# "triton": the default switches (RoPE and the cache write inside the attention kernel,
# kernels.ROPE_IN_ATTENTION); "+norope": the separate `_rope_store_kernel`
FUSED_MODES = [("triton", {}, 16), ("triton+norope", {}, 16),
               ("triton-proj", {"head_dim": 32}, 16), ("triton-proj", {"head_dim": 32}, 0)]


def _prologue_rows(monkeypatch, mode, rows):
    """Set the mode's module switches; the model's decode_kernels value."""
    import megarl.engine.kernels as kern
    monkeypatch.setattr(kern, "ROPE_IN_ATTENTION", "+norope" not in mode)
    if mode == "triton-proj":
        import megarl.engine.proj_kernels as proj
        monkeypatch.setattr(proj, "NORM_PROLOGUE_ROWS", rows)
    return mode.split("+")[0]


@pytest.mark.parametrize("mode,shape,rows", FUSED_MODES)
@pytest.mark.parametrize("family,split_keys", [("llama", 256), ("qwen2", 32), ("qwen3", 64), ("qwen3_moe", 256)])
def test_fused_step_matches_the_torch_body(tmp_path, kernels, monkeypatch, family, split_keys, mode, shape, rows):
    """Logits and the keys/values written, step after step, rows at different positions. Fewer keys
    per split (kernels.SPLIT_KEYS 32 / 64) put the rows of one step over 1, 2 and 4 splits of their
    own (up to 131 keys), the last splits of a short row holding none. Both prefill with the torch
    body: the decode step is what differs here (the fused prefill has its own test below, with decode
    steps on from it; under the interpreter it would be most of this test's time)."""
    d = str(tmp_path / family)
    make_tiny_hf_model(d, family, std=0.3, **shape)
    monkeypatch.setattr(kernels, "SPLIT_KEYS", split_keys)
    monkeypatch.setenv("MEGARL_PREFILL_KERNELS", "torch")
    ref, fused = _model(d, "torch"), _model(d, _prologue_rows(monkeypatch, mode, rows))
    g = torch.Generator().manual_seed(1)
    lens = [3, 70, 130, 1, 66]
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    for m in (ref, fused):
        m.prefill(seqs, 0)
    toks, pos = np.array([5, 6, 7, 8, 9]), np.array(lens)
    for _ in range(4):
        a, b = ref.decode(toks, pos), fused.decode(toks, pos)
        assert fused._fused_views, "the fused step did not run"
        assert (a - b).abs().max().item() < 2e-5
        toks, pos = a.argmax(-1).cpu().numpy(), pos + 1
    for c in ("k_cache", "v_cache"):   # each row's positions so far
        for u, n in enumerate(pos.tolist()):
            assert (getattr(ref, c)[:, u, :, :n] - getattr(fused, c)[:, u, :, :n]).abs().max().item() < 2e-5, (c, u)


@pytest.mark.parametrize("mode,shape,rows", FUSED_MODES)
def test_engine_with_the_fused_step_generates_what_hf_generates(tmp_path, kernels, monkeypatch, mode, shape, rows):
    from megarl.engine.engine import Engine, Request, Sampling
    d = str(tmp_path / "qwen2")
    hf = make_tiny_hf_model(d, "qwen2", std=0.3, **shape)
    model = _model(d, _prologue_rows(monkeypatch, mode, rows))
    eng = Engine(model, max_running=4, max_len=64)
    eng.start()
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5] * 11]
    try:
        outs = [f.result(timeout=300) for f in eng.submit_many(
            [Request(p, Sampling(max_new_tokens=10, temperature=0, ignore_eos=True), return_logprob=True) for p in prompts])]
    finally:
        eng.stop()
    assert model._fused_views
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
        assert o["output_ids"] == ref.tolist()
        with torch.no_grad():
            full = torch.tensor([p + o["output_ids"]])
            lp = torch.log_softmax(hf(full).logits[0, len(p) - 1:-1].float(), -1)
        want = lp.gather(1, torch.tensor(o["output_ids"])[:, None])[:, 0]
        got = torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        assert (want - got).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_fused_prefill_matches_the_torch_body(tmp_path, kernels, monkeypatch, family):
    """A prefill through the Triton kernels (fused_prefill.py) against the torch body: the last
    tokens' logits and every real position's keys and values, rows of different lengths (right
    padding) into a cache that holds NaN everywhere before -- attention must read nothing this
    prefill did not write -- then decode steps on from it. A prefill after a copied prefix and an
    MoE model take the torch body."""
    import megarl.engine.fused_prefill as fp
    d = str(tmp_path / family)
    make_tiny_hf_model(d, family, std=0.3)
    ref, fused = _model(d, "torch"), _model(d, "triton")
    calls = []
    body = fp.prefill_body
    monkeypatch.setattr(fp, "prefill_body", lambda *a, **k: calls.append(1) or body(*a, **k))
    want_calls = 0 if family == "qwen3_moe" else 1
    for m in (ref, fused):
        m.k_cache.fill_(float("nan"))
        m.v_cache.fill_(float("nan"))
    g = torch.Generator().manual_seed(3)
    lens = [5, 1, 37, 12]
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
    a, b = ref.prefill(seqs, 0), fused.prefill(seqs, 0)
    assert len(calls) == want_calls
    assert (a - b).abs().max().item() < 2e-5
    for c in ("k_cache", "v_cache"):
        for u, n in enumerate(lens):
            want, got = getattr(ref, c)[:, u, :, :n], getattr(fused, c)[:, u, :, :n]
            assert (want - got).abs().max().item() < 2e-5, (c, u)
    for m in (ref, fused):   # (the torch decode body's masked SDPA would turn NaN keys into NaN)
        m.k_cache.nan_to_num_(0.0)
        m.v_cache.nan_to_num_(0.0)
    toks, pos = np.array([7, 8, 9, 10]), np.array(lens)
    for _ in range(3):
        a, b = ref.decode(toks, pos), fused.decode(toks, pos)
        assert (a - b).abs().max().item() < 2e-5
        toks, pos = a.argmax(-1).cpu().numpy(), pos + 1
    # one sequence alone into row 5 (an agent's turn; a stride-0 view of its row once made the
    # kernel read past it): the same logits, keys and values, the other rows as they were
    one = torch.randint(0, 256, (21,), generator=g).tolist()
    before = fused.k_cache.clone()
    a, b = ref.prefill([one], 5), fused.prefill([one], 5)
    assert (a - b).abs().max().item() < 2e-5
    for c in ("k_cache", "v_cache"):
        assert (getattr(ref, c)[:, 5, :, :21] - getattr(fused, c)[:, 5, :, :21]).abs().max().item() < 2e-5, c
    assert torch.equal(fused.k_cache[:, :5], before[:, :5])
    want_calls *= 2
    # the 37-token prompt's prefix copied into row 4: only its last token is computed (torch body)
    for m in (ref, fused):
        m.copy_rows([2], [4], 36)
    a, b = ref.prefill([seqs[2][36:]], 4, starts=[36]), fused.prefill([seqs[2][36:]], 4, starts=[36])
    assert len(calls) == want_calls
    assert (a - b).abs().max().item() < 2e-5


def test_graphed_prefill_gives_the_eager_prefill_and_stores_nothing_for_its_padding(tmp_path, kernels, monkeypatch):
    """Small prefills replay a captured graph (`PrefillGraphs`, emulated on CPU: the body replayed
    on the static buffers, as a CUDA graph replays it): rows padded to a power of two with
    sequences of row -1, lengths to a power of two. Against the eager fused prefill of the same
    sequences: the same logits and real positions' keys and values; rows outside the admission keep
    the NaN they held (a padding sequence that stored its keys would overwrite one); a second
    admission of the same bucket replays without a capture; one past the token limit runs eagerly."""
    import megarl.engine.model as model_mod
    from tests.helpers.graphs import EmulatedPrefillGraphs
    d = str(tmp_path / "qwen2")
    make_tiny_hf_model(d, "qwen2", std=0.3)
    eager, graphed = _model(d, "triton"), _model(d, "triton")
    monkeypatch.setattr(model_mod, "PrefillGraphs", EmulatedPrefillGraphs)
    monkeypatch.setenv("MEGARL_PREFILL_GRAPH_TOKENS", "64")
    graphed.use_cuda_graphs = True     # (prefill only here: the decode graphs are CUDA's)
    g = torch.Generator().manual_seed(5)
    for lens, row0 in (([5, 9, 3], 1), ([8, 2, 11], 2), ([7], 4)):   # buckets (4, 16), (4, 16), (1, 16)
        for m in (eager, graphed):
            m.k_cache.fill_(float("nan"))
            m.v_cache.fill_(float("nan"))
        seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
        a, b = eager.prefill(seqs, row0), graphed.prefill(seqs, row0)
        assert b.shape == a.shape and (a - b).abs().max().item() < 2e-5
        for c in ("k_cache", "v_cache"):
            for u, n in enumerate(lens):
                want, got = getattr(eager, c)[:, row0 + u, :, :n], getattr(graphed, c)[:, row0 + u, :, :n]
                assert (want - got).abs().max().item() < 2e-5, (c, u)
            others = [r for r in range(graphed.max_slots) if not row0 <= r < row0 + len(lens)]
            assert torch.isnan(getattr(graphed, c)[:, others]).all(), c
    assert set(graphed.prefill_graphs.graphs) == {(4, 16), (1, 16)} and graphed.prefill_graphs.captures == 2
    seqs = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(2)]   # 2 x 64 > 64 tokens
    a, b = eager.prefill(seqs, 0), graphed.prefill(seqs, 0)
    assert (a - b).abs().max().item() < 2e-5 and graphed.prefill_graphs.captures == 2
    assert graphed._prefill_graph_limits() == (64, graphed.max_slots)   # a number: rows up to the slots
    monkeypatch.setenv("MEGARL_PREFILL_GRAPH_TOKENS", "0")      # 0: every prefill eager
    assert graphed._prefill_graph_limits()[0] == 0
    monkeypatch.setenv("MEGARL_PREFILL_GRAPH_TOKENS", "auto")   # a power of two, at most 2048
    auto = graphed._prefill_graph_limits()
    assert 16 <= auto[0] <= 2048 and auto[0] & (auto[0] - 1) == 0
    monkeypatch.delenv("MEGARL_PREFILL_GRAPH_TOKENS")           # unset: "auto"
    assert graphed._prefill_graph_limits() == auto
    monkeypatch.setenv("MEGARL_PREFILL_GRAPH_TOKENS", "lots")
    with pytest.raises(ValueError, match="MEGARL_PREFILL_GRAPH_TOKENS='lots'"):
        graphed._prefill_graph_limits()


def _sdpa_row(q, kc, vc, b, keys, group):
    """The reference for row ``b`` of a decode step: SDPA of its query heads ``q[b]`` over its own
    first ``keys`` cached keys and values, each kv head shared by ``group`` query heads -> ``[nh, D]``."""
    k = kc[b, :, :keys].repeat_interleave(group, 0)
    v = vc[b, :, :keys].repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q[b][:, None], k, v, scale=1 / math.sqrt(q.shape[-1]))[:, 0]


@pytest.mark.parametrize("group,splits", [(1, 1), (3, 2), (4, 8), (2, 16)])
def test_attention_reads_each_rows_keys_only(kernels, group, splits):
    """Against SDPA over each row's own prefix; the cache beyond pos[b] holds garbage that must
    not leak in, rows sit at position 0 and past several blocks; 16 splits of 300 keys read blocks
    of 32 keys, and the last splits of every row hold none."""
    g = torch.Generator().manual_seed(group)
    nkv, D, L = 2, 32, 300
    pos = torch.tensor([0, 5, 63, 64, 200, 299])
    B = len(pos)
    kc = torch.randn(B + 1, nkv, L, D, generator=g)
    vc = torch.randn(B + 1, nkv, L, D, generator=g)
    q = torch.randn(B, nkv * group, D, generator=g)
    out = kernels.decode_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), pos.to(DEV), L, 1 / math.sqrt(D), splits,
                                   per_row=False)
    for b in range(B):
        want = _sdpa_row(q, kc, vc, b, int(pos[b]) + 1, group)
        assert (out[b].cpu().view(-1, D) - want).abs().max().item() < 1e-5, b


def test_attention_shaped_for_its_length_class_reads_what_the_bucket_reads(kernels):
    """`attention_len_class`: every key length of a class keeps its split count, and attention shaped
    for the class's longest length gives SDPA's output over each row's own keys, bit for bit what
    the bucket's own shape gives (a row's keys are split by its own length) -- so one decode graph
    serves the class."""
    for max_len in (320, 4096, 40000):
        for L in range(1, max_len + 1, 13):
            c = kernels.attention_len_class(L, max_len)
            assert L <= c <= max_len and kernels.attention_splits(c) == kernels.attention_splits(L), (L, max_len)
    assert len({kernels.attention_len_class(L, 40000) for L in range(64, 40001, 64)}) == 5
    g = torch.Generator().manual_seed(5)
    nkv, group, D, cache = 2, 3, 32, 1100
    for L, pos in ((192, [0, 63, 64, 191]), (640, [5, 300, 511, 639])):
        kc, vc = (torch.randn(len(pos), nkv, cache, D, generator=g) for _ in range(2))
        q = torch.randn(len(pos), nkv * group, D, generator=g)
        splits, c = kernels.attention_splits(L), kernels.attention_len_class(L, cache)
        assert c > L
        outs = []
        for key_len in (L, c):
            outs.append(out := kernels.decode_attention(q.to(DEV), kc.to(DEV), vc.to(DEV), torch.tensor(pos).to(DEV),
                                                        key_len, 1 / math.sqrt(D), splits).cpu())
            for b, p in enumerate(pos):
                want = _sdpa_row(q, kc, vc, b, p + 1, group)
                assert (out[b].view(-1, D) - want).abs().max().item() < 1e-5, (L, key_len, b)
        assert torch.equal(outs[0], outs[1]), L


def test_the_fused_step_captures_one_graph_per_split_class(tmp_path, kernels, monkeypatch):
    """Decode graphs of the fused step are keyed by the split class of the key length: steps whose
    longest rows fall in three 64-key buckets replay one graph and give the eager step's logits; the
    torch body (its mask as long as the bucket) captures one per bucket."""
    import megarl.engine.model as model_module
    from tests.helpers.graphs import EmulatedGraphs
    monkeypatch.setattr(model_module, "DecodeGraphs", EmulatedGraphs)
    d = str(tmp_path / "qwen2")
    make_tiny_hf_model(d, "qwen2", std=0.3)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (60, 3)]
    for mode, captures in (("triton", 1), ("torch", 3)):
        m = _model(d, _prologue_rows(monkeypatch, mode, 16))
        m.prefill(prompts, 0)
        graphs = m._decode_graphs()
        for pos in ([60, 3], [70, 4], [130, 5]):
            toks, pos = np.array([7, 9]), np.array(pos)
            eager = m.decode(toks, pos).clone()     # the same tokens at the same positions: same cache
            assert (graphs.run(toks, pos) - eager).abs().max().item() < 1e-5, (mode, pos)
        assert graphs.captures == captures, mode


def test_a_rows_attention_is_the_same_alone_and_beside_longer_rows(kernels, monkeypatch):
    """Batch invariance: each row takes as many splits as its own length gives, and the splits are
    merged in a fixed order, so a row decoded beside a longer one (more split programs in the step,
    the class of a longer key length) gets the bits it gets alone. Rows of 1, 2, 4 and 8 splits in
    a step of 8. (Compiled on a GPU, a merge that reduced over the step's split count as a tree broke
    this for the row of 2 splits; Triton's CPU interpreter reduces in order either way, so only the
    compiled run -- `run_gpu.sh decode_tests` -- can catch that one.)"""
    monkeypatch.setattr(kernels, "SPLIT_KEYS", 32)
    g = torch.Generator().manual_seed(11)
    nkv, group, D, cache = 2, 2, 32, 400
    pos = torch.tensor([39, 99, 150, 299, 0])
    kc, vc = (torch.randn(len(pos), nkv, cache, D, generator=g) for _ in range(2))
    q = torch.randn(len(pos), nkv * group, D, generator=g)

    def attend(rows, key_len):
        return kernels.decode_attention(q[rows].to(DEV), kc[rows].to(DEV), vc[rows].to(DEV), pos[rows].to(DEV),
                                        key_len, 1 / math.sqrt(D), kernels.attention_splits(key_len)).cpu()

    assert [kernels.attention_splits(p + 1) for p in pos.tolist()] == [1, 2, 4, 8, 1]
    together = attend(list(range(len(pos))), kernels.attention_len_class(300, cache))
    assert kernels.attention_splits(kernels.attention_len_class(300, cache)) == 8    # 8 split programs
    for b, p in enumerate(pos.tolist()):
        alone = attend([b], p + 1)
        assert torch.equal(alone[0], together[b]), b
        want = _sdpa_row(q, kc, vc, b, p + 1, group)
        assert (alone[0].view(-1, D) - want).abs().max().item() < 1e-5, b


@pytest.mark.parametrize("norm", [False, True])
def test_rope_store_writes_the_rotated_heads_of_every_token_into_its_row(kernels, norm):
    """`rope_and_store` (one program per token, every head as one tile) against torch's RoPE of
    `DecoderModel._layer` (``x * cos + rotate_half(x) * sin`` after the q/k RMSNorm): 14 query heads
    in a 16-head tile and 2 kv heads (Qwen2.5-0.5B's layout, which the tests' tiny models do not
    have), q/k RMSNorm (qwen3) or none, tokens of several cache rows and of row -1 (a captured
    prefill's padding: nothing stored)."""
    from megarl.engine.model import _rms, _rotate_half
    g = torch.Generator().manual_seed(9)
    nh, nkv, D, L = 14, 2, 32, 24
    rows = torch.tensor([0] * 6 + [2] * 6 + [-1] * 3 + [1] * 4)
    # a prefill's tokens: distinct positions within a row
    pos = torch.cat([torch.randperm(L, generator=g)[:n] for n in (6, 6, 3, 4)])
    qkv = torch.randn(len(rows), (nh + 2 * nkv) * D, generator=g)
    cos, sin = torch.rand(L, D // 2, generator=g), torch.rand(L, D // 2, generator=g)
    wq, wk = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    # the caches are rows 1.. of bigger buffers: a store at row -1 would land in row 0 of them
    kbig = torch.full((4, nkv, L, D), float("nan"), device=DEV)
    vbig = torch.full((4, nkv, L, D), float("nan"), device=DEV)
    q = kernels.rope_and_store(qkv.to(DEV), pos.to(DEV), cos.to(DEV), sin.to(DEV), kbig[1:], vbig[1:], nh, nkv,
                               *((wq.to(DEV), wk.to(DEV)) if norm else (None, None)), 1e-6, rows=rows.to(DEV))
    c, s_ = torch.cat([cos, cos], -1)[pos][:, None], torch.cat([sin, sin], -1)[pos][:, None]
    heads = qkv.view(len(rows), nh + 2 * nkv, D)
    qh, kh, vh = heads[:, :nh], heads[:, nh:nh + nkv], heads[:, nh + nkv:]
    if norm:
        qh, kh = _rms(qh, wq, 1e-6), _rms(kh, wk, 1e-6)
    want_q, want_k = qh * c + _rotate_half(qh) * s_, kh * c + _rotate_half(kh) * s_
    torch.testing.assert_close(q.cpu(), want_q, atol=1e-5, rtol=1e-5)
    assert torch.isnan(kbig[0]).all() and torch.isnan(vbig[0]).all()   # row -1: nothing stored
    for t, (r, p) in enumerate(zip(rows.tolist(), pos.tolist())):
        if r >= 0:
            torch.testing.assert_close(kbig[1 + r, :, p].cpu(), want_k[t], atol=1e-5, rtol=1e-5)
            assert torch.equal(vbig[1 + r, :, p].cpu(), vh[t])
    assert (~torch.isnan(kbig)).sum().item() == (rows >= 0).sum().item() * nkv * D   # nothing else written


def test_norm_and_activation_kernels(kernels):
    from megarl.engine.model import _rms
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g)
    w = torch.randn(96, generator=g)
    xd = x.clone().to(DEV)
    h = kernels.add_rms_norm(xd, y.to(DEV), w.to(DEV), 1e-6)
    assert torch.allclose(xd.cpu(), x + y) and (h.cpu() - _rms(x + y, w, 1e-6)).abs().max().item() < 1e-5
    assert (kernels.add_rms_norm(x.to(DEV), None, w.to(DEV), 1e-6).cpu() - _rms(x, w, 1e-6)).abs().max() < 1e-5
    gu = torch.randn(3, 2 * 1500, generator=g)
    want = F.silu(gu[:, :1500]) * gu[:, 1500:]
    assert (kernels.silu_mul(gu.to(DEV)).cpu() - want).abs().max().item() < 1e-5


def test_the_torch_body_serves_what_the_kernels_do_not(tmp_path, kernels):
    """A head dim that is not a power of two: 'auto' falls back to the torch body, 'triton' says why."""
    d = str(tmp_path / "odd")
    make_tiny_hf_model(d, "llama", head_dim=24, num_attention_heads=4, num_key_value_heads=2)
    m = _model(d, "triton")
    with pytest.raises(RuntimeError, match="head_dim 24 is not a power of two"):
        m.prefill([[1, 2, 3]], 0)   # (the prefill runs the kernels too: the first forward says it)
    m.decode_kernels = "auto"
    m._fused_views = None
    m.prefill([[1, 2, 3]], 0)
    assert m.decode(np.array([4]), np.array([3])).shape == (1, 256)
    assert m._fused_decode_views() is None


def test_the_projection_kernels_say_which_head_size_they_need(tmp_path, kernels):
    d = str(tmp_path / "small_heads")
    make_tiny_hf_model(d, "llama", head_dim=16)
    m = _model(d, "triton-proj")
    with pytest.raises(RuntimeError, match="head_dim 16 < 32"):
        m.prefill([[1, 2, 3]], 0)


def test_fused_sampling_draws_what_the_torch_sampler_draws(kernels):
    """Seeded Gumbel-max and greedy rows in one pass (kernels.sample_rows_fused) against
    sampler.sample_rows' torch path: the same tokens, logprobs within rounding."""
    from megarl.engine.sampler import RowParams, sample_rows
    g = torch.Generator().manual_seed(0)
    B, V = 6, 5000   # several vocabulary blocks and a ragged last one
    logits = (torch.randn(B, V, generator=g) * 3).to(DEV)
    rp = RowParams(temperature=torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.5], device=DEV),
                   greedy=torch.tensor([False, False, True, False, False, False], device=DEV),
                   seeds=torch.tensor([3, 4, 5, -7, 2**40 + 1, 9], device=DEV),
                   steps=torch.tensor([0, 1, 2, 300, 5, 77], device=DEV),
                   top_k=torch.zeros(B, dtype=torch.int64, device=DEV), top_p=torch.ones(B, device=DEV),
                   min_p=torch.zeros(B, device=DEV))
    for stochastic in (True, False):
        if not stochastic:
            rp.greedy[:] = True
            rp.temperature[:] = 1.0
        want_t, want_lp = sample_rows(logits, rp, stochastic)
        got_t, got_lp = sample_rows(logits, rp, stochastic, fused=True)
        assert torch.equal(got_t, want_t)
        assert (got_lp - want_lp).abs().max().item() < 1e-5
        # the Triton step hands the sampler its bf16 logits: read and upcast in the kernel, the
        # draw and the logprobs are exactly those of the fp32 copy the step no longer makes
        half = logits.to(torch.bfloat16)
        got_t, got_lp = sample_rows(half, rp, stochastic, fused=True)
        want_t, want_lp = sample_rows(half.float(), rp, stochastic, fused=True)
        assert torch.equal(got_t, want_t) and torch.equal(got_lp, want_lp)
        assert torch.equal(sample_rows(half, rp, stochastic)[0], sample_rows(half.float(), rp, stochastic)[0])


def test_fused_sampling_decides_near_ties_with_the_exact_noise(kernels):
    """The one-pass sampler scores with fp32 noise and re-scores exactly (fp64, the definition)
    only what might be a block's best. Rows built so that two ids' scores z + g differ by at most
    one fp32 ulp -- in one block, or in two -- must draw the id that argmax(z + g) over the exact
    noise draws (first id on ties); pure-noise rows exercise the common path."""
    from megarl.engine import kernels as K
    from megarl.engine.sampler import seeded_gumbel
    B, V, T = 48, 6000, 32                              # T rows of near ties, the rest ~pure noise
    seeds = torch.arange(B, dtype=torch.int64) * 7919 + 11
    steps = torch.arange(B, dtype=torch.int64) * 3
    g = seeded_gumbel(seeds, steps, V)                  # the exact noise, fp32 [B, V]
    z = torch.full((B, V), -40.0)
    # the ids of the tie pairs: noise where fp32's -log(u) is least accurate (u just below 1 - 2^-7),
    # so the approximate scores differ by more than the exact ones do
    worst = (g > 4.2) & (g < 4.84)
    for r in range(T):                                  # near ties: a and b score 5 +- 1 ulp
        ids = worst[r].nonzero()[:, 0]
        a = int(ids[ids < 1024][0])
        b = int(ids[ids < 1024][1] if r % 2 == 0 else ids[ids >= 2048][0])   # same block / another block
        z[r, a] = 5.0 - g[r, a]
        z[r, b] = 5.0 - g[r, b] + (r % 3 - 1) * 2.0 ** -21   # 2^-21: one ulp of a score near 5
    z[T:] = torch.randn(B - T, V, generator=torch.Generator().manual_seed(3)) * 0.01
    want = (z + g).argmax(dim=-1)
    temp = torch.ones(B, device=DEV)
    for block in (1024, 4096):   # 1024: the pairs 2048 apart are in two blocks
        got, _ = K.sample_rows_fused(z.to(DEV), temp, torch.zeros(B, dtype=torch.bool, device=DEV),
                                     seeds.to(DEV), steps.to(DEV), block=block)
        assert torch.equal(got.cpu(), want), block
    exact, _ = K.sample_rows_fused(z.to(DEV), temp, torch.zeros(B, dtype=torch.bool, device=DEV),
                                   seeds.to(DEV), steps.to(DEV), exact_noise=True)   # fp64 for every id
    assert torch.equal(exact.cpu(), want)
    assert 0 < int((want[:T] == (z[:T] > 0).int().argmax(dim=-1)).sum()) < T   # the ties fall both ways


def _keep_reference(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The keep-set of one row by the definition, in float64 with a sort: top-k keeps p >= the k-th
    largest; top-p keeps the ids whose larger ids (sorted, descending) hold at most top_p of the
    mass; min-p keeps p >= min_p * max p."""
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones(len(z), dtype=bool)
    order = np.argsort(-p, kind="stable")
    if 0 < top_k < len(z):
        keep &= p >= p[order[top_k - 1]]
    if top_p < 1.0:
        before = np.cumsum(p[order]) - p[order]
        drop = np.zeros(len(z), dtype=bool)
        drop[order] = before > top_p
        keep &= ~drop
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
    return keep


def test_filter_thresholds_keep_what_a_sort_keeps(kernels):
    """Each row's value threshold (no sort: a search over fp32 order keys) keeps exactly the ids the
    sort-based definition keeps, for top-k, top-p, min-p alone and together, at several
    temperatures, with tied logits at the k-th place (all kept) and a one-id nucleus."""
    g = torch.Generator().manual_seed(3)
    V = 5000
    rows = [  # (temperature, top_k, top_p, min_p)
        (1.0, 50, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 0, 1.0, 0.05), (1.0, 200, 0.8, 0.0),
        (0.5, 10, 0.95, 0.01), (1.0, 0, 0.3, 0.0), (1.0, 0, 1.0, 0.0), (2.0, V + 5, 0.99, 0.0),
        (1.0, 0, 1e-4, 0.0), (1.0, 7, 1.0, 0.0)]
    logits = torch.randn(len(rows), V, generator=g) * 3
    logits[-1, :12] = logits[-1].max() + 1.0          # 12 tied top logits, top-k 7: all 12 kept
    logits = logits.to(DEV)
    t = torch.tensor([r[0] for r in rows], device=DEV)
    top_k = torch.tensor([r[1] for r in rows], device=DEV)
    top_p = torch.tensor([r[2] for r in rows], device=DEV)
    min_p = torch.tensor([r[3] for r in rows], device=DEV)
    from megarl.engine.filter_kernels import filter_thresholds
    thr = filter_thresholds(logits, t, top_k, top_p, min_p)
    z = (logits / t[:, None]).cpu()
    for i, (temp, k, p, mp) in enumerate(rows):
        want = _keep_reference(z[i].double().numpy(), k, p, mp)
        got = (z[i] >= thr[i].cpu()).numpy()
        assert np.array_equal(got, want), (i, rows[i], int(got.sum()), int(want.sum()))
    assert thr[6].item() == float("-inf")                    # no filter on: every id
    assert (z[-1] >= thr[-1].cpu()).sum().item() == 12
    assert (z[8] >= thr[8].cpu()).sum().item() == 1          # top_p 1e-4: the top id alone
    # a filter another row has but this one does not stays off; kinds compiled out change nothing
    only_p = filter_thresholds(logits[1:2], t[1:2], top_k[1:2], top_p[1:2], min_p[1:2], (False, True, False))
    assert torch.equal(only_p, thr[1:2])
    # programs taking several chunks each (as at large batches on a GPU), one group ragged: the
    # same thresholds, bit for bit (a chunk's sums do not depend on who computes them)
    wide = torch.cat([logits, logits[:, :3000]], dim=1)   # 3 chunks of 4096
    base = filter_thresholds(wide, t, top_k, top_p, min_p, group=1)
    for group in (2, 3):
        assert torch.equal(filter_thresholds(wide, t, top_k, top_p, min_p, group=group), base)


def test_fused_filtered_sampling_draws_what_the_torch_sampler_draws(kernels):
    """top-k / top-p / min-p rows beside unfiltered and greedy ones, sampled by the Triton
    threshold + one-pass kernels (every row through the filters, as a decode graph runs them)
    and by sampler.sample_rows' sort-based torch path: the same tokens step after step, the same
    unfiltered logprobs within rounding."""
    from megarl.engine.sampler import RowParams, sample_rows
    g = torch.Generator().manual_seed(1)
    B, V = 6, 5000
    logits = (torch.randn(B, V, generator=g) * 2.5).to(DEV)
    rp = RowParams(temperature=torch.tensor([1.0, 0.8, 1.0, 1.2, 1.0, 0.9], device=DEV),
                   greedy=torch.tensor([False, False, True, False, False, False], device=DEV),
                   seeds=torch.tensor([3, 4, 5, -7, 11, 9], device=DEV),
                   steps=torch.zeros(B, dtype=torch.int64, device=DEV),
                   top_k=torch.tensor([0, 20, 0, 0, 40, 0], device=DEV),
                   top_p=torch.tensor([0.9, 1.0, 1.0, 0.7, 0.95, 1.0], device=DEV),
                   min_p=torch.tensor([0.0, 0.0, 0.0, 0.02, 0.0, 0.0], device=DEV))
    filtered_draws = 0
    for step in range(6):
        rp.steps[:] = step
        want_t, want_lp = sample_rows(logits, rp, True, filter_all=True)
        got_t, got_lp = sample_rows(logits, rp, True, fused=True, filter_all=True)
        assert torch.equal(got_t, want_t), step
        assert (got_lp - want_lp).abs().max().item() < 1e-5
        # the filters bind: without them the same noise picks another token in some steps
        free_t, _ = sample_rows(logits, rp, True, fused=True)
        filtered_draws += int((free_t != got_t).sum())
    assert filtered_draws > 0
    # the decode step's bf16 logits, upcast as the kernels read them: what their fp32 copy gives
    half = logits.to(torch.bfloat16)
    got = sample_rows(half, rp, True, fused=True, filter_all=True)
    want = sample_rows(half.float(), rp, True, fused=True, filter_all=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_filtered_rows_fall_back_to_the_sort_when_the_thresholds_fail_their_check(kernels, monkeypatch, caplog):
    """Thresholds that do not build (or disagree with the sort) on a device are not used there:
    one warning, and filtered rows sample exactly as the sort-based torch path does."""
    from megarl.engine import filter_kernels, sampler
    from megarl.engine.sampler import RowParams, sample_rows
    assert sampler.fused_filters_ok(torch.device(DEV))   # the real kernels pass the check here

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")
    monkeypatch.setattr(filter_kernels, "filter_thresholds", broken)
    monkeypatch.setattr(sampler, "_FILTERS_OK", {})
    B, V = 3, 3000
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(2)) * 2).to(DEV)
    rp = RowParams(temperature=torch.ones(B, device=DEV), greedy=torch.zeros(B, dtype=torch.bool, device=DEV),
                   seeds=torch.tensor([1, 2, 3], device=DEV), steps=torch.zeros(B, dtype=torch.int64, device=DEV),
                   top_k=torch.tensor([0, 5, 0], device=DEV), top_p=torch.tensor([0.5, 1.0, 1.0], device=DEV),
                   min_p=torch.zeros(B, device=DEV))
    with caplog.at_level("WARNING", logger="megarl.engine.sampler"):
        got = sample_rows(logits, rp, True, fused=True, filter_all=True)
        again = sample_rows(logits, rp, True, fused=True, filter_all=True)
    want = sample_rows(logits, rp, True, filter_all=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(again[0], want[0])
    warnings = [r for r in caplog.records if "sort-based sampler" in r.getMessage()]
    assert len(warnings) == 1 and "no kernel image" in warnings[0].getMessage()
