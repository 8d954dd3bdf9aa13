"""How fast can one row stream a decode step's weights? The question a persistent decode kernel
stands on, asked before building one.

At batch 1 the embedded engine's step is ~10 dependent kernels per layer, each too short to reach
the memory bandwidth (benchmarks/RESULTS.md, sections 22, 23, 27: the projections' GEMVs stream
their weights at ~27% of the copy bandwidth, and a kernel boundary costs what a grid barrier
costs). A persistent kernel could do better only if it starts loading the next phase's weights
before the previous phase's output exists -- the weights do not depend on it. Measured here over
``--layers`` layers of a shape's projections (q/k/v, o, gate/up, SiLU-and-mul, down; no attention,
no norms: the weights are the bytes), batch 1, each variant in one CUDA graph, replayed (median):

* ``cublas``: F.linear per projection and the Triton SiLU-and-mul (what the ``triton`` step runs;
  its result is not compared: it multiplies where the others take a sigmoid, see `_x_cols`);
* ``kernels``: this file's GEMV, one launch per projection;
* ``persistent``: the same GEMV as one cooperative launch, a grid barrier between projections,
  each program loading its first weight tile of the next projection before it waits (``--prefetch``
  columns; 0 = none).

``persistent`` and ``kernels`` compute every output element with the same loads in the same
order, so they must agree exactly (a barrier that lets a program run ahead would read a stale
input); both are also checked against a float64 reference. Prints one JSON line per config, with
each variant's microseconds per layer and the weights' bytes at the copy bandwidth of the same run.

    python benchmarks/bench_gemv_chain.py --shape qwen2.5-0.5b --configs 1/8/0,1/8/1024,2/4/1024
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grid_sync import _grid_barrier  # noqa: E402
from bench_rollout import copy_bandwidth  # noqa: E402
from bench_train import SHAPES, graph_timed  # noqa: E402


@triton.jit
def _x_cols(in_ptr, k, K: tl.constexpr, ACT: tl.constexpr):
    """Input columns ``k`` of a projection: ``in[k]``, or (down) SiLU(in[k]) * sigmoid(in[K + k]) --
    SiLU-and-mul's loads and about its arithmetic, but linear in the row's scale (SiLU(g) * u squares
    it each layer: 24 layers overflowed on an H100). Loads skip L1 (``.cg``):
    another SM wrote them."""
    km = k < K
    g = tl.load(in_ptr + k, mask=km, other=0.0, cache_modifier=".cg")
    if ACT:
        u = tl.load(in_ptr + K + k, mask=km, other=0.0, cache_modifier=".cg")
        g = g / (1.0 + tl.exp(-g)) / (1.0 + tl.exp(-u))
    return g


@triton.jit
def _row_block(w_ptr, in_ptr, out_ptr, rb, w_first, N: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr):
    """out[rows of block rb] = W[rows] @ x, W bf16 [N, K] row-major, fp32 sums; the first PRE columns
    come from ``w_first`` (loaded by the caller, possibly before a barrier)."""
    rows = rb * BN + tl.arange(0, BN)
    rm = rows < N
    acc = tl.zeros([BN], dtype=tl.float32)
    if PRE > 0:
        kp = tl.arange(0, PRE)
        acc += tl.sum(w_first.to(tl.float32) * _x_cols(in_ptr, kp, K, ACT)[None, :], axis=1)
    for k0 in range(PRE, K, BK):
        k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=rm[:, None] & (k[None, :] < K), other=0.0)
        acc += tl.sum(w.to(tl.float32) * _x_cols(in_ptr, k, K, ACT)[None, :], axis=1)
    tl.store(out_ptr + rows, acc, mask=rm)


@triton.jit
def _first_tile(w_ptr, rb, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, PRE: tl.constexpr):
    """Block rb's first PRE weight columns ([BN, PRE] bf16; zeros where out of range; PRE 0: unused)."""
    if PRE > 0:
        rows = rb * BN + tl.arange(0, BN)
        kp = tl.arange(0, PRE)
        tile = tl.load(w_ptr + rows[:, None] * K + kp[None, :], mask=(rows[:, None] < N) & (kp[None, :] < K),
                       other=0.0)
    else:
        tile = tl.zeros([BN, 16], dtype=tl.bfloat16)
    return tile


