"""Host cost of the trainer's per-micro-batch bookkeeping and of launching small CUDA ops.

Why: the one-GPU train phase is host-bound (benchmarks/RESULTS.md, train phase host cost), and a
py-spy profile of the GRPO loop on the H100 box put 3-7 ms in CPU calls that take ~40-160 us on a
2-core CPU box (``packed_inputs``, ``TokenBatch.padded``). This measures those calls alone, with torch's
intra-op thread pool at its default size and at 1 and 4 threads, beside the host time of one
small CUDA launch, of a bf16 GEMM whose row count changes every call (packed micro-batches:
a new shape each time) vs one fixed shape, and of the embedded engine's weight release done three
ways. Ratios are within this run.

    python benchmarks/bench_host_ops.py [--device cuda] [--repeats 300]

Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.data.batch import TokenBatch  # noqa: E402
from megarl.workers.batch import packed_inputs  # noqa: E402


def per_call_us(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median over 5 rounds of the mean host microseconds per call."""
    fn()
    sync()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - start) / repeats * 1e6)
        sync()
    return round(statistics.median(rounds), 2)


def grpo_like_batch(samples: int = 128, new_tokens: int = 40) -> TokenBatch:
    """A mini-batch shaped as the real_e2e loop's: prompts of 20-40 tokens, 40-token responses."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(20, 40))] for _ in range(samples)]
    responses = [[rng.randrange(1000) for _ in range(new_tokens)] for _ in range(samples)]
    fields = {name: [[0.1] * new_tokens] * samples for name in ("advantages", "old_logprobs")}
    return TokenBatch.from_sequences(prompts, responses, token_fields=fields)


def cpu_limits() -> dict[str, object]:
    out: dict[str, object] = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if os.path.exists(path):
            out[path.rsplit("/", 1)[1]] = Path(path).read_text().strip()
    out["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    return out


def release_ms(dev: torch.device, megabytes: int) -> dict[str, float]:
    """Milliseconds of the embedded engine's weight release for a model of ``megabytes``
    (SmolLM2-135M in bf16: 270), each way it has been done: a fresh pageable host copy per release
    (megarl before), a copy into one reused pinned buffer (``--enable-weights-cpu-backup``), and
    dropping the bytes (SGLang's default); each followed by handing the memory back."""
    n = megabytes * 2**20
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    ways = {"pageable_fresh": lambda flat: flat.to("cpu"), "pinned_reused": lambda flat: pinned.copy_(flat),
            "drop": lambda flat: None}
    out = {}
    for name, release in ways.items():
        times = []
        for _ in range(5):
            flat = torch.ones(n, dtype=torch.uint8, device=dev)
            torch.cuda.synchronize()
            start = time.perf_counter()
            release(flat)
            del flat
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        out[f"release_ms/{name}"] = round(statistics.median(times), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--release-mb", type=int, default=270, help="weights released by the engine (MB)")
    args = ap.parse_args()
    batch = grpo_like_batch()
    flat = batch.token_fields["advantages"]
    default_threads = torch.get_num_threads()
    result: dict[str, object] = {"bench": "host_ops", "device": args.device, "torch_threads_default": default_threads,
                                 **cpu_limits()}
    for threads in sorted({default_threads, 4, 1}, reverse=True):
        torch.set_num_threads(threads)
        result[f"packed_inputs_us/t{threads}"] = per_call_us(lambda: packed_inputs(batch), args.repeats)
        result[f"padded_us/t{threads}"] = per_call_us(lambda: batch.padded(flat), args.repeats)
    torch.set_num_threads(default_threads)
    if args.device == "cuda":
        dev = torch.device("cuda")
        sync = torch.cuda.synchronize
        name = torch.cuda.get_device_name()
        result["device"] = name
        x = torch.zeros(1024, device=dev)
        result["cuda_add_us"] = per_call_us(lambda: x.add_(1.0), args.repeats * 10, sync)
        w = torch.randn(1536, 576, device=dev, dtype=torch.bfloat16)
        calls = args.repeats
        big = torch.randn(512 + 6 * calls + 8, 576, device=dev, dtype=torch.bfloat16)
        fixed = big[:512]
        result["matmul_fixed_shape_us"] = per_call_us(lambda: torch.matmul(fixed, w.t()), calls, sync)
        rows = iter(range(512 + 1, 512 + 6 * calls + 8))   # a row count never seen before, every call
        result["matmul_new_shape_us"] = per_call_us(lambda: torch.matmul(big[:next(rows)], w.t()), calls, sync)
        result.update(release_ms(dev, args.release_mb))
        result["matmul_new_vs_fixed"] = round(result["matmul_new_shape_us"] / result["matmul_fixed_shape_us"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
