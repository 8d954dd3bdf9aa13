"""Summarize torch.profiler Chrome traces (``logging.profile_steps`` writes them) as text.

A phase's table of top operations says which kernels cost the most; what decides whether a phase
is GPU-bound or host-bound is the share of its wall time the GPU was busy, the host syncs that
stalled the launching thread, and how many kernels it launched. This prints those per trace:

    python3 benchmarks/trace_summary.py DIR_OR_TRACE [...]   # every *.json.gz under a folder

Used by ``run_gpu.sh real_prof`` so that one short text file comes back from the device instead of
a dozen traces (a device call returns at most 8 files).
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path
from typing import Iterable

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
TOP = 12


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(path: Path) -> str:
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if not events:
        return f"{path.name}: no events"
    start = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - start
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    kernels = [e for e in device if e["cat"] == "kernel"]
    busy = busy_us((e["ts"], e["ts"] + e["dur"]) for e in device)
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    syncs = [e for e in runtime if "Synchronize" in e["name"]]
    d2h = [e for e in device if e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]]
    lines = [f"== {path.name}: wall {span / 1e3:.1f} ms",
             f"   device busy {busy / 1e3:.1f} ms ({100 * busy / span:.0f}% of wall), {len(kernels)} kernels "
             f"({sum(e['dur'] for e in kernels) / max(len(kernels), 1):.1f} us mean), "
             f"{len(d2h)} device->host copies",
             f"   host syncs: {len(syncs)} calls, {sum(e['dur'] for e in syncs) / 1e3:.1f} ms waited; "
             f"{sum(1 for e in runtime if 'Launch' in e['name'])} launches"]
    by_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_kernel[e["name"][:90]].append(e["dur"])
    lines.append("   top kernels (total ms, count, name):")
    for name, durs in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:TOP]:
        lines.append(f"     {sum(durs) / 1e3:8.2f} {len(durs):6d}  {name}")
    marks: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation":
            marks[e["name"][:60]].append(e["dur"])
    if marks:
        lines.append("   annotated ranges (total ms, count, name):")
        for name, durs in sorted(marks.items(), key=lambda kv: -sum(kv[1]))[:TOP]:
            lines.append(f"     {sum(durs) / 1e3:8.2f} {len(durs):6d}  {name}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path)
    args = ap.parse_args()
    for p in args.paths:
        for trace in sorted(p.rglob("*.json.gz")) if p.is_dir() else [p]:
            print(summarize(trace))


if __name__ == "__main__":
    main()
