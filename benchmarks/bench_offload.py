"""Offload/onload of a Megatron role's state (workers/offload.py) against the raw pinned copy
bandwidth measured in the same run, plus the leak and exactness checks.

    python benchmarks/bench_offload.py                          # CPU: tiny shape (code path only)
    python benchmarks/bench_offload.py --shape qwen2.5-1.5b     # GPU: ~21 GB of state

What is built is what MegatronWorker builds: megarl's GPTModel (bf16 on GPU) behind megatron DDP
(fp32 grad buffers) with megatron's distributed optimizer (fp32 main params + Adam), after one
real optimizer step so the Adam moments exist. Then:
  * baseline: one device tensor of the same byte count copied to pinned host memory and back
    (the best a copy of those bytes can do on this link);
  * offload / onload of params + grads + optimizer by StateOffloader, ``--cycles`` times; the first
    cycle allocates the pinned buffers and is reported apart;
  * ratios offload GB/s / baseline D2H GB/s and onload GB/s / baseline H2D GB/s (bytes copied:
    gradients are released and zero-filled, not copied);
  * leak: device memory allocated after each onload, max deviation from the first cycle in %;
  * exact: every parameter and optimizer tensor after all cycles equals a copy taken before.
One JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_train import hf_config, init_one_rank  # noqa: E402


def progress(msg: str, t0: float = time.perf_counter()) -> None:
    print(f"[bench_offload {time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def snapshot(tensors) -> list[torch.Tensor]:
    """Copies on the same device (exact comparison later without hashing tens of GB on the host)."""
    return [t.detach().clone() for t in tensors]


def pinned_bandwidth(nbytes: int, device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """GB/s of one contiguous device -> pinned host copy and back, best of ``repeats``."""
    cuda = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    d2h, h2d = [], []
    for _ in range(repeats):
        for out, src, dst in ((d2h, dev, host), (h2d, host, dev)):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize()
            out.append(nbytes / (time.perf_counter() - t) / 1e9)
    del dev, host
    return max(d2h), max(h2d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=None)
    ap.add_argument("--cycles", type=int, default=20)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = a.shape or ("qwen2.5-1.5b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    init_one_rank(cuda)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megarl.models import build_model
    from megarl.workers.offload import KINDS, StateOffloader, _optimizer_tensors

    progress(f"building {shape}")
    model = build_model(hf_config(shape), params_dtype=dtype)[0].to(device)
    ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), module=model)
    model.config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=cuda, params_dtype=dtype,
                                                 use_distributed_optimizer=True), [ddp])
    ids = torch.randint(0, 1000, (1, 256), device=device)
    pos = torch.arange(256, device=device)[None]
    ddp.zero_grad_buffer()
    ddp(ids, pos, None).float().mean().backward()
    opt.step()     # Adam moments exist from here on
    progress("one optimizer step done")
    params = [p for p in ddp.parameters()]
    unique: dict[int, torch.Tensor] = {}
    for t in params + list(_optimizer_tensors(opt)):   # main params are listed twice (groups and inner optimizer)
        unique.setdefault(t.data_ptr(), t)
    state = list(unique.values())
    before = snapshot(state)
    snapshot_bytes = sum(t.numel() * t.element_size() for t in before)

    off = StateOffloader([ddp], opt, device)
    sizes = {k: sum(s.nbytes for s in off.collect()[k]) for k in KINDS}
    base_d2h, base_h2d = pinned_bandwidth(sizes["params"] + sizes["optimizer"], device)
    progress(f"baseline pinned copy {base_d2h:.1f} / {base_h2d:.1f} GB/s of {sizes}")
    kinds = list(KINDS)
    first_off = off.offload(kinds)
    allocated_offloaded = torch.cuda.memory_allocated() if cuda else 0
    first_on = off.onload(kinds)
    allocated, offs, ons = [], [], []
    progress(f"first cycle: offload {first_off.seconds:.2f}s onload {first_on.seconds:.2f}s")
    for i in range(a.cycles):
        offs.append(off.offload(kinds))
        ons.append(off.onload(kinds))
        allocated.append(torch.cuda.memory_allocated() if cuda else 0)
        progress(f"cycle {i + 1}: offload {offs[-1].seconds:.3f}s onload {ons[-1].seconds:.3f}s")
    exact = all(torch.equal(b, t.detach()) for b, t in zip(before, state))
    copied = offs[0].bytes_copied
    off_gbps = sorted(copied / r.seconds / 1e9 for r in offs)[len(offs) // 2]
    on_gbps = sorted(copied / r.seconds / 1e9 for r in ons)[len(ons) // 2]
    leak = max(abs(x - allocated[0]) for x in allocated) / max(allocated[0], 1) * 100
    print(json.dumps({
        "bench": "offload", "shape": shape, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "bytes": sizes, "bytes_copied_each_way": copied,
        "baseline_pinned_GBps": {"d2h": round(base_d2h, 2), "h2d": round(base_h2d, 2)},
        "offload_GBps_median": round(off_gbps, 2), "onload_GBps_median": round(on_gbps, 2),
        "ratio_offload_vs_baseline": round(off_gbps / base_d2h, 3),
        "ratio_onload_vs_baseline": round(on_gbps / base_h2d, 3),
        "first_cycle_s": {"offload": round(first_off.seconds, 3), "onload": round(first_on.seconds, 3)},
        "offload_s_median": round(sorted(r.seconds for r in offs)[len(offs) // 2], 3),
        "onload_s_median": round(sorted(r.seconds for r in ons)[len(ons) // 2], 3),
        "allocated_GiB_offloaded": round((allocated_offloaded - snapshot_bytes) / 2 ** 30, 3),  # less the exactness copy
        "allocated_GiB_onloaded": round(allocated[0] / 2 ** 30, 3),
        "cycles": a.cycles, "leak_pct_max": round(leak, 4), "bit_exact_after_cycles": exact}))


if __name__ == "__main__":
    main()
