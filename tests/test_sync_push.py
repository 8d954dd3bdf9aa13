"""Bucketed weight sync into real embedded server processes: three transports, refusals keep the
old weights, bucket layout/checksum, measured trainer memory."""
import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.rollout.client import SGLangClient, sampling_params
from tests.helpers.servers import ServerProcess, make_tiny_hf_model
from megarl.sync.bucket import BucketMeta, iter_buckets, pack
from megarl.wire.checksum import checksum
from megarl.sync.push import SyncError, WeightPusher

PROMPT = [5, 6, 7, 8, 9]


def _gen(url):
    async def go():
        async with SGLangClient(url) as c:
            return (await c.generate(PROMPT, sampling_params(max_new_tokens=8, temperature=0)))[0]
    return asyncio.run(go())


def _matches(hf, out):
    ids = torch.tensor([PROMPT + out.output_ids])
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
    ref = torch.stack([lp[len(PROMPT) - 1 + i, t] for i, t in enumerate(out.output_ids)])
    return (ref - torch.tensor(out.logprobs)).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("sync")
    a = make_tiny_hf_model(str(d / "a"), "qwen2", seed=0, std=0.3)
    b = make_tiny_hf_model(str(d / "b"), "qwen2", seed=1, std=0.3)
    return str(d), a, b


@pytest.fixture(scope="module")
def servers(models):
    d, _, _ = models
    s1, s2 = (ServerProcess(d + "/a", extra=["--weights-dir", d + "/disk"]) for _ in range(2))
    try:
        yield s1.wait_ready(), s2.wait_ready()
    finally:
        s1.stop()
        s2.stop()


def test_transports_roundtrip(models, servers):
    d, a, b = models
    urls = [s.url for s in servers]
    assert all(_matches(a, _gen(u)) for u in urls)
    for transport, src, ver in [("distributed", b, "v1"), ("tensor", a, "v2"), ("disk", b, "v3")]:
        p = WeightPusher(urls, transport=transport, bucket_mb=0.03, disk_dir=d + "/disk",
                         hf_config_dir=d + "/b", group_name=f"g_{transport}")
        with p.session():
            st = p.push(list(src.state_dict().items()), weight_version=ver)
        p.close()
        assert st.buckets > 3 and st.bytes == sum(t.numel() * 4 for t in src.state_dict().values()
                                                  if True) - (0 if "lm_head.weight" in src.state_dict() else 0)
        for u in urls:
            o = _gen(u)
            assert _matches(src, o), transport
            assert o.weight_version == ver


def _bad_pushes(p, named, what):
    import megarl.sync.push as P
    orig = P.iter_buckets

    def corrupt(*a, **k):
        for b in orig(*a, **k):
            b.flat[3] ^= 0x01          # one flipped bit after the checksum was taken
            yield b
    if what == "sum":
        P.iter_buckets = corrupt
    try:
        with pytest.raises(SyncError) as e, p.session():
            p.push(named)
    finally:
        P.iter_buckets = orig
    return str(e.value)


def test_refused_updates_keep_old_weights(models, servers):
    d, a, b = models
    url = servers[0].url
    p = WeightPusher([url], bucket_mb=1, group_name="g_bad")
    with p.session():
        p.push(list(a.state_dict().items()), weight_version="good")
    assert _matches(a, _gen(url))
    sd = b.state_dict()
    named = [(k, v) for k, v in sd.items() if "layers.0." in k]
    msg = _bad_pushes(p, named, "sum")
    assert "checksum mismatch" in msg and "old weights kept" in msg
    msg = _bad_pushes(p, [("model.layers.0.mlp.nonexistent.weight", torch.ones(3))] + named, "name")
    assert "unknown weight name" in msg
    msg = _bad_pushes(p, [(k, v[:-1] if k.endswith("q_proj.weight") else v) for k, v in named], "shape")
    assert "shape mismatch" in msg
    p.close()
    o = _gen(url)
    assert _matches(a, o) and o.weight_version == "good"   # still serving the old weights
    # the server still accepts a good push afterwards
    p = WeightPusher([url], bucket_mb=1, group_name="g_bad2")
    with p.session():
        p.push(list(b.state_dict().items()))
    p.close()
    assert _matches(b, _gen(url))


def _num_updates(url):
    async def go():
        async with SGLangClient(url) as c:
            return (await c.get_model_info())["megarl_num_weight_updates"]
    return asyncio.run(go())


