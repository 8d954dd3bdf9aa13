"""Sampling one decode step's logits with top-k / top-p / min-p rows: the sort-based torch sampler
vs the Triton threshold search + one-pass sampler, and the one-pass sampler without filters
(the floor), in the same run. Prints one JSON line per batch size.

Each variant is timed as the decode graph runs it: captured once in a CUDA graph, then replayed
(median of ``--repeats`` replays, the device synchronized around each), so the numbers are GPU
time plus graph-launch gaps, not Python. ``--device cpu`` runs the kernels under Triton's
interpreter, called directly (a smoke run: its times say nothing).

    python benchmarks/bench_sampler.py --batch 1,32,128,512 --vocab 151936 --top-p 0.9
    python benchmarks/bench_sampler.py --batch 128 --top-k 50 --top-p 0.95 --min-p 0.05
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import graph_timed, use_cuda  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32,128,512", help="rows per step, comma-separated")
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen2.5's vocabulary by default")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    a = ap.parse_args()
    cuda = use_cuda(a.device)
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
    from megarl.engine import filter_kernels, kernels
    from megarl.engine.sampler import RowParams, sample_rows
    dev = torch.device("cuda" if cuda else "cpu")
    kinds = (a.top_k > 0, a.top_p < 1.0, a.min_p > 0.0)
    for B in (int(x) for x in a.batch.split(",")):
        g = torch.Generator(device=dev).manual_seed(0)
        # logits shaped like a model's: a few strong ids over a long tail, in the model's dtype
        logits = (torch.randn(B, a.vocab, device=dev, generator=g) * 2.0).to(torch.bfloat16)
        rp = RowParams(temperature=torch.ones(B, device=dev), greedy=torch.zeros(B, dtype=torch.bool, device=dev),
                       seeds=torch.arange(B, device=dev), steps=torch.zeros(B, dtype=torch.int64, device=dev),
                       top_k=torch.full((B,), a.top_k, device=dev), top_p=torch.full((B,), a.top_p, device=dev),
                       min_p=torch.full((B,), a.min_p, device=dev))
        variants = {
            "torch_sort": lambda: sample_rows(logits, rp, True, filter_all=True),
            "triton_threshold": lambda: sample_rows(logits, rp, True, fused=True, filter_all=True, filter_kinds=kinds),
            "triton_unfiltered": lambda: sample_rows(logits, rp, True, fused=True),
            # baselines of the sampler's faster paths, same run: every id's noise in fp64; one
            # 4096-id chunk per search program; greedy (no noise: the pass's floor)
            "triton_unfiltered_exact_noise": lambda: kernels.sample_rows_fused(
                logits, rp.temperature, rp.greedy, rp.seeds, rp.steps, exact_noise=True),
            "triton_threshold_one_chunk": lambda: kernels.sample_rows_fused(
                logits, rp.temperature, rp.greedy, rp.seeds, rp.steps,
                threshold=filter_kernels.filter_thresholds(logits, rp.temperature, rp.top_k, rp.top_p, rp.min_p,
                                                           kinds, group=1)),
            "triton_greedy": lambda: sample_rows(logits, rp, False, fused=True),
            "triton_unfiltered_block4096": lambda: kernels.sample_rows_fused(
                logits, rp.temperature, rp.greedy, rp.seeds, rp.steps, block=4096, num_warps=8),
        }
        res = {"bench": "sampler", "device": torch.cuda.get_device_name(0) if cuda else "cpu", "batch": B, "vocab": a.vocab,
               "top_k": a.top_k, "top_p": a.top_p, "min_p": a.min_p}
        tokens = {}
        for name, fn in variants.items():
            out, med = graph_timed(fn, dev, a.repeats)
            tokens[name] = out[0].clone()
            res[f"{name}_ms"] = round(med * 1e3, 4)
        res["speedup_threshold_vs_sort"] = round(res["torch_sort_ms"] / res["triton_threshold_ms"], 2)
        res["threshold_over_unfiltered"] = round(res["triton_threshold_ms"] / res["triton_unfiltered_ms"], 2)
        res["same_tokens_threshold_vs_sort"] = float((tokens["triton_threshold"] == tokens["torch_sort"]).float().mean())
        res["speedup_noise_vs_exact"] = round(res["triton_unfiltered_exact_noise_ms"] / res["triton_unfiltered_ms"], 2)
        res["speedup_grouped_vs_one_chunk"] = round(res["triton_threshold_one_chunk_ms"] / res["triton_threshold_ms"], 2)
        res["speedup_block4096_vs_1024"] = round(res["triton_unfiltered_ms"] / res["triton_unfiltered_block4096_ms"], 2)
        res["same_tokens_block4096_vs_1024"] = bool(torch.equal(tokens["triton_unfiltered"],
                                                               tokens["triton_unfiltered_block4096"]))
        res["same_tokens_noise_vs_exact"] = bool(torch.equal(tokens["triton_unfiltered"],
                                                            tokens["triton_unfiltered_exact_noise"]))
        res["same_tokens_grouped_vs_one_chunk"] = bool(torch.equal(tokens["triton_threshold"],
                                                                  tokens["triton_threshold_one_chunk"]))
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
