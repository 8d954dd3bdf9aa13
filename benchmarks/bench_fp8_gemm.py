"""FP8 GEMMs for the embedded engine's decode: are they faster than its bf16 (dequantized) linears?

    python benchmarks/bench_fp8_gemm.py --shape qwen2.5-1.5b --tokens 1,128,4096     # CUDA only

For each projection of the shape (weights block-FP8, 128x128 scales, as served) and each token
count M, times (median of 20 CUDA-event runs) in one process:

* ``bf16``: ``F.linear`` with the dequantized bf16 weight (what the engine runs today; the baseline);
* ``block``: ``torch._scaled_mm`` with DeepSeek-V3 scaling -- activations quantized per token and
  128-column group (1x128, dynamic, timed with the GEMM), weights per 128x128 block -- when this
  torch/GPU accepts it (the error is reported otherwise);
* ``rowwise``: ``torch._scaled_mm`` with one scale per activation row and per weight row (a
  different, coarser format; for reference).

One JSON line: per (projection, M) the seconds and ``ratio_*_over_bf16`` (< 1: FP8 faster), and
the max relative error of each against the dequantized bf16 product.
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


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def quant_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token, per-128-column-group FP8 activations (SGLang's per_token_group_quant)."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    s = g.abs().amax(-1).clamp(min=1e-4) / 448.0
    q = (g / s[..., None]).to(torch.float8_e4m3fn).view(m, k)
    return q, s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--tokens", default="1,128,4096")
    a = ap.parse_args()
    from bench_train import hf_config
    from megarl.quant.fp8_block import dequantize_block_fp8, quantize_block_fp8

    cfg = hf_config(a.shape)
    h, i = cfg.hidden_size, cfg.intermediate_size
    hd = h // cfg.num_attention_heads
    projections = {"qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd, h),
                   "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"bench": "fp8_gemm", "shape": a.shape, "device": torch.cuda.get_device_name(0),
                 "torch": torch.__version__, "results": []}
    for name, (n, k) in projections.items():
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.float32).mul_(0.02)
        wq, ws = quantize_block_fp8(w)
        wd = dequantize_block_fp8(wq, ws, dtype=torch.bfloat16)
        # row-wise weights: one scale per output row
        rs = w.abs().amax(1, keepdim=True).clamp(min=1e-4) / 448.0
        wr = (w / rs).to(torch.float8_e4m3fn)
        for m in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            ref = F.linear(x, wd).float()
            row = {"proj": name, "n": n, "k": k, "m": m, "bf16_s": timed(lambda: F.linear(x, wd))}

            def block():
                q, s = quant_act_1x128(x)
                # scale_a: (M, K/128) outer-dim-major; scale_b: (K/128, N/128); b column-major
                return torch._scaled_mm(q, wq.t(), scale_a=s.t().contiguous().t(), scale_b=ws.t(),
                                        out_dtype=torch.bfloat16)
            try:
                out = block()
                row["block_s"] = timed(block)
                row["block_rel_err"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                row["ratio_block_over_bf16"] = row["block_s"] / row["bf16_s"]
            except Exception as e:  # noqa: BLE001 - report what this torch/GPU refuses
                row["block_error"] = f"{type(e).__name__}: {str(e)[:200]}"

            def rowwise():
                xs = x.float().abs().amax(1, keepdim=True).clamp(min=1e-4) / 448.0
                xq = (x.float() / xs).to(torch.float8_e4m3fn)
                return torch._scaled_mm(xq, wr.t(), scale_a=xs, scale_b=rs.t(), out_dtype=torch.bfloat16)
            try:
                out = rowwise()
                row["rowwise_s"] = timed(rowwise)
                row["rowwise_rel_err_vs_block_dequant"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                row["ratio_rowwise_over_bf16"] = row["rowwise_s"] / row["bf16_s"]
            except Exception as e:  # noqa: BLE001
                row["rowwise_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            res["results"].append(row)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
