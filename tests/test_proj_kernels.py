"""The decode step's Triton projections (engine/proj_kernels.py) against torch's own ops.

Under Triton's interpreter on CPU (tests/conftest.py), compiled where CUDA is there. References are
torch's F.linear, F.silu and the RoPE formula as HF writes it (``q * cos + rotate_half(q) * sin``),
computed in float64 where the kernels run fp32; bf16 is checked against torch's bf16 ops, which
round in the same places (only the K reduction order differs).
"""
import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture
def proj():
    if not CUDA:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run under tests/conftest.py (TRITON_INTERPRET=1)"
    import megarl.engine.proj_kernels as p
    return p


def _rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("M,K,N,splits", [(1, 96, 80, None), (5, 600, 48, 2), (70, 600, 40, 4)])
def test_partial_sums_add_up_to_the_product_and_into_the_residual(proj, M, K, N, splits):
    """The split-K parts sum to x @ w^T; the norm kernel adds them (+ bias) into the residual in
    place and normalises it, as torch's ``x + (F.linear + b)`` then RMSNorm does."""
    from megarl.engine.model import _rms
    g = torch.Generator().manual_seed(M)
    x, w, b = _rand(g, M, K), _rand(g, N, K, scale=K ** -0.5), _rand(g, N)
    parts = proj.linear_parts(x.float().to(DEV), w.float().to(DEV), splits)
    if splits:
        assert parts.shape[0] == splits
    assert (parts.sum(0).double().cpu() - x @ w.T).abs().max().item() < 1e-4
    res, nw = _rand(g, M, N), _rand(g, N)
    inp = proj.NormedInput(res.float().to(DEV), parts, b.float().to(DEV), nw.float().to(DEV), 1e-6)
    h = proj.add_norm(inp)
    want = res + x @ w.T + b
    assert (inp.x_out.double().cpu() - want).abs().max().item() < 1e-4
    assert (h.double().cpu() - _rms(want, nw, 1e-6)).abs().max().item() < 1e-4


def test_the_split_count_depends_on_the_weight_only(proj):
    """Batch invariance: the same K ranges whatever the row count; small K is not split."""
    assert proj.splits_for(128, 896) == 1
    assert proj.splits_for(896, 896) == 2 ** (896 // 256).bit_length() // 2 or proj.splits_for(896, 896) > 1
    for K, N in ((896, 896), (4864, 896), (3584, 3584)):
        s = proj.splits_for(K, N)
        assert s & (s - 1) == 0 and 1 <= s <= proj.MAX_SPLITS and K // s >= proj.SPLIT_MIN_K


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 40])
def test_gate_up_silu_matches_torch(proj, dtype, M):
    g = torch.Generator().manual_seed(M)
    K, inter = 96, 72
    x, w, b = _rand(g, M, K), _rand(g, 2 * inter, K, scale=K ** -0.5), _rand(g, 2 * inter, scale=0.1)
    out = proj.gate_up_silu(x.to(dtype).to(DEV), w.to(dtype).to(DEV), b.to(dtype).to(DEV)).cpu()
    if dtype == torch.float32:
        gu = x @ w.T + b
        want = F.silu(gu[:, :inter]) * gu[:, inter:]
        assert (out.double() - want).abs().max().item() < 1e-4
    else:   # torch's bf16 ops: linear + bias, silu and product, each rounded, as the decode body runs them
        gu = F.linear(x.to(dtype), w.to(dtype), b.to(dtype))
        want = F.silu(gu[:, :inter]) * gu[:, inter:]
        err = (out.float() - want.float()).abs()
        assert err.max().item() <= 0.02 * want.float().abs().max().item()
        assert (out == want).float().mean().item() > 0.95


def _rope_reference(x, w, b, pos, cos, sin, nh, nkv, qn, kn, eps):
    """HF's attention prologue in float64: projections, optional q/k RMSNorm, RoPE."""
    from megarl.engine.model import _rms, _rotate_half
    D = cos.shape[1] * 2
    M = x.shape[0]
    qkv = (x @ w.T + (b if b is not None else 0)).view(M, nh + 2 * nkv, D)
    q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
    if qn is not None:
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    c = torch.cat([cos[pos], cos[pos]], -1)[:, None]
    s = torch.cat([sin[pos], sin[pos]], -1)[:, None]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v


@pytest.mark.parametrize("D,nh,nkv,bias,norm", [(32, 4, 2, True, False), (64, 2, 1, False, False),
                                                (32, 2, 2, False, True), (64, 4, 1, True, True)])
