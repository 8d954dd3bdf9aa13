"""Bucket checksum (fast form == the megarl-sum64-v1 definition), double-buffered bucketing,
and the server's one-reduction finiteness check -- no server processes."""
import numpy as np
import pytest
import torch

import megarl.wire.checksum as B
from megarl.engine.weights import WeightReceiver, WeightRefused, _all_finite, _covering_bytes
from megarl.sync.bucket import iter_buckets, pack
from megarl.wire.checksum import checksum


def _reference(data: bytes) -> str:
    """megarl-sum64-v1 written out directly: numpy uint64 arithmetic wraps mod 2**64."""
    L = len(data)
    nw = L // 8
    w = np.frombuffer(data[: nw * 8], dtype="<u8")
    s1 = int(w.sum(dtype=np.uint64))
    s2 = int((w * np.arange(1, nw + 1, dtype=np.uint64)).sum(dtype=np.uint64))
    s3 = sum(v << (8 * j) for j, v in enumerate(data[nw * 8:]))
    return f"{L:x}-{s1:016x}-{s2:016x}-{s3:x}"


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("cols", [8, 64, 1 << 16])
def test_checksum_equals_definition(monkeypatch, cols):
    monkeypatch.setattr(B, "_COLS", cols)
    rng = np.random.default_rng(cols)
    lengths = {0, 1, 7, 8, 9, 15, 8 * cols - 1, 8 * cols, 8 * cols + 3, 8 * cols * 5, 8 * cols * 5 + 8 * 3 + 5,
               8 * cols * 3 - 8, 1000003}
    for L in sorted(lengths):
        data = rng.integers(0, 256, L, dtype=np.uint8).tobytes()
        assert checksum(_bytes_tensor(data)) == _reference(data), (cols, L)
    # extreme words: every product and sum wraps many times
    data = (b"\xff" * 8 + b"\x00" * 7 + b"\x80") * (3 * cols + 1) + b"\xfe\xff\x01"
    assert checksum(_bytes_tensor(data)) == _reference(data)


def test_checksum_any_dtype_same_bytes():
    x = torch.randn(123457, generator=torch.Generator().manual_seed(0))
    assert checksum(x) == checksum(x.view(torch.uint8)) == _reference(x.numpy().tobytes())
    assert checksum(x.to(torch.bfloat16)) == _reference(x.to(torch.bfloat16).view(torch.int16).numpy().tobytes())


def test_double_buffered_buckets():
    g = torch.Generator().manual_seed(0)
    stream = [(f"t{i}", torch.randn(n, generator=g)) for i, n in enumerate([100, 200, 50, 300, 30, 30, 400, 10])]
    stream.insert(5, ("big", torch.randn(1000, generator=g)))     # 4000 bytes > cap: its own bucket, no copy
    cap = 2000
    got, flats = [], []
    for b in iter_buckets(stream, cap, buffers=2):
        assert b.meta.nbytes <= cap or b.meta.names == ["big"]
        assert b.held_bytes <= 2 * cap + 4000
        got.extend((n, t.clone()) for n, t in b.named_tensors())
        flats.append(b.flat)
        assert b.checksum == checksum(b.flat)
    assert [n for n, _ in got] == [n for n, _ in stream]
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(got, stream))
    assert len(flats) == 4                                         # t0-t2 | t3 t4 | big | t5-t7
    big = next(f for f in flats if f.numel() == 4000)
    assert big.data_ptr() == dict(stream)["big"].data_ptr()       # zero copy
    ptrs = [f.untyped_storage().data_ptr() for f in flats if f.numel() != 4000]
    assert len(set(ptrs)) == 2 and ptrs[0] == ptrs[2] != ptrs[1]   # two buffers, used in turn
    # same layout as packing each bucket from scratch
    for b in iter_buckets(stream, cap, buffers=2, with_checksum=False):
        assert b.checksum is None
        ref = pack(b.named_tensors())
        assert ref.meta.entries == b.meta.entries and torch.equal(ref.flat, b.flat)
    # no reuse: every bucket is its own exact-size copy, still intact after the stream ended
    kept = list(iter_buckets(stream, cap, reuse=False))
    assert [b.flat.numel() for b in kept] == [b.meta.nbytes for b in kept]
    assert len({b.flat.untyped_storage().data_ptr() for b in kept}) == len(kept)
    got = [x for b in kept for x in b.named_tensors()]
    assert [n for n, _ in got] == [n for n, _ in stream]
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(got, stream))


