"""The embedded server serves LoRA adapters the way SGLang 0.5.23 does (`megarl/engine/lora.py`):
an adapter loaded from tensors (megarl's own ``/load_lora_adapter_from_tensors`` body) or from a
PEFT folder under ``--weights-dir`` gives, through ``lora_path``, the greedy tokens and logprobs
of the same server running the merged weights ``W + (alpha/r) B A`` (merged here, independently
of the engine) and the logprobs of HF ``peft`` on the base model -- at TP1 and TP2 (adapters
sliced over ranks). Bad checksums, unknown names, paths outside the allowed folder are refused
with one line; an unload waits for the requests still running the adapter."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megarl.models.lora import ALL_TARGETS, LoRASpec, peft_config
from tests.helpers.servers import ServerProcess, make_tiny_hf_model
from tests.helpers.weights_http import call, ok
from tests.test_server_tp import hf_greedy, hf_logprobs

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [200, 100, 50, 25, 12, 6, 3]]
N = 8
SPEC = LoRASpec(rank=4, alpha=8.0)


def _peft_tensors(hf) -> dict[str, torch.Tensor]:
    """A trained-looking adapter on every target projection of ``hf``, in PEFT's saved names."""
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, mod in hf.named_modules():
        if name.rsplit(".", 1)[-1] in ALL_TARGETS:
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(SPEC.rank, mod.in_features, generator=g) * 0.2
            out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(mod.out_features, SPEC.rank, generator=g) * 0.2
    return out


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """Base model, a PEFT adapter folder (inside the servers' weights dir) and the merged model."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("lora_engine")
    hf = make_tiny_hf_model(str(d / "base"), "qwen2", std=0.3)
    tensors = _peft_tensors(hf)
    peft_dir = d / "weights" / "adapter"
    peft_dir.mkdir(parents=True)
    save_file(tensors, str(peft_dir / "adapter_model.safetensors"))
    (peft_dir / "adapter_config.json").write_text(json.dumps(peft_config(SPEC, str(d / "base"))))
    merged = {k: v.clone() for k, v in hf.state_dict().items()}
    for k in tensors:
        if ".lora_A." in k:
            module = k[len("base_model.model."):-len(".lora_A.weight")]
            b = tensors[k.replace(".lora_A.", ".lora_B.")]
            merged[module + ".weight"] += SPEC.scaling * b @ tensors[k]
    save_file({k: v.contiguous() for k, v in merged.items()}, str(d / "weights" / "merged.safetensors"))
    (d / "weights" / "merged").mkdir()
    os.replace(d / "weights" / "merged.safetensors", d / "weights" / "merged" / "model.safetensors")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(d / "base"), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(peft_dir)).eval()
    return d, hf, tensors, adapted


def _gen(url: str, prompt, lora=None) -> dict:
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": N, "temperature": 0}}
    if lora is not None:
        body["lora_path"] = lora
    return ok(url, "/generate", body)


def _lps(out: dict) -> torch.Tensor:
    return torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])


@pytest.mark.parametrize("tp", [1, 2])
def test_adapter_serving_equals_merged_weights_and_peft(lora_setup, tp):
    import torch.multiprocessing as tmp

    from megarl.sync.adapter import load_from_tensors_request

    d, hf, tensors, adapted = lora_setup
    tmp.set_sharing_strategy("file_system")   # megarl's tensor transport on CPU
    with ServerProcess(str(d / "base"), extra=["--tp-size", str(tp), "--enable-lora",
                                               "--weights-dir", str(d / "weights")]) as s:
        body = load_from_tensors_request("v1", peft_config(SPEC), tensors, tp)
        assert ok(s.url, "/load_lora_adapter_from_tensors", body)["loaded_adapters"] == {"v1": "v1"}
        ok(s.url, "/load_lora_adapter", {"lora_name": "disk", "lora_path": str(d / "weights" / "adapter")})
        served = {}
        for p in PROMPTS:
            base, v1, disk = _gen(s.url, p), _gen(s.url, p, "v1"), _gen(s.url, p, "disk")
            assert base["output_ids"] == hf_greedy(hf, p, N), "the base must stay untouched"
            assert v1["output_ids"] == disk["output_ids"] and torch.equal(_lps(v1), _lps(disk))
            assert (hf_logprobs(adapted, p, v1["output_ids"]) - _lps(v1)).abs().max() < 1e-4   # HF peft
            served[tuple(p)] = v1
        # one batch mixing the base and the adapter: each row runs its own
        mixed = ok(s.url, "/generate", {"input_ids": PROMPTS[:2], "lora_path": [None, "v1"], "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": N, "temperature": 0}})
        assert mixed[0]["output_ids"] == hf_greedy(hf, PROMPTS[0], N)
        assert mixed[1]["output_ids"] == served[tuple(PROMPTS[1])]["output_ids"]
        # the same server running the merged weights W + (alpha/r) B A (merged outside the engine)
        ok(s.url, "/update_weights_from_disk", {"model_path": str(d / "weights" / "merged")})
        for p in PROMPTS:
            m = _gen(s.url, p)
            assert m["output_ids"] == served[tuple(p)]["output_ids"], (tp, p)
            assert (_lps(m) - _lps(served[tuple(p)])).abs().max() < 1e-5
        if tp == 2:
            _refusals(s.url, d, tensors)


def _refusals(url: str, d, tensors) -> None:
    """One line naming the field, and nothing half-loaded on any rank."""
    from megarl.sync.adapter import load_from_tensors_request

    copies = {k: v.clone() for k, v in tensors.items()}
    body = load_from_tensors_request("bad", peft_config(SPEC), copies, 2)
    victim = sorted(body["expected_checksums"])[0]
    body["expected_checksums"][victim] = "0" * 64
    status, out = call(url, "/load_lora_adapter_from_tensors", body)
    assert status == 400 and "expected_checksums mismatch: 1 value-diff" in out["error_message"], out
    assert victim in out["error_message"] and "bad" not in out["loaded_adapters"]
    status, out = call(url, "/generate", {"input_ids": PROMPTS[0], "lora_path": "bad"})
    assert status == 400 and "lora_path: LoRA adapter 'bad' is not loaded" in out["error"]["message"], out
    status, out = call(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(d / "base")})
    assert status == 400 and out["error_message"].startswith("lora_path ") and "outside the allowed" in out["error_message"]
    status, out = call(url, "/load_lora_adapter_from_tensors",
                       load_from_tensors_request("v1", peft_config(SPEC), {k: v.clone() for k, v in tensors.items()}, 2))
    assert status == 400 and "already loaded" in out["error_message"], out
    ok(url, "/unload_lora_adapter", {"lora_name": "v1"})
    status, out = call(url, "/generate", {"input_ids": PROMPTS[0], "lora_path": "v1"})
    assert status == 400 and "not loaded" in out["error"]["message"]
    status, out = call(url, "/unload_lora_adapter", {"lora_name": "v1"})
    assert status == 400 and "lora_name: no adapter named 'v1'" in out["error_message"]


def test_unload_waits_for_the_requests_running_the_adapter(lora_setup):
    """A request admitted under an adapter finishes under it even when the adapter is unloaded
    mid-generation (the trainer unloads the previous version after each push)."""
    from megarl.engine.engine import Engine, Request, Sampling
    from megarl.engine.lora import build_adapter
    from megarl.engine.model import DecoderModel

    d, hf, tensors, adapted = lora_setup
    model = DecoderModel(hf.config)
    model.load_hf_dir(str(d / "base"))
    model.adapters["v1"] = build_adapter("v1", peft_config(SPEC), tensors, model)
    eng = Engine(model, max_running=4, max_len=64)
    eng.loras.add("v1")
    eng.start()
    try:
        req = Request(input_ids=PROMPTS[0], sampling=Sampling(max_new_tokens=40, temperature=0.0, ignore_eos=True),
                      return_logprob=True, lora="v1")
        fut = eng.submit(req)
        while not fut.done() and not eng.control(eng.requests, new_epoch=False).result()["running"]:
            pass
        running = not fut.done()
        assert eng.control(lambda: eng.unload_lora("v1")).result()
        assert "v1" in model.adapters or not running      # still there while the request runs
        out = fut.result(timeout=60)
        eng.control(lambda: None).result()
        assert "v1" not in model.adapters                 # dropped once it finished
        with pytest.raises(ValueError, match="lora_path: LoRA adapter 'v1' is not loaded"):
            eng.submit(Request(input_ids=PROMPTS[0], sampling=Sampling(max_new_tokens=2), lora="v1"))
    finally:
        eng.stop()
    ids = out["output_ids"]
    assert len(ids) == 40
    assert (hf_logprobs(adapted, PROMPTS[0], ids) - _lps(out)).abs().max() < 1e-4


def test_driver_adapter_push_over_both_routes(lora_setup):
    """The trainer's ``AdapterPush`` (what ``WeightSync.push`` runs with ``actor.lora.push: adapter``)
    into a real server: a PEFT folder (``sync.transport=disk``), then tensors by shared memory; each
    version under its own name, requests pointed at it, the previous one unloaded, the servers'
    ``weight_version`` set; a restarted server (TP2: one payload per rank) gets the current adapter alone."""
    from types import SimpleNamespace

    from megarl.config import load_config
    from megarl.sync.adapter import adapter_name
    from megarl.sync.adapter_push import AdapterPush
    from tests.helpers.runs import DEFAULT

    d, hf, tensors, adapted = lora_setup
    names = sorted(tensors)
    stages = [{k: tensors[k] for k in names[:len(names) // 2]}, {k: tensors[k] for k in names[len(names) // 2:]}]
    actor = SimpleNamespace(call=lambda method: [dict(s) for s in stages] if method == "adapter_tensors" else None)
    p = PROMPTS[0]
    with ServerProcess(str(d / "base"), extra=["--enable-lora", "--weights-dir", str(d / "weights")]) as s:
        servers = SimpleNamespace(urls=[s.url], tp_sizes=[1], api_key=None, weights_dir=str(d / "weights"),
                                  lora_name=None)
        for transport, version in (("disk", "step1"), ("ipc", "step2")):
            cfg = load_config(DEFAULT, ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.push=adapter",
                                        f"sync.transport={transport}"])
            push = AdapterPush(cfg, actor, servers, str(d / "base"))
            push.current = servers.lora_name           # the run's previous version (one object per run)
            stats = push.push(version)
            assert servers.lora_name == adapter_name(version)
            assert stats["sync/bytes"] == sum(t.numel() * 4 for t in tensors.values())
            out = _gen(s.url, p, servers.lora_name)
            assert out["meta_info"]["weight_version"] == version
            assert (hf_logprobs(adapted, p, out["output_ids"]) - _lps(out)).abs().max() < 1e-4
        assert call(s.url, "/get_model_info")[1]["megarl_lora_adapters"] == [adapter_name("step2")]
        status, body = call(s.url, "/generate", {"input_ids": p, "lora_path": adapter_name("step1")})
        assert status == 400 and "not loaded" in body["error"]["message"]   # retired after step2 loaded
        assert not (d / "weights" / "lora" / adapter_name("step1")).exists()
    with ServerProcess(str(d / "base"), extra=["--enable-lora", "--weights-dir", str(d / "weights"),
                                               "--tp-size", "2"]) as s2:
        servers.urls, servers.tp_sizes = [s2.url], [2]   # a restarted server (here TP2): the base only
        push.push_to_restarted(0, "step2")
        out = _gen(s2.url, p, servers.lora_name)
        assert out["meta_info"]["weight_version"] == "step2"
        assert (hf_logprobs(adapted, p, out["output_ids"]) - _lps(out)).abs().max() < 1e-4
        # the same shared tensors once more: each TP rank's read took only its own payload's reference
        push.push("step3")
        assert _gen(s2.url, p, adapter_name("step3"))["output_ids"] == out["output_ids"]