def test_tensor_transport_pipeline_refusal_and_timings(models, servers):
    d, a, b = models
    url = servers[1].url
    p = WeightPusher([url], transport="tensor", bucket_mb=0.03)
    assert p.send_checksums is False                     # default for the tensor transport
    with p.session():
        st = p.push(list(b.state_dict().items()), weight_version="b")
    assert st.buckets > 3 and _matches(b, _gen(url))
    assert {"receive_s", "verify_s", "handoff_s", "apply_s"} <= set(st.server_s)
    assert all(set(r["megarl_timings"]) >= {"receive_s", "apply_s"} for r in st.responses)
    assert st.pack_s > 0 and st.send_s > 0 and st.checksum_s == 0
    assert st.peak_extra_bytes <= 2 * p.bucket_bytes + max(t.numel() * 4 for t in b.state_dict().values())
    # sglang's list-of-(name, tensor) format, with checksums, into the same server
    q = WeightPusher([url], transport="tensor", bucket_mb=0.03, send_checksums=True, tensor_format=None)
    with q.session():
        st = q.push(list(a.state_dict().items()), weight_version="a")
    assert st.checksum_s > 0 and _matches(a, _gen(url))
    # a NaN tensor in the 2nd bucket: refused naming it; the 1st bucket was applied and the 3rd
    # (already packed by the double buffer) was never sent
    named = list(b.state_dict().items())
    second = list(iter_buckets(named, p.bucket_bytes, reuse=False, with_checksum=False))[1]
    victim = next(n for n in second.meta.names if n != "lm_head.weight")
    bad = [(k, torch.full_like(v, float("nan")) if k == victim else v) for k, v in named]
    n0 = _num_updates(url)
    for pusher in (p, q):
        with pytest.raises(SyncError, match=f"bucket 1 refused.*non-finite values in {victim}"), pusher.session():
            pusher.push(bad)
    assert _num_updates(url) == n0 + 2
    with p.session():
        p.push(list(a.state_dict().items()), weight_version="a")
    p.close()
    q.close()
    o = _gen(url)
    assert _matches(a, o) and o.weight_version == "a"


def test_bucket_layout_and_checksum():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g)),
             ("c", torch.randn(2, 2, 2, generator=g))]
    b = pack(named)
    # sglang flattened_bucket layout: back-to-back bytes in order
    meta = BucketMeta.from_fields(b.meta.names, b.meta.dtypes, b.meta.shapes)
    assert [(e.start, e.end) for e in meta.entries] == [(0, 60), (60, 88), (88, 120)]
    for (n, t), (n2, v) in zip(named, b.named_tensors()):
        assert n == n2 and torch.equal(t, v)
    cs = checksum(b.flat)
    for i in range(0, b.flat.numel(), 13):      # any single flipped bit is detected
        f = b.flat.clone()
        f[i] ^= 0x10
        assert checksum(f) != cs
    w = b.flat.view(torch.int64).clone()
    assert checksum(w.flip(0).view(torch.uint8)) != cs  # word reordering is detected
    assert checksum(b.flat.clone()) == cs
    # buckets respect the size cap and split on dtype
    stream = [(f"t{i}", torch.ones(100, dtype=torch.float32 if i < 6 else torch.bfloat16)) for i in range(10)]
    bs = list(iter_buckets(stream, bucket_bytes=1000, reuse=False))
    assert all(x.meta.nbytes <= 1000 for x in bs)
    assert [len(x.meta.entries) for x in bs] == [2, 2, 2, 4]
    assert {x.meta.dtype for x in bs[:3]} == {torch.float32} and bs[3].meta.dtype == torch.bfloat16


_MEM_SCRIPT = r"""
import json, sys, torch
from megarl.sync.bucket import iter_buckets
torch.manual_seed(0)
# 64 parameters as TP-shard pairs (2 x 512 KiB): the source all-gathers (cat) each into a fresh
# 1 MiB tensor, as megatron's iter_hf_weights does; the model itself is 64 MiB
shards = [(torch.randn(128, 1024), torch.randn(128, 1024)) for _ in range(64)]
def source():
    for i, (x, y) in enumerate(shards):
        yield f"w{i}", torch.cat([x, y])
def rss(key):
    for l in open("/proc/self/status"):
        if l.startswith(key):
            return int(l.split()[1]) * 1024
def peak(fn):
    base = rss("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")   # reset the peak-RSS mark
    r = fn()
    return rss("VmHWM") - base, r
# calibration: the source alone (one gathered tensor at a time + first-touch of torch code pages)
for _ in source(): pass
plain, _ = peak(lambda: sum(t.numel() for _, t in source()))
extra, n = peak(lambda: sum(b.meta.nbytes for b in iter_buckets(source(), bucket_bytes=8 << 20)))
print(json.dumps({"extra": extra, "plain": plain, "bytes": n, "model": 64 << 20}))
"""


def test_trainer_extra_memory_is_about_two_buckets():
    # fixed mmap threshold: freed tensors go back to the OS, so peak RSS measures live bytes
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n[sync memory] model 64 MiB, bucket 8 MiB: peak RSS over baseline {r['extra'] / 2**20:.1f} MiB "
          f"while bucketing vs {r['plain'] / 2**20:.1f} MiB for the bare source iteration")
    assert r["bytes"] == r["model"]
    # pending tensors (<= 1 bucket + the one that overflowed it) + one flat buffer + checksum scratch
    # (+ a fixed ~2-5 MiB: the overflow tensor, 2 MiB checksum scratch, allocator pages)
    assert r["extra"] - r["plain"] < 2 * (8 << 20) + (6 << 20)
