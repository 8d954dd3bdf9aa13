"""Weight-sync bytes/s (bucketed broadcast into a real embedded server process) vs a plain tensor
copy of the same bytes, in one run (one JSON line).

    python benchmarks/bench_sync.py [--bucket-mb 16] [--transport distributed|tensor|disk] [--no-checksum|--checksum]
    python benchmarks/bench_sync.py --device cuda --shape qwen2.5-0.5b --transport tensor --bucket-mb 512 [--no-checksum]
    python benchmarks/bench_sync.py --device cuda --shape qwen2.5-7b --transport tensor --bucket-mb 1024 --fp8

Checksums: the pusher's default (on for distributed/disk, off for tensor) unless --checksum /
--no-checksum.  Timing breakdown: the best of 3 timed pushes reports this thread's pack_s /
checksum_s / send_s and the server's own receive/verify/handoff/apply seconds (`server_*`, summed
over buckets); "synced" repeats one push with a device sync after each phase (exact per-phase GPU
time; CUDA copies are asynchronous otherwise, so their time lands in the next phase that waits).

GPU mode: the server is a real embedded server process on the same GPU (``--load-format dummy``,
config.json only), the trainer-side tensors are the same HF-named set on the GPU (bf16, random);
baseline = one device-to-device copy of the same number of bytes (bytes/s counts bytes moved
once); peak extra memory = max_memory_allocated above the resident tensors during a push, against
2 buckets.  ``distributed`` needs NCCL between two processes: on one GPU NCCL refuses two ranks on
the same device, so that line reports the error.
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
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--fp8", action="store_true", help="GPU: also push into a block-FP8 server (quantizing on the way)")
    ck = ap.add_mutually_exclusive_group()
    ck.add_argument("--checksum", dest="checksum", action="store_true", default=None)
    ck.add_argument("--no-checksum", dest="checksum", action="store_false")
    a = ap.parse_args()
    a.layers_given = any(x.startswith("--layers") for x in sys.argv[1:])
    if a.device != "cpu":
        return main_gpu(a)
    torch.set_num_threads(1)
    from tests.helpers.servers import ServerProcess, make_tiny_hf_model
    from megarl.sync.push import WeightPusher
    d = tempfile.mkdtemp()
    hf = make_tiny_hf_model(d + "/m", "llama", vocab_size=8192, hidden_size=a.hidden, intermediate_size=a.hidden * 3,
                            num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4, std=0.02)
    named = [(k, v.detach().clone()) for k, v in hf.state_dict().items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    with ServerProcess(d + "/m", threads=1) as s:
        p = WeightPusher([s.url], transport=a.transport, bucket_mb=a.bucket_mb, disk_dir=d + "/disk",
                         hf_config_dir=d + "/m", send_checksums=a.checksum)
        runs = [_push(p, named) for _ in range(4)][1:]  # the first is a warm-up (group setup, allocations)
        p.close()
    st = min(runs, key=lambda r: r.seconds)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    tc = min((lambda t: (dst.copy_(src), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
    print(json.dumps({"bench": "weight_sync", "transport": a.transport, "bytes": st.bytes, "buckets": st.buckets,
                      "bucket_mb": a.bucket_mb, "seconds": st.seconds, "sync_bytes_per_s": st.bytes_per_s,
                      "copy_bytes_per_s": nbytes / tc, "ratio_sync_over_copy": st.bytes_per_s / (nbytes / tc),
                      "peak_extra_bytes": st.peak_extra_bytes, "checksums": p.send_checksums,
                      "phases": _phases(st), "device": "cpu", "backend": "gloo"}))


def _push(pusher, named):
    """One push inside its own weight-update session (what the trainer does every step)."""
    with pusher.session():
        return pusher.push(named)


def _phases(st) -> dict:
    keys = ("pack_s", "checksum_s", "send_s")
    out = {k: round(getattr(st, k), 6) for k in keys}
    out.update({f"server_{k}": round(v, 6) for k, v in st.server_s.items()})
    return out


def main_gpu(a):
    from megarl.engine.model import DecoderModel
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_train import hf_config
    dev = torch.device(a.device)
    if a.shape is None and a.layers_given:
        # a Qwen2.5-shaped model of --hidden x --layers: the tensor count at a chosen size (the
        # per-tensor cost of a push apart from its bytes)
        from transformers import Qwen2Config
        cfg = Qwen2Config(hidden_size=a.hidden, intermediate_size=a.hidden * 3, num_hidden_layers=a.layers,
                          num_attention_heads=max(a.hidden // 64, 1), num_key_value_heads=max(a.hidden // 256, 1),
                          vocab_size=8192, tie_word_embeddings=False, max_position_embeddings=4096)
        a.shape = f"qwen2-h{a.hidden}-l{a.layers}"
    else:
        cfg = hf_config(a.shape or "qwen2.5-0.5b")
    # the trainer's weights live in torch's caching allocator (megatron's buffers); the engine's own
    # weights would sit in CUDA VMM regions, which cannot be exported as CUDA IPC handles (a 7B
    # embedding larger than a bucket is sent from where it lies: "invalid device pointer")
    stable = os.environ.get("MEGARL_STABLE_MEMORY")
    os.environ["MEGARL_STABLE_MEMORY"] = "0"
    try:
        src = DecoderModel(cfg, device=a.device, dtype=torch.bfloat16)
    finally:
        if stable is None:
            os.environ.pop("MEGARL_STABLE_MEMORY")
        else:
            os.environ["MEGARL_STABLE_MEMORY"] = stable
    named = []
    for n, t in src.params.items():
        t.normal_(0.0, 0.02)
        named.append((n, t))
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    res = {"bench": "weight_sync", "shape": a.shape, "transport": a.transport, "device": torch.cuda.get_device_name(0),
           "bucket_mb": a.bucket_mb, "bytes": nbytes}
    res.update(_push_into_server(a, cfg, named, None))
    if a.fp8:
        # the same weights into a server of the block-FP8 checkpoint: the pusher quantizes each
        # projection on the GPU on the way; baseline = the bf16 push above, same run
        from megarl.checkpoint.fp8_convert import fp8_quantization_config
        from megarl.engine.fp8 import QUANTIZED
        from megarl.quant.served import BlockFp8Format
        served = BlockFp8Format(quantized=frozenset(n for n, _ in named if n.endswith(QUANTIZED)))
        cfg.quantization_config = fp8_quantization_config()
        fp8 = _push_into_server(a, cfg, named, served)
        res["fp8"] = fp8
        if "seconds" in fp8 and "seconds" in res:
            res["fp8_seconds_over_bf16"] = fp8["seconds"] / res["seconds"]
            res["fp8_bytes_over_bf16"] = fp8["pushed_bytes"] / res["pushed_bytes"]
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(flat)
    for _ in range(3):
        dst.copy_(flat)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(flat)
    torch.cuda.synchronize()
    copy_bps = nbytes * 10 / (time.perf_counter() - t)
    res["copy_bytes_per_s"] = copy_bps
    if "sync_bytes_per_s" in res:
        res["ratio_sync_over_copy"] = res["sync_bytes_per_s"] / copy_bps
    print(json.dumps(res), flush=True)


def _push_into_server(a, cfg, named, served) -> dict:
    """Best of 3 pushes of ``named`` into a fresh embedded server of ``cfg`` on the same GPU."""
    from megarl.sync.push import WeightPusher
    from tests.helpers.servers import ServerProcess

    d = tempfile.mkdtemp(prefix="bench_sync_")
    cfg.save_pretrained(d)
    res: dict = {}
    torch.cuda.synchronize()
    log = os.environ.get("BENCH_SYNC_SERVER_LOG")
    with ServerProcess(d, threads=2, extra=["--device", a.device, "--dtype", "bfloat16", "--load-format", "dummy",
                                             "--skip-tokenizer-init", "--max-running-requests", "4",
                                             "--context-length", "256"], log_path=log) as s:
        try:
            p = WeightPusher([s.url], transport=a.transport, bucket_mb=a.bucket_mb, timeout_s=120,
                             send_checksums=a.checksum, served=served)
            _push(p, named)  # warm-up (group setup, first allocations)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            runs = [_push(p, named) for _ in range(3)]
            torch.cuda.synchronize()
            peak_extra = torch.cuda.max_memory_allocated() - base
            p.sync_timing = True
            synced = _push(p, named)
            p.close()
            st = min(runs, key=lambda r: r.seconds)
            res.update(seconds=st.seconds, buckets=st.buckets, pushed_tensors=st.tensors, sync_bytes_per_s=st.bytes_per_s, pushed_bytes=st.bytes,
                       checksums=p.send_checksums, phases=_phases(st),
                       synced={"seconds": synced.seconds, **_phases(synced)},
                       peak_extra_bytes_measured=peak_extra, peak_extra_bytes_pusher=st.peak_extra_bytes,
                       peak_extra_over_2_buckets=peak_extra / (2 * a.bucket_mb * (1 << 20)))
        except Exception as e:
            res.update(error=f"{type(e).__name__}: {str(e)[:300]}")
    return res


if __name__ == "__main__":
    main()
