"""A decode step's projections over all layers: cuBLAS with the Triton elementwise kernels around
them (the ``triton`` step) vs the Triton projections with that work folded in (``triton-proj``,
engine/proj_kernels.py), in the same run, at several tile configurations. Attention, embedding and
the LM head are left out: this is the part of the step the projection kernels replace. Prints one
JSON line per (rows, variant); ratios are against cuBLAS at the same row count.

Each variant is captured in one CUDA graph over ``--layers`` layers of distinct random weights
(so the weights stream from HBM as in a real step, not from L2) and replayed (median of
``--repeats``). The bound is the weights' bytes at the copy bandwidth measured in the same run.
``--device cpu`` runs the kernels under Triton's interpreter on 2 layers (a smoke run).

    python benchmarks/bench_proj.py --shape qwen2.5-0.5b --rows 1,8,32,128
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import SHAPES, graph_timed, timed_steps, use_cuda  # noqa: E402


def _layers(shape: dict, n: int, dev, dtype):
    H, inter = shape["hidden_size"], shape["intermediate_size"]
    nh, nkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    D = H // nh
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s, scale=1.0: (torch.randn(*s, device=dev, generator=g) * scale).to(dtype)   # noqa: E731
    return [dict(qkv=r((nh + 2 * nkv) * D, H, scale=H ** -0.5), qkv_b=r((nh + 2 * nkv) * D, scale=0.1),
                 o=r(H, nh * D, scale=(nh * D) ** -0.5), gu=r(2 * inter, H, scale=H ** -0.5),
                 down=r(H, inter, scale=inter ** -0.5), n1=1 + r(H, scale=0.1), n2=1 + r(H, scale=0.1))
            for _ in range(n)], (nh, nkv, D)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--layers", type=int, default=0, help="0: the shape's")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--configs", default="16/4,32/4,64/4,32/2,16/2,32/8/128,64/8/128",
                    help="block_n/num_warps[/block_m[/block_k]] of the projections (q/k/v: min(block_n, D/2); "
                         "block_m: rows per program, 0 or absent = up to 64; block_k: K columns per step, 128)")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    a = ap.parse_args()
    cuda = use_cuda(a.device)
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
    from megarl.engine import kernels, proj_kernels as proj
    from triton.runtime.errors import OutOfResources
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SHAPES[a.shape]
    L = a.layers or (shape["num_hidden_layers"] if cuda else 2)
    layers, (nh, nkv, D) = _layers(shape, L, dev, dtype)
    H = shape["hidden_size"]
    weight_bytes = sum(t.numel() * t.element_size() for ly in layers for k, t in ly.items() if k in ("qkv", "o", "gu", "down"))
    max_len = 64
    ang = torch.arange(max_len, device=dev, dtype=torch.float32)[:, None] * 10000 ** (
        -torch.arange(D // 2, device=dev) / (D // 2))
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    bw = None
    if cuda:   # the copy bandwidth, as bench_rollout measures it
        buf = torch.empty(weight_bytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(buf)
        med, _ = timed_steps(lambda: dst.copy_(buf), 3, 10, dev)
        bw = 2 * buf.numel() / med
        del buf, dst
    for M in (int(x) for x in a.rows.split(",")):
        x0 = torch.randn(M, H, device=dev).to(dtype)
        pos = torch.arange(M, device=dev) % max_len
        caches = [torch.zeros(M, nkv, max_len, D, dtype=dtype, device=dev) for _ in range(2)]
        o_in = torch.randn(M, nh * D, device=dev).to(dtype)   # stands in for attention's output

        def cublas():
            x, y = x0.clone(), None
            for ly in layers:
                h = kernels.add_rms_norm(x, y, ly["n1"], 1e-6)
                kernels.rope_and_store(F.linear(h, ly["qkv"], ly["qkv_b"]), pos, cos, sin, *caches, nh, nkv)
                y = F.linear(o_in, ly["o"])
                h = kernels.add_rms_norm(x, y, ly["n2"], 1e-6)
                y = F.linear(kernels.silu_mul(F.linear(h, ly["gu"])), ly["down"])
            return kernels.add_rms_norm(x, y, layers[-1]["n1"], 1e-6)

        def triton_proj(bn, warps, prologue, bm=None, bk=128):
            def step():
                proj.BLOCK_K_MAX = bk   # read at launch (the graph's capture)
                x, parts = x0, None
                for ly in layers:
                    inp = proj.NormedInput(x, parts, None, ly["n1"], 1e-6)
                    proj.qkv_rope(inp if prologue else proj.add_norm(inp), ly["qkv"], ly["qkv_b"], pos, cos, sin,
                                  *caches, nh, nkv, block_n=bn, num_warps=warps, block_m=bm)
                    parts = proj.linear_parts(o_in, ly["o"], block_n=bn, num_warps=warps, block_m=bm)
                    inp2 = proj.NormedInput(inp.x_out, parts, None, ly["n2"], 1e-6)
                    act = proj.gate_up_silu(inp2 if prologue else proj.add_norm(inp2), ly["gu"], None, block_n=bn,
                                            num_warps=warps, block_m=bm)
                    x, parts = inp2.x_out, proj.linear_parts(act, ly["down"], block_n=bn, num_warps=warps, block_m=bm)
                return proj.add_norm(proj.NormedInput(x, parts, None, layers[-1]["n1"], 1e-6))
            return step

        variants = {"cublas": cublas}
        for c in a.configs.split(","):
            bn, warps, *bm = (int(v) for v in c.split("/"))
            if len(bm) == 2:   # bm 0 = default rows per program; bk: K columns per step of the K walk
                variants[f"proj_bn{bn}_w{warps}_bm{bm[0]}_bk{bm[1]}"] = triton_proj(bn, warps, False, bm[0] or None, bm[1])
                continue
            if bm:   # a rows-per-program override: only where it changes the blocks
                if bm[0] < M and M > 16 or bm[0] > 64 and M > 64:
                    variants[f"proj_bn{bn}_w{warps}_bm{bm[0]}"] = triton_proj(bn, warps, False, bm[0])
                continue
            variants[f"proj_bn{bn}_w{warps}"] = triton_proj(bn, warps, False)
            if M <= 16:
                variants[f"proj_bn{bn}_w{warps}_prologue"] = triton_proj(bn, warps, True)
        times, outs = {}, {}
        for name, fn in variants.items():
            try:
                out, times[name] = graph_timed(fn, dev, a.repeats if cuda else 1)
            except OutOfResources as e:   # a tile too big for this card: say so, go on
                print(json.dumps({"bench": "decode_projections", "rows": M, "variant": name, "error": str(e)}), flush=True)
                continue
            outs[name] = out.float().clone()
        base = times["cublas"]
        for name, t in times.items():
            res = {"bench": "decode_projections", "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                   "shape": a.shape, "layers": L, "rows": M, "variant": name, "us_per_layer": round(t / L * 1e6, 2),
                   "speedup_vs_cublas": round(base / t, 3),
                   "max_abs_diff_vs_cublas": float((outs[name] - outs["cublas"]).abs().max())}
            if bw:
                res["fraction_of_bw_bound"] = round(weight_bytes / bw / t, 3)
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
