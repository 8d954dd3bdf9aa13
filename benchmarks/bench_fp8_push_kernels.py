"""The FP8 push's two GPU passes, single-pass kernels vs their torch form (one JSON line).

    python benchmarks/bench_fp8_push_kernels.py [--shape qwen2.5-7b] [--check] [--reps 5]

* quantize: every projection of the shape (bf16, random) to block FP8 with fp32 scales --
  `quant.fp8_kernels.quantize_block_fp8_kernel` vs `fp8_block.quantize_block_fp8_torch`;
* check: the server's float8 finiteness check of the quantized bytes in 1 GiB buckets --
  `any_byte_matches` vs the torch form ``((raw & 0x7F) == 0x7F).any()``.

Baseline, same run: a device-to-device copy of the bf16 weights (quantize) and of the float8
bytes (check). ``--check``: every weight's bytes and scales from the kernel equal the torch form's
on this GPU, and a NaN planted in one bucket is found by both checks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def projections(shape: str) -> list[tuple[int, int]]:
    """(out, in) of every block-FP8 projection of a Qwen2.5 shape (attention and MLP, all layers)."""
    from bench_train import SHAPES
    s = SHAPES[shape]
    h, f, heads, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
    d = h // heads
    layer = [(h, h), (kv * d, h), (kv * d, h), (h, h), (f, h), (f, h), (h, f)]
    return layer * s["num_hidden_layers"]


def timed(fn, reps: int) -> float:
    """Best seconds of `reps` runs after one warm-up (compilation, allocations)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    from megarl.quant.fp8_block import quantize_block_fp8_torch
    from megarl.quant.fp8_kernels import any_byte_matches, quantize_block_fp8_kernel
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for shape in projections(a.shape)]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    res: dict = {"bench": "fp8_push_kernels", "shape": a.shape, "device": torch.cuda.get_device_name(0),
                 "weights": len(ws), "bf16_bytes": nbytes}
    if a.check:
        same = 0
        for w in ws:
            for fmt in ("fp32", "ue8m0"):
                q, s = quantize_block_fp8_kernel(w, 128, fmt)
                rq, rs = quantize_block_fp8_torch(w, 128, fmt)
                same += int(torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs))
        res["bit_exact_weights"] = f"{same}/{2 * len(ws)}"
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(flat)
    res["quantize_torch_s"] = timed(lambda: [quantize_block_fp8_torch(w, 128, "fp32") for w in ws], a.reps)
    res["quantize_kernel_s"] = timed(lambda: [quantize_block_fp8_kernel(w, 128, "fp32") for w in ws], a.reps)
    res["copy_bf16_s"] = timed(lambda: dst.copy_(flat), a.reps)
    res["quantize_kernel_over_torch"] = res["quantize_kernel_s"] / res["quantize_torch_s"]
    res["quantize_kernel_over_copy"] = res["quantize_kernel_s"] / res["copy_bf16_s"]
    del flat, dst
    q = torch.cat([quantize_block_fp8_kernel(w, 128, "fp32")[0].view(torch.uint8).reshape(-1) for w in ws])
    del ws
    torch.cuda.empty_cache()
    buckets = list(q.split(1 << 30))
    res["fp8_bytes"] = q.numel()

    def torch_check() -> bool:
        return bool(torch.cat([((b & 0x7F) == 0x7F).any().reshape(1) for b in buckets]).any())

    def kernel_check() -> bool:
        return bool(torch.cat([any_byte_matches(b, 0x7F, 0x7F) for b in buckets]).any())
    qdst = torch.empty_like(q)
    res["check_torch_s"] = timed(torch_check, a.reps)
    res["check_kernel_s"] = timed(kernel_check, a.reps)
    res["copy_fp8_s"] = timed(lambda: qdst.copy_(q), a.reps)
    res["check_kernel_over_torch"] = res["check_kernel_s"] / res["check_torch_s"]
    res["check_kernel_over_copy"] = res["check_kernel_s"] / res["copy_fp8_s"]
    if a.check:
        clean = (torch_check(), kernel_check())
        buckets[-1][-3] = 0xFF
        res["nan_found"] = {"clean": clean, "planted": (torch_check(), kernel_check())}
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
