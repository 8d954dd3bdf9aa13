"""megarl.checkpoint: HF -> megatron (torch_dist, saved at TP2) -> load at TP1 / PP2 / EP2 gives HF's
logits; -> HF is bit-exact and loads in transformers; corrupted / removed / missing / extra
tensors are refused by name; atomic save with extra state; CLI."""
import os
import pickle
import shutil

import pytest
import torch

from dist_utils import hf_logits, make_tiny_hf, sample_ids

from megarl.checkpoint import CheckpointVerificationError, convert_hf_to_megatron, convert_megatron_to_hf
from megarl.models.naming import SafetensorsSource
from megarl.parallel import SpawnError, spawn

TOL = 1e-4


def _load_and_forward(rank, world, ckpt, layout, ids):
    from megarl.checkpoint import load_megatron
    from megarl.checkpoint.megatron_io import read_meta
    from megarl.models import build_model, forward_logits, load_hf_config
    from megarl.parallel import init_model_parallel
    init_model_parallel(**layout)
    cfg = load_hf_config(dict(read_meta(ckpt)["hf_config"]))
    chunks = build_model(cfg)
    load_megatron(chunks, ckpt)  # manifest verified
    out = forward_logits(chunks, ids)
    return None if out is None else out


def _logits_from(results):
    outs = [r for r in results if r is not None]
    assert outs
    return outs[0]


def _read_all(d):
    src = SafetensorsSource(d)
    return dict(src.read(src.names()))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            model = make_tiny_hf(family, root / "hf")
            ids = sample_ids()
            res = convert_hf_to_megatron(root / "hf", root / "ckpt", tp=2, verbose=False)
            cache[family] = (root, model, ids, hf_logits(model, ids), res)
        return cache[family]
    return get


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe", "deepseek_v3"])
def test_tp2_checkpoint_loads_at_tp1_pp2_ep2_and_exports_bit_exact(family, converted):
    root, model, ids, ref, res = converted(family)
    ckpt = root / "ckpt"
    assert res["peak_rss_mb"] > 0 and (ckpt / "megarl_manifest.json").exists()
    # logits at other layouts than the save layout
    assert (_logits_from(spawn(_load_and_forward, 1, str(ckpt), dict(tp=1), ids)) - ref).abs().max() < TOL
    layout = dict(ep=2) if family != "qwen2" else dict(pp=2)
    assert (_logits_from(spawn(_load_and_forward, 2, str(ckpt), layout, ids)) - ref).abs().max() < TOL
    # export from a third layout; every tensor bit-exact, same names, same dtypes
    out = root / "back"
    convert_megatron_to_hf(ckpt, out, **({"ep": 2} if family != "qwen2" else {"pp": 2}), verbose=False)
    a, b = _read_all(root / "hf"), _read_all(out)
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, bad
    from transformers import AutoModelForCausalLM
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert torch.equal(hf_logits(back, ids), ref)


def _copy_ckpt(root, name):
    dst = root / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(root / "ckpt", dst)
    return dst


