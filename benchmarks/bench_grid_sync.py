"""What a grid-wide barrier costs inside one persistent Triton kernel, against what a kernel
boundary costs in a CUDA graph -- the question a persistent decode-layer kernel stands on.

A decode step of a small model is ~10 dependent kernels per layer, each a few microseconds
(benchmarks/RESULTS.md, sections 16, 22, 23). A persistent kernel would replace kernel boundaries
with grid barriers (an atomic arrive + a poll) and could load the next phase's weights before it
waits. Measured here, each in one CUDA graph, replayed (median):

* ``kernels``: N launches of a tiny kernel (every program reads what another wrote in the launch
  before and writes one value), chained through memory;
* ``barriers``: one cooperative launch of the same programs doing the same N rounds with a grid
  barrier between rounds (reads bypass L1: another SM wrote them);
* per round = (time(N) - time(1)) / (N - 1) for each.

The rounds' results are checked against the host's arithmetic (a barrier that lets a program run
ahead reads a stale value). Prints one JSON line per program count.

    python benchmarks/bench_grid_sync.py --programs 36,132 --rounds 64
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import graph_timed  # noqa: E402


@triton.jit
def _round(buf_ptr, src, dst, p, P):
    """Program p: dst[p] = src[(p + 1) % P] + 1 (what its neighbour wrote in the round before)."""
    v = tl.load(buf_ptr + src * P + (p + 1) % P, cache_modifier=".cg")
    tl.store(buf_ptr + dst * P + p, v + 1)


@triton.jit
def _one_round_kernel(buf_ptr, src, dst, P):
    p = tl.program_id(0)
    _round(buf_ptr, src, dst, p, P)


@triton.jit
def _grid_barrier(count_ptr, target):
    """Every program arrives once (release: its stores before it), then polls (acquire) until
    ``target`` programs have arrived."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _rounds_kernel(buf_ptr, count_ptr, ROUNDS, P):
    p = tl.program_id(0)
    for r in range(0, ROUNDS):
        _round(buf_ptr, r % 2, (r + 1) % 2, p, P)
        _grid_barrier(count_ptr, (r + 1) * P)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", default="36,132")
    ap.add_argument("--rounds", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for P in (int(x) for x in a.programs.split(",")):
        P = min(P, sms)
        buf = torch.zeros(2, P, dtype=torch.int32, device=dev)
        count = torch.zeros(1, dtype=torch.int32, device=dev)

        def kernels(n):
            def run():
                buf.zero_()
                for r in range(n):
                    _one_round_kernel[(P,)](buf, r % 2, (r + 1) % 2, P, num_warps=4)
                return buf.clone()
            return run

        def barriers(n):
            def run():
                buf.zero_()
                count.zero_()
                _rounds_kernel[(P,)](buf, count, n, P, num_warps=4, launch_cooperative_grid=True)
                return buf.clone()
            return run

        res = {"bench": "grid_sync", "device": torch.cuda.get_device_name(0), "programs": P, "rounds": a.rounds}
        for name, make in (("kernels", kernels), ("barriers", barriers)):
            out1, t1 = graph_timed(make(1), dev, a.repeats)
            outn, tn = graph_timed(make(a.rounds), dev, a.repeats)
            res[f"{name}_us_per_round"] = round((tn - t1) / (a.rounds - 1) * 1e6, 3)
            # after N rounds every value is N (each round adds one to a neighbour's N - 1)
            res[f"{name}_correct"] = bool((outn[a.rounds % 2] == a.rounds).all()) and bool((out1[1] == 1).all())
        res["barrier_over_kernel_boundary"] = round(res["barriers_us_per_round"] / res["kernels_us_per_round"], 3)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
