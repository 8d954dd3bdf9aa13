"""FP8 rollout against the other sides' own code: transformers' FP8 loader reads what
`megarl convert hf-to-fp8` writes; SGLang 0.5.23's own server code (CPU harness, TP2) receives
from a TP2 megatron trainer exactly the bytes SGLang's own block quantizer makes, over all three
transports; the loop runs with an FP8 TP2 embedded server, TIS on by default.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.fp8_convert import convert_hf_to_fp8, read_quantized
from tests.helpers.models import make_tiny_chat_model
from tests.helpers.runs import ROOT, tiny_run_config
from tests.sglang_cpu.server import SGLangCPUServer, harness_env, server_command, sglang_cpu_python

pytestmark = pytest.mark.integration
API_KEY = "fp8-conformance-key-0123456789"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama whose dims are whole 128-blocks (transformers' FP8 loader needs that) and its
    block-FP8 copies (fp32 scales, and ue8m0 scales as SGLang's quantizer makes them)."""
    root = tmp_path_factory.mktemp("fp8")
    base = make_tiny_chat_model(root / "base", hidden=128, heads=4, kv_heads=2)
    fp32 = root / "fp8_fp32"
    ue8m0 = root / "fp8_ue8m0"
    convert_hf_to_fp8(str(base), str(fp32), "fp32", verbose=False)
    convert_hf_to_fp8(str(base), str(ue8m0), "ue8m0", verbose=False)
    return base, fp32, ue8m0


def test_convert_loads_in_transformers_and_the_engine_serves_it(models, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.engine.model import DecoderModel

    base, fp8, _ = models
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128]}
    deq = read_quantized(str(fp8))
    # transformers' own FP8 loader (on CPU it dequantizes with its own code) gives the same weights
    hf = AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.float32).eval()
    state = hf.state_dict()
    for name, w in deq.items():
        if name in state:
            assert torch.equal(state[name].float(), w), name
    assert any(n.endswith("q_proj.weight") for n in deq) and "model.embed_tokens.weight" in deq
    # only the projections are FP8; norms and embeddings are kept as they were
    from safetensors import safe_open
    with safe_open(str(next(fp8.glob("*.safetensors"))), framework="pt") as fh:
        dtypes = {k: fh.get_tensor(k).dtype for k in fh.keys()}
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.0.mlp.down_proj.weight_scale_inv"] == torch.float32
    assert dtypes["model.layers.0.input_layernorm.weight"] != torch.float8_e4m3fn
    assert dtypes["model.embed_tokens.weight"] != torch.float8_e4m3fn
    # the embedded engine serving the FP8 folder computes what transformers computes
    engine = DecoderModel(AutoConfig.from_pretrained(fp8))
    engine.load_hf_dir(str(fp8))
    ids = [1, 17, 42, 99, 7, 64, 3, 250]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (engine.forward_full(ids) - ref).abs().max().item() < 1e-4
    # ... and differs from the unquantized model by the FP8 rounding, not by nothing
    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(torch.tensor([ids])).logits[0] - ref).abs().max().item() > 1e-4