def test_corrupted_tensor_is_refused_with_its_name(converted):
    from torch.distributed.checkpoint import FileSystemReader
    root, model, ids, ref, _ = converted("qwen3_moe")
    ck = _copy_ckpt(root, "corrupt")
    md = FileSystemReader(str(ck)).read_metadata()
    items = [(k, v) for k, v in md.storage_data.items()
             if k.fqn.endswith("mlp.experts.experts.linear_fc2.weight")]
    assert items, sorted({k.fqn for k in md.storage_data})
    k, v = max(items, key=lambda kv: kv[1].length)
    with open(ck / v.relative_path, "r+b") as f:
        f.seek(v.offset + v.length // 2)
        f.write(b"\x41" * 64)
    with pytest.raises(SpawnError) as ei:
        spawn(_load_and_forward, 1, str(ck), dict(tp=1), ids)
    msg = str(ei.value)
    assert "CheckpointVerificationError" in msg and "checksum" in msg
    assert "mlp.experts." in msg and ".down_proj.weight" in msg, msg


def test_removed_tensor_is_refused_with_its_name(converted):
    from torch.distributed.checkpoint import FileSystemReader
    root, model, ids, ref, _ = converted("qwen3_moe")
    ck = _copy_ckpt(root, "removed")
    md = FileSystemReader(str(ck)).read_metadata()
    fqn = "decoder.layers.1.mlp.router.weight"
    del md.state_dict_metadata[fqn]
    for k in [k for k in md.storage_data if k.fqn == fqn]:
        del md.storage_data[k]
    with open(ck / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(SpawnError) as ei:
        spawn(_load_and_forward, 1, str(ck), dict(tp=1), ids)
    msg = str(ei.value)
    assert "CheckpointVerificationError" in msg and "missing" in msg and fqn in msg, msg


def _rewrite_hf(src_dir, dst_dir, drop=(), add=None):
    from safetensors.torch import save_file
    shutil.rmtree(dst_dir, ignore_errors=True)
    os.makedirs(dst_dir)
    shutil.copy(os.path.join(src_dir, "config.json"), dst_dir)
    sd = {k: v for k, v in _read_all(src_dir).items() if k not in drop}
    sd.update(add or {})
    save_file(sd, os.path.join(dst_dir, "model.safetensors"))


def test_hf_checkpoint_with_missing_expert_is_refused(converted, tmp_path):
    root, *_ = converted("qwen3_moe")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite_hf(root / "hf", tmp_path / "hf", drop=[name])
    with pytest.raises(SpawnError) as ei:
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "ckpt", verbose=False)
    assert name in str(ei.value) and "missing" in str(ei.value)
    assert not (tmp_path / "ckpt").exists()


def test_hf_checkpoint_with_extra_expert_is_refused(converted, tmp_path):
    root, *_ = converted("qwen3_moe")
    name = "model.layers.0.mlp.experts.4.gate_proj.weight"  # config says 4 experts (0..3)
    _rewrite_hf(root / "hf", tmp_path / "hf", add={name: torch.zeros(32, 64)})
    with pytest.raises(SpawnError) as ei:
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "ckpt", ep=2, verbose=False)
    assert name in str(ei.value) and "extra" in str(ei.value)


def _save_load_extra(rank, world, hf_dir, ckpt):
    from megarl.checkpoint import load_megatron, save_megatron
    from megarl.models import build_model, forward_logits, load_hf_weights
    from megarl.parallel import init_model_parallel
    init_model_parallel(tp=2)
    chunks = build_model(hf_dir)
    load_hf_weights(chunks, hf_dir)
    save_megatron(chunks, ckpt, extra_state={"step": 7, "tokens": 123}, verbose=False)
    save_megatron(chunks, ckpt, extra_state={"step": 8}, verbose=False)  # overwrite atomically
    fresh = build_model(hf_dir)
    extra = load_megatron(fresh, ckpt)
    return extra, sorted(os.listdir(os.path.dirname(ckpt)))


def test_save_load_atomic_with_extra_state(tmp_path):
    make_tiny_hf("llama", tmp_path / "hf")
    res = spawn(_save_load_extra, 2, str(tmp_path / "hf"), str(tmp_path / "run" / "ckpt"))
    extra, listing = res[0]
    assert extra == {"step": 8}
    assert listing == ["ckpt"]  # no tmp / old dirs left behind


def test_convert_cli(converted, tmp_path, capsys):
    from megarl.checkpoint import convert_main
    root, model, ids, ref, _ = converted("qwen2")
    assert convert_main(["hf-to-megatron", "--hf", str(root / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2"]) == 0
    assert convert_main(["megatron-to-hf", "--ckpt", str(tmp_path / "c"), "--out",
                         str(tmp_path / "h")]) == 0
    out = capsys.readouterr().out
    assert "[megarl.convert]" in out
    a, b = _read_all(root / "hf"), _read_all(tmp_path / "h")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert convert_main(["megatron-to-hf", "--ckpt", str(tmp_path / "nope"), "--out",
                         str(tmp_path / "x")]) != 0