@triton.jit
def _phase(w_ptr, in_ptr, out_ptr, count_ptr, target, p, P: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
           ACT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr, BARRIER: tl.constexpr):
    """One projection by program p of P: row blocks p, p + P, ...; with BARRIER, the first block's
    first PRE columns are loaded, then the grid waits for the previous projection's output."""
    NB: tl.constexpr = (N + BN - 1) // BN
    w_first = _first_tile(w_ptr, p, N, K, BN, PRE)
    if BARRIER:
        _grid_barrier(count_ptr, target)
    # (a block past the last is all masked: it loads and stores nothing)
    _row_block(w_ptr, in_ptr, out_ptr, p, w_first, N, K, ACT, BN, BK, PRE)
    for j in range(1, (NB + P - 1) // P):   # (constexpr bounds: Triton's interpreter needs them)
        rb = p + j * P
        _row_block(w_ptr, in_ptr, out_ptr, rb, _first_tile(w_ptr, rb, N, K, BN, PRE), N, K, ACT, BN, BK, PRE)


@triton.jit
def _one_phase_kernel(w_ptr, in_ptr, out_ptr, P: tl.constexpr, N: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr):
    """One projection, P programs (the grid)."""
    _phase(w_ptr, in_ptr, out_ptr, in_ptr, 0, tl.program_id(0), P, N, K, ACT, BN, BK, PRE, False)


@triton.jit
def _chain_kernel(w_ptr, x_ptr, q_ptr, o_ptr, u_ptr, count_ptr, LAYERS: tl.constexpr, P: tl.constexpr, H: tl.constexpr, QN: tl.constexpr,
                  I: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRE: tl.constexpr):
    """Every layer's q/k/v -> o -> gate/up -> down in one launch of P programs, a grid barrier
    before each projection."""
    p = tl.program_id(0)
    LW: tl.constexpr = QN * H + H * H + 2 * I * H + H * I
    for layer in range(0, LAYERS):
        w = w_ptr + layer * LW   # (< 2^31 elements: main checks)
        t = layer * 4 * P
        _phase(w, x_ptr, q_ptr, count_ptr, t + P, p, P, QN, H, False, BN, BK, PRE, True)
        w += QN * H
        _phase(w, q_ptr, o_ptr, count_ptr, t + 2 * P, p, P, H, H, False, BN, BK, PRE, True)
        w += H * H
        _phase(w, o_ptr, u_ptr, count_ptr, t + 3 * P, p, P, 2 * I, H, False, BN, BK, PRE, True)
        w += 2 * I * H
        _phase(w, u_ptr, x_ptr, count_ptr, t + 4 * P, p, P, H, I, True, BN, BK, PRE, True)


def _views(flat: torch.Tensor, L: int, H: int, QN: int, I: int):
    """Per layer (qkv [QN, H], o [H, H] over q's first H, gate/up [2I, H], down [H, I]) in ``flat``."""
    sizes = [(QN, H), (H, H), (2 * I, H), (H, I)]
    lw, out, off = sum(a * b for a, b in sizes), [], 0
    for layer in range(L):
        ws, off = [], layer * lw
        for a, b in sizes:
            ws.append(flat[off:off + a * b].view(a, b))
            off += a * b
        out.append(ws)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=0, help="0: the shape's")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--configs", default="1/8/0,1/8/512,1/8/1024,2/4/512,2/8/512",
                    help="programs per SM / rows per block / prefetched columns")
    ap.add_argument("--block-k", type=int, default=256)
    a = ap.parse_args()
    dev = torch.device("cuda")
    s = SHAPES[a.shape]
    H, I, L = s["hidden_size"], s["intermediate_size"], a.layers or s["num_hidden_layers"]
    D = H // s["num_attention_heads"]
    QN = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * D
    lw = QN * H + H * H + 2 * I * H + H * I
    assert L * lw < 2 ** 31, "the chain kernel's offsets are int32"
    g = torch.Generator(device=dev).manual_seed(0)
    # fan-in scaling, down's a little larger: the chain contracts (the row's norm falls ~0.5x a layer,
    # still far from fp32's floor after 24), so a rounding difference is not amplified -- at 3.4 / sqrt(I)
    # it grew and was chaotic (fp32 vs fp64 differed by ~100% after 24 layers, on an H200 and on CPU)
    flat = torch.empty(L * lw, dtype=torch.bfloat16, device=dev)
    W = _views(flat, L, H, QN, I)
    for qkv, o, gu, down in W:
        for t, scale in ((qkv, H ** -0.5), (o, H ** -0.5), (gu, H ** -0.5), (down, 2.0 * I ** -0.5)):
            t.copy_(torch.randn(t.shape, device=dev, generator=g) * scale)
    x0 = torch.randn(H, device=dev, generator=g)
    x, q, o_buf, u = (torch.empty(n, device=dev) for n in (H, QN, H, 2 * I))
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    bw = copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    ref = x0.double()   # float64 reference of the chain
    for qkv, o, gu, down in W:
        h = gu.double() @ (o.double() @ (qkv.double() @ ref)[:H])
        ref = down.double() @ (F.silu(h[:I]) * torch.sigmoid(h[I:]))

    from megarl.engine import kernels

    def cublas():
        h = x0.to(torch.bfloat16)[None]
        for qkv, o, gu, down in W:
            h = F.linear(kernels.silu_mul(F.linear(F.linear(F.linear(h, qkv)[:, :H], o), gu)), down)
        return h[0].float()

    def rel(v: torch.Tensor) -> float:
        return float((v.double() - ref).norm() / ref.norm())

    for cfg in a.configs.split(","):
        per_sm, BN, PRE = (int(v) for v in cfg.split("/"))
        P = per_sm * sms
        const = dict(BN=BN, BK=a.block_k, PRE=PRE, num_warps=4)

        def kernels_run():
            x.copy_(x0)
            for qkv, o, gu, down in W:
                for w, src, dst, n, k, act in ((qkv, x, q, QN, H, False), (o, q, o_buf, H, H, False),
                                               (gu, o_buf, u, 2 * I, H, False), (down, u, x, H, I, True)):
                    grid = min(P, triton.cdiv(n, BN))
                    _one_phase_kernel[(grid,)](w, src, dst, grid, N=n, K=k, ACT=act, **const)
            return x.clone()

        def persistent_run():
            x.copy_(x0)
            count.zero_()
            _chain_kernel[(P,)](flat, x, q, o_buf, u, count, L, P, H=H, QN=QN, I=I, launch_cooperative_grid=True, **const)
            return x.clone()

        res = {"bench": "gemv_chain", "device": torch.cuda.get_device_name(0), "shape": a.shape, "layers": L,
               "programs_per_sm": per_sm, "rows_per_block": BN, "prefetch_cols": PRE, "block_k": a.block_k,
               "weight_bytes": flat.numel() * 2, "copy_bw_bytes_per_s": bw}
        outs = {}
        for name, fn in (("cublas", cublas), ("kernels", kernels_run), ("persistent", persistent_run)):
            try:
                outs[name], t = graph_timed(fn, dev, a.repeats)
            except Exception as e:   # a config that does not fit (registers, co-residency): say so, go on
                res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
                continue
            res[f"{name}_us_per_layer"] = round(t / L * 1e6, 3)
            res[f"{name}_of_bw_bound"] = round(flat.numel() * 2 / bw / t, 4)
            if name != "cublas":
                res[f"{name}_rel_err"] = rel(outs[name])
        if "kernels" in outs and "persistent" in outs:
            res["persistent_equals_kernels"] = bool(torch.equal(outs["kernels"], outs["persistent"]))
            res["persistent_over_cublas"] = round(res["cublas_us_per_layer"] / res["persistent_us_per_layer"], 3)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