def test_convert_cli_refuses_in_one_line(models, tmp_path, capsys):
    from megarl.checkpoint.cli import convert_main

    _, fp8, _ = models
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("kept")
    for args, words in ((["--hf", str(models[0]), "--out", str(tmp_path / "full")], "--out"),
                        (["--hf", str(tmp_path / "none"), "--out", str(tmp_path / "y")], "--hf"),
                        (["--hf", str(models[0]), "--out", str(models[0])], "--out")):
        assert convert_main(["hf-to-fp8", *args]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    # as users run it: the command line, one line, no traceback
    done = subprocess.run([sys.executable, "-m", "megarl", "convert", "hf-to-fp8", "--hf", str(fp8), "--out",
                           str(tmp_path / "x")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = [x for x in done.stderr.strip().splitlines() if "Warning" not in x and "warnings.warn" not in x]
    assert done.returncode != 0 and len(lines) == 1 and "already quantized" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / "full" / "keep.txt").read_text() == "kept" and not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------
# a TP2 megatron trainer pushes into a TP2 SGLang server serving the FP8 checkpoint
# ------------------------------------------------------------------------------------------------

_SGLANG_QUANT = r"""
import hashlib, json, sys, torch
import tests.sglang_cpu  # noqa: F401
from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8
weights = torch.load(sys.argv[1])
def digest(t):
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
out = {}
for name, w in weights["quantized"].items():
    q, s = per_block_cast_to_fp8(w)
    out[name] = ["float8_e4m3fn", digest(q)]
    out[name + "_scale_inv"] = ["float32", digest(s)]
print(json.dumps(out))
"""


def _push_rank(rank, world, hf_dir, served_dir, url, api_key, disk_dir, dump):
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.models import build_model, iter_hf_weights, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.quant.served import read_served_format
    from megarl.sync.push import WeightPusher, is_sender_rank, push_megatron, sender_group_name
    from megarl.sync.rank import checkpoint_names
    from megarl.sync.session import weight_update_session

    apply_cpu_shim()
    init_model_parallel(tp=2)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    g = torch.Generator().manual_seed(5)   # a "training step" (the same on both ranks)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    names = checkpoint_names(served_dir)
    served = read_served_format(served_dir, names)
    weights = dict(iter_hf_weights(chunks, cfg))
    if rank == 0:
        torch.save({"quantized": {n: w.clone() for n, w in weights.items() if n in served.quantized},
                    "kept": {n: w.clone() for n, w in weights.items() if n not in served.quantized}}, dump)
    stats = {}
    for transport in ("distributed", "tensor", "disk"):
        pusher = None
        if is_sender_rank():
            pusher = WeightPusher([url], transport=transport, bucket_mb=0.25, server_tp_sizes=[2], api_key=api_key,
                                  group_name=sender_group_name(f"fp8_{transport}"), disk_dir=disk_dir, timeout_s=120,
                                  known_names=names, served=served)
            pusher.connect()
        with weight_update_session([url], api_key=api_key) if rank == 0 else _nothing():
            dist.barrier()
            stats[transport] = push_megatron(chunks, cfg, pusher, weight_version=f"fp8_{transport}").as_dict()
            dist.barrier()
        if pusher:
            pusher.close()
    return stats


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_tp2_fp8_push_into_tp2_sglang_lands_sglang_quantized_bytes(models, tmp_path):
    from megarl.parallel import spawn
    from tests.sglang_cpu.model import tensor_digest

    base, _, served = models   # ue8m0 scales: SGLang's own per_block_cast_to_fp8 is the reference
    record = tmp_path / "record"
    cfg = tiny_run_config(base, tmp_path / "cfg", "rollout.engine=sglang", "rollout.tp=2",
                          f"rollout.model_path={served}",
                          "rollout.server_command=[" + ",".join(server_command()) + "]")
    from megarl.rollout.launch import sglang_args, LaunchSpec
    assert sglang_args(cfg, served, LaunchSpec(0, "127.0.0.1", 1))[-2:] == ["--quantization", "fp8"]
    with SGLangCPUServer(served, cfg, tmp_path / "logs", 0, API_KEY, str(record)) as server:
        dump = tmp_path / "trainer_weights.pt"
        stats = spawn(_push_rank, 2, str(base), str(served), server.url, API_KEY, str(tmp_path / "disk"),
                      str(dump), timeout_s=600)[0]
    ref = subprocess.run([sglang_cpu_python(), "-c", _SGLANG_QUANT, str(dump)], capture_output=True, text=True,
                         env=harness_env(), cwd=ROOT, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = json.loads(ref.stdout.strip().splitlines()[-1])
    kept = torch.load(dump)["kept"]
    expected.update({n: [str(t.dtype).replace("torch.", ""), tensor_digest(t)] for n, t in kept.items()})
    expected.pop("lm_head.weight", None)       # tied: SGLang's models skip it
    assert any(v[0] == "float8_e4m3fn" for v in expected.values())
    for rank in (0, 1):
        loads = [json.loads(x) for x in (record / f"rank{rank}.jsonl").read_text().splitlines()]
        # one load per bucket (distributed, tensor) and one for disk, the same weights each time:
        # every load must hold SGLang's bytes, whichever transport brought it
        assert len(loads) >= 3
        got: dict = {}
        for line in loads:
            for n, v in line["tensors"].items():
                assert v == expected.get(n), f"rank {rank}, load {line['load']}: {n} differs from SGLang's bytes"
                got[n] = v
        assert set(got) == set(expected), sorted(set(got) ^ set(expected))[:5]
    # every transport moved exactly the FP8 bytes (1 per element + fp32 scales) and the kept tensors
    dumped = torch.load(dump)
    want = sum(w.numel() + 4 * (-(-w.shape[0] // 128)) * (-(-w.shape[1] // 128)) for w in dumped["quantized"].values())
    want += sum(t.numel() * t.element_size() for t in dumped["kept"].values())
    assert {t: s["bytes"] for t, s in stats.items()} == {t: want for t in stats}


# ------------------------------------------------------------------------------------------------
# the loop: FP8 TP2 embedded server, TIS on by default, step-0 check at the FP8 bound
# ------------------------------------------------------------------------------------------------

def test_grpo_with_fp8_rollout_on_a_tp2_embedded_server(models, tmp_path):
    from megarl.algos.fidelity import logprob_bound
    from megarl.trainer import Trainer

    base, fp8, _ = models
    cfg = tiny_run_config(base, tmp_path / "run", f"rollout.model_path={fp8}", "rollout.tp=2",
                          "trainer.total_steps=2", "trainer.eval_before_after=false", "checkpoint.export_hf=false")
    trainer = Trainer(cfg)
    steps = trainer.run()["steps"]
    rc = cfg.algorithm.rollout_correction                       # on by default with FP8 rollout: TIS at 2
    assert (rc.enabled, rc.level, rc.mode, rc.lower, rc.upper) == (True, "token", "truncate", None, 2.0)
    assert trainer.logprob_bound.rollout_dtype == "float32+fp8_block"
    assert trainer.logprob_bound.bound == logprob_bound("float32", "float32+fp8_block").bound
    for s in steps:
        # the servers hold the FP8-rounded weights: not the trainer's exactly, within the FP8 bound
        assert 1e-4 < s["rollout/logprob_diff_mean"] < trainer.logprob_bound.bound, s["rollout/logprob_diff_mean"]
        assert "actor/rollout_is_weight_mean" in s and s["actor/rollout_kl_k3"] > 0
    # each push moved the FP8 checkpoint's tensors: 1 byte per FP8 element, fp32 for the rest
    from safetensors import safe_open
    with safe_open(str(next(fp8.glob("*.safetensors"))), framework="pt") as fh:
        want = sum(t.numel() * (1 if t.dtype == torch.float8_e4m3fn else 4) for t in map(fh.get_tensor, fh.keys()))
    assert [s["sync/bytes"] for s in steps] == [want] * len(steps)