def test_qkv_rope_writes_what_hfs_prologue_computes(proj, D, nh, nkv, bias, norm):
    """Queries out, rotated keys and values into each row's cache at its own position; every other
    cache slot is left as it was."""
    g = torch.Generator().manual_seed(D + nh)
    K, L = 80, 40
    pos = torch.tensor([0, 7, 39])
    M = len(pos)
    x = _rand(g, M, K)
    w = _rand(g, (nh + 2 * nkv) * D, K, scale=K ** -0.5)
    b = _rand(g, (nh + 2 * nkv) * D, scale=0.1) if bias else None
    qn, kn = (_rand(g, D), _rand(g, D)) if norm else (None, None)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(D // 2) / (D // 2))
    cos, sin = ang.cos(), ang.sin()
    kc0, vc0 = _rand(g, M + 1, nkv, L, D), _rand(g, M + 1, nkv, L, D)
    kc, vc = kc0.float().to(DEV), vc0.float().to(DEV)
    f = lambda t: t.float().to(DEV) if t is not None else None   # noqa: E731
    q = proj.qkv_rope(f(x), f(w), f(b), pos.to(DEV), f(cos), f(sin), kc, vc, nh, nkv, f(qn), f(kn), 1e-6)
    wq, wk, wv = _rope_reference(x, w, b, pos, cos, sin, nh, nkv, qn, kn, 1e-6)
    assert (q.double().cpu() - wq).abs().max().item() < 1e-4
    kc, vc = kc.double().cpu(), vc.double().cpu()
    kc0, vc0 = kc0.float().double(), vc0.float().double()
    for r in range(M):
        p = int(pos[r])
        assert (kc[r, :, p] - wk[r]).abs().max().item() < 1e-4
        assert (vc[r, :, p] - wv[r]).abs().max().item() < 1e-4
        kc[r, :, p], vc[r, :, p] = kc0[r, :, p], vc0[r, :, p]
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


@pytest.mark.parametrize("norm", [False, True])
def test_qkv_rope_in_bf16_rounds_where_torch_rounds(proj, norm):
    """bf16 against the torch body's own ops in bf16 (F.linear with bias, RoPE tables in the model
    dtype): nearly every element equal, the rest one rounding step away. With q/k RMSNorm (qwen3)
    the head's sum of squares is reduced in another order than torch's mean, which moves many
    elements by one step: there only the size of the difference is held."""
    from megarl.engine.model import _rms, _rotate_half
    g = torch.Generator().manual_seed(3)
    dt, D, nh, nkv, K, L = torch.bfloat16, 64, 4, 2, 128, 16
    pos = torch.tensor([0, 5, 15])
    M = len(pos)
    x = _rand(g, M, K).to(dt)
    w = _rand(g, (nh + 2 * nkv) * D, K, scale=K ** -0.5).to(dt)
    b = _rand(g, (nh + 2 * nkv) * D, scale=0.1).to(dt)
    qn, kn = ((1 + 0.1 * _rand(g, D)).to(dt), (1 + 0.1 * _rand(g, D)).to(dt)) if norm else (None, None)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(D // 2) / (D // 2))
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    kc, vc = torch.zeros(M, nkv, L, D, dtype=dt, device=DEV), torch.zeros(M, nkv, L, D, dtype=dt, device=DEV)
    f = lambda t: t.to(DEV) if t is not None else None   # noqa: E731
    q = proj.qkv_rope(f(x), f(w), f(b), f(pos), f(cos), f(sin), kc, vc, nh, nkv, f(qn), f(kn), 1e-6).cpu()
    qkv = F.linear(x, w, b).view(M, nh + 2 * nkv, D)
    wq, wk, wv = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
    if norm:
        wq, wk = _rms(wq, qn, 1e-6), _rms(wk, kn, 1e-6)
    c, s = torch.cat([cos[pos], cos[pos]], -1)[:, None], torch.cat([sin[pos], sin[pos]], -1)[:, None]
    wq, wk = wq * c + _rotate_half(wq) * s, wk * c + _rotate_half(wk) * s
    got_k = torch.stack([kc[r, :, int(pos[r])] for r in range(M)]).cpu()
    got_v = torch.stack([vc[r, :, int(pos[r])] for r in range(M)]).cpu()
    for got, want in ((q, wq), (got_k, wk), (got_v, wv)):
        if not norm:
            assert (got == want).float().mean().item() > 0.9
        assert (got.float() - want.float()).abs().max().item() <= 0.02 * want.float().abs().max().item()


def test_partial_sums_in_bf16_round_where_torch_rounds(proj):
    """o_proj's output rounded, then its bias added after (as after a TP all-reduce), then the residual."""
    from megarl.engine.model import _rms
    g = torch.Generator().manual_seed(4)
    dt, M, K, N = torch.bfloat16, 3, 640, 96
    x, w = _rand(g, M, K).to(dt), _rand(g, N, K, scale=K ** -0.5).to(dt)
    b, res, nw = _rand(g, N, scale=0.1).to(dt), _rand(g, M, N).to(dt), (1 + 0.1 * _rand(g, N)).to(dt)
    inp = proj.NormedInput(res.to(DEV), proj.linear_parts(x.to(DEV), w.to(DEV)), b.to(DEV), nw.to(DEV), 1e-6)
    h = proj.add_norm(inp).cpu()
    want_x = res + (F.linear(x, w) + b)
    for got, want in ((inp.x_out.cpu(), want_x), (h, _rms(want_x, nw, 1e-6))):
        assert (got == want).float().mean().item() > 0.95
        assert (got.float() - want.float()).abs().max().item() <= 0.02 * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("branch", ["parts", "dense", "none"])
def test_projections_make_their_norm_input_as_the_norm_kernel_does(proj, dtype, branch):
    """For few rows q/k/v and gate/up take RMSNorm(x + y) * w as a NormedInput and make it in
    their prologue: the same outputs as projecting `add_norm`'s h (the same arithmetic; only the
    norm's sum of squares may be reduced in another order on a GPU), the same new residual; y as
    split-K parts (with a bias), as a dense branch output, or absent (layer 0)."""
    from megarl.engine.model import _rms
    g = torch.Generator().manual_seed(7)
    M, H, D, nh, nkv, L, inter = 5, 320, 32, 2, 1, 12, 48
    f = lambda t: t.to(dtype).to(DEV) if t is not None else None   # noqa: E731
    res = f(_rand(g, M, H))
    o, wo = f(_rand(g, M, 192)), f(_rand(g, H, 192, scale=192 ** -0.5))
    parts = {"parts": proj.linear_parts(o, wo), "dense": f(_rand(g, M, H)), "none": None}[branch]
    pb = f(_rand(g, H, scale=0.1)) if branch == "parts" else None
    nw = f(1 + 0.1 * _rand(g, H))
    wqkv, bqkv = f(_rand(g, (nh + 2 * nkv) * D, H, scale=H ** -0.5)), f(_rand(g, (nh + 2 * nkv) * D, scale=0.1))
    wgu = f(_rand(g, 2 * inter, H, scale=H ** -0.5))
    pos = torch.tensor([0, 3, 11, 5, 2], device=DEV)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(D // 2) / (D // 2))
    cos, sin = f(ang.cos()), f(ang.sin())
    outs = []
    for fused in (False, True):
        caches = [torch.zeros(M, nkv, L, D, dtype=dtype, device=DEV) for _ in range(2)]
        inp = proj.NormedInput(res, parts, pb, nw, 1e-6)
        q = proj.qkv_rope(inp if fused else proj.add_norm(inp), wqkv, bqkv, pos, cos, sin, *caches, nh, nkv, eps=1e-6)
        inp2 = proj.NormedInput(res, parts, pb, nw, 1e-6)
        act = proj.gate_up_silu(inp2 if fused else proj.add_norm(inp2), wgu, None)
        assert torch.equal(inp.x_out, inp2.x_out)
        outs.append((q, *caches, act, inp.x_out))
    for a, b in zip(*outs):   # fp32: within rounding of the norm's sum; bf16: nearly all equal
        if dtype == torch.float32:
            assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
        else:
            assert (a == b).float().mean().item() > 0.95
            assert (a.float() - b.float()).abs().max().item() <= 0.02 * b.float().abs().max().item()
    assert torch.equal(outs[0][-1], outs[1][-1])   # the residual: no reduction in it
    y = {"parts": lambda: F.linear(o, wo) + pb, "dense": lambda: parts, "none": lambda: 0}[branch]()
    want_x = res + y
    assert (outs[1][-1].float() - want_x.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 0.05)
    h = _rms(want_x, nw, 1e-6)
    want_act = F.silu(F.linear(h, wgu[:inter])) * F.linear(h, wgu[inter:])
    assert (outs[1][3].float() - want_act.float()).abs().max().item() <= (1e-4 if dtype == torch.float32 else 0.05)
