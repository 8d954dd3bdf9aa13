"""Weight-sync bytes/s (bucketed broadcast into a real embedded server process) vs a plain tensor
copy of the same bytes, in one run (one JSON line).

    python benchmarks/bench_sync.py [--mb 64] [--bucket-mb 16] [--transport distributed|tensor|disk]
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument("--transport", default="distributed")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from megarl.rollout.testing import ServerProcess, make_tiny_hf_model
    from megarl.sync.push import WeightPusher
    d = tempfile.mkdtemp()
    hf = make_tiny_hf_model(d + "/m", "llama", vocab_size=8192, hidden_size=a.hidden, intermediate_size=a.hidden * 3,
                            num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4, std=0.02)
    named = [(k, v.detach().clone()) for k, v in hf.state_dict().items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    with ServerProcess(d + "/m", threads=1) as s:
        p = WeightPusher([s.url], transport=a.transport, bucket_mb=a.bucket_mb, disk_dir=d + "/disk",
                         hf_config_dir=d + "/m")
        p.push(named)  # warm-up (group setup, first allocations)
        runs = [p.push(named) for _ in range(3)]
        p.close()
    st = min(runs, key=lambda r: r.seconds)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    tc = min((lambda t: (dst.copy_(src), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
    print(json.dumps({"bench": "weight_sync", "transport": a.transport, "bytes": st.bytes, "buckets": st.buckets,
                      "bucket_mb": a.bucket_mb, "seconds": st.seconds, "sync_bytes_per_s": st.bytes_per_s,
                      "copy_bytes_per_s": nbytes / tc, "ratio_sync_over_copy": st.bytes_per_s / (nbytes / tc),
                      "peak_extra_bytes": st.peak_extra_bytes, "device": "cpu", "backend": "gloo"}))


if __name__ == "__main__":
    main()