class _Model:
    """Just what WeightReceiver._check needs: two float params, a tied lm_head."""

    def __init__(self):
        self.params = {"a": torch.zeros(4, 3), "b": torch.zeros(5)}

    def is_ignored(self, name):
        return name == "lm_head.weight"

    def target(self, name):
        return self.params.get(name)

    def hf_shape(self, name):
        t = self.params.get(name)
        return None if t is None else tuple(t.shape)

    def place(self, name, full):
        return self.params[name], full


def test_finite_check_one_reduction_names_the_tensor():
    rx = WeightReceiver(_Model())
    b = pack([("a", torch.ones(4, 3)), ("lm_head.weight", torch.ones(6)), ("b", torch.ones(5))])
    named = b.named_tensors()
    assert len(rx._check(named, b.flat)) == 2
    for bad in (float("nan"), float("inf"), float("-inf")):
        flat = b.flat.clone()
        named = b.meta.views(flat)
        named[2][1][3] = bad
        with pytest.raises(WeightRefused, match=r"non-finite values in b"):
            rx._check(named, flat)
        with pytest.raises(WeightRefused, match=r"non-finite values in b"):
            rx._check(named)                       # per-tensor path says the same
        assert not _all_finite([t for _, t in named], flat)
    # a NaN in an ignored tensor (tied lm_head) does not refuse what is applied
    flat = b.flat.clone()
    named = b.meta.views(flat)
    named[1][1][0] = float("nan")
    assert len(rx._check(named, flat)) == 2
    for dt in (torch.bfloat16, torch.float16):
        x = torch.ones(10, dtype=dt)
        assert _all_finite([x], x.view(torch.uint8))
        x[7] = float("nan")
        assert not _all_finite([x], x.view(torch.uint8)) and not _all_finite([x])


@pytest.mark.parametrize("dt", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz])
def test_float8_finite_check_reads_bytes_as_torch_converts_them(dt):
    """Every one of the 256 byte patterns: finite by the byte check iff torch's own conversion to
    fp32 is finite; a bucket holding one non-finite pattern is refused, per bucket and per tensor."""
    patterns = torch.arange(256, dtype=torch.uint8)
    for b in range(256):
        x = patterns[b:b + 1].view(dt)
        assert _all_finite([x]) == bool(torch.isfinite(x.float()).all()), (dt, b)
    ok = torch.cat([patterns[i:i + 1] for i in range(256) if torch.isfinite(patterns[i:i + 1].view(dt).float()).all()])
    flat = torch.cat([ok, ok])
    assert _all_finite([flat[:ok.numel()].view(dt), flat[ok.numel():].view(dt)], flat)
    bad = next(i for i in range(256) if not torch.isfinite(patterns[i:i + 1].view(dt).float()).all())
    flat[ok.numel() + 3] = bad
    parts = [flat[:ok.numel()].view(dt), flat[ok.numel():].view(dt)]
    assert not _all_finite(parts, flat) and not _all_finite(parts) and _all_finite(parts[:1])


def test_covering_bytes():
    b = pack([("a", torch.ones(4, 3)), ("b", torch.ones(5))])
    named = b.named_tensors()
    cov = _covering_bytes([t for _, t in named])
    assert cov is not None and cov.data_ptr() == b.flat.data_ptr() and cov.numel() == b.flat.numel()
    assert _covering_bytes([named[0][1], named[0][1]]) is None          # overlapping
    assert _covering_bytes([named[0][1], torch.ones(5)]) is None        # another storage
    assert _covering_bytes([named[1][1]]).numel() == 20
