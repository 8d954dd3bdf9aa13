"""Adapter-only pushes against SGLang 0.5.23's own code (its CPU environment): the body megarl
builds for ``/load_lora_adapter_from_tensors`` is validated by SGLang's request model (as its
FastAPI route does), normalized and unpickled per TP rank by SGLang's ``TpModelWorker`` (exact
allowlist, its sha256 check of ``expected_checksums``), and the PEFT config parsed by SGLang's
``LoRAConfig``; a tampered checksum is refused by SGLang. The LoRA request/endpoint field names
are checked against the wheel's ``io_struct.py`` / ``http_server.py`` source."""
from __future__ import annotations

import json
import os
import subprocess

import torch

from megarl.parallel import spawn
from megarl.wire import protocol
from tests.dist_utils import make_tiny_hf
from tests.sglang_cpu.server import sglang_cpu_python
from tests.test_client_fields import _class_fields, _sglang_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SGLANG_SIDE = r"""
import json, sys
import tests.sglang_cpu.stubs as stubs; stubs.install()
import pydantic
from types import SimpleNamespace
from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

out = {}
for case, path in (("as_sent", sys.argv[1]), ("tampered", sys.argv[3])):
    b = json.load(open(path))   # each body once: a consumer's read releases CPU shared memory
    if case == "tampered":
        name = sorted(b["expected_checksums"])[0]
        b["expected_checksums"] = dict(b["expected_checksums"], **{name: "0" * 64})
    obj = pydantic.TypeAdapter(LoadLoRAAdapterFromTensorsReqInput).validate_python(b)   # FastAPI's Body()
    obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
    obj.lora_id = LoRARef(lora_name=obj.lora_name, lora_path="__tensor__", pinned=obj.pinned).lora_id
    seen = {}

    class Runner:   # the model runner's LoRA manager entry point, recording what it was handed
        def load_lora_adapter_from_tensors(self, ref, tensors, config_dict, added_tokens):
            c = LoRAConfig.from_dict(config_dict, added_tokens, base_vocab_size=int(sys.argv[2]))
            seen.update(name=ref.lora_name, r=c.r, alpha=c.lora_alpha, targets=sorted(c.target_modules),
                        sums={k: float(v.double().sum()) for k, v in tensors.items()},
                        shapes={k: list(v.shape) for k, v in tensors.items()})
            return "loaded"

    worker = SimpleNamespace(model_runner=Runner())
    worker.deserialize_own_rank = lambda p: TpModelWorker.deserialize_own_rank(worker, p)
    for rank in range(len(obj.serialized_named_tensors)):
        with get_parallel().override(tp_rank=rank):
            try:
                res = TpModelWorker.load_lora_adapter_from_tensors(worker, obj)
                out.setdefault(case, []).append({"result": res, **seen})
            except RuntimeError as e:
                out.setdefault(case, []).append({"error": str(e)})
print(json.dumps(out))
"""


def _adapters(rank, world, hf_dir):
    from megarl.models import build_model, load_hf_weights
    from megarl.models.lora import LoRASpec, apply_lora, lora_layers, peft_state_dict
    from megarl.parallel import init_model_parallel

    init_model_parallel()
    chunks = build_model(hf_dir)
    load_hf_weights(chunks, hf_dir)
    apply_lora(chunks, LoRASpec(rank=4, alpha=8.0))
    for layer in lora_layers(chunks):     # a trained adapter: B no longer zero
        for pair in layer.adapters.values():
            with torch.no_grad():
                pair.lora_B.normal_(0, 0.02)
    return peft_state_dict(chunks)


def test_adapter_push_body_is_accepted_by_sglangs_own_request_path(tmp_path):
    import torch.multiprocessing as tmp

    from megarl.models.lora import LoRASpec, peft_config
    from megarl.sync.adapter import adapter_name, load_from_tensors_request

    make_tiny_hf("qwen2", tmp_path / "hf")
    tensors = spawn(_adapters, 1, str(tmp_path / "hf"))[0]
    tmp.set_sharing_strategy("file_system")   # megarl's tensor transport on CPU
    body = load_from_tensors_request(adapter_name("step3"), peft_config(LoRASpec(rank=4, alpha=8.0)), tensors, 2)
    (tmp_path / "body.json").write_text(json.dumps(body))
    copies = {k: v.clone() for k, v in tensors.items()}   # the tampered body's own shared memory
    other = load_from_tensors_request(adapter_name("step3"), peft_config(LoRASpec(rank=4, alpha=8.0)), copies, 2)
    (tmp_path / "tampered.json").write_text(json.dumps(other))
    run = subprocess.run([sglang_cpu_python(), "-c", SGLANG_SIDE, str(tmp_path / "body.json"), "160",
                          str(tmp_path / "tampered.json")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got["as_sent"]) == 2      # each TP rank read its own payload
    for r in got["as_sent"]:
        assert r["result"] == "loaded" and r["name"] == "megarl-lora-step3"
        assert r["r"] == 4 and r["alpha"] == 8.0
        assert r["targets"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        assert r["shapes"] == {k: list(v.shape) for k, v in tensors.items()}
        for k, v in tensors.items():
            assert abs(r["sums"][k] - float(v.double().sum())) < 1e-9, k
    assert all("MISMATCH" in r["error"] for r in got["tampered"]), got["tampered"]


def test_lora_fields_and_endpoints_exist_in_the_wheel():
    root = _sglang_root()
    assert root is not None, "sglang wheel not installed (launch/install.sh installs it)"
    io = _class_fields(os.path.join(root, "srt/managers/io_struct.py"),
                       ["GenerateReqInput", "LoadLoRAAdapterReqInput", "LoadLoRAAdapterFromTensorsReqInput",
                        "UnloadLoRAAdapterReqInput"])
    assert set(protocol.GENERATE_LORA_FIELDS) <= io["GenerateReqInput"]
    for cls in ("LoadLoRAAdapterReqInput", "LoadLoRAAdapterFromTensorsReqInput", "UnloadLoRAAdapterReqInput"):
        assert set(protocol.SGLANG_CLASSES[cls]) <= io[cls], cls
    server = open(os.path.join(root, "srt/entrypoints/http_server.py")).read()
    for key in ("load_lora_adapter", "load_lora_adapter_from_tensors", "unload_lora_adapter"):
        assert f'@app.api_route("{protocol.ENDPOINTS[key][1]}", methods=["POST"])' in server, key
    assert f'@app.post("{protocol.ENDPOINTS["update_weight_version"][1]}")' in server


_PARSE_LORA = r"""
import json, sys
import tests.sglang_cpu  # noqa: F401
from sglang.srt.server_args import prepare_server_args
argv, body = json.load(sys.stdin)
a = prepare_server_args(argv)
from sglang.srt.managers.io_struct import GenerateReqInput
g = GenerateReqInput(**body)
g.normalize_batch_and_arguments()
print(json.dumps({"generate_lora_path": g.lora_path, "enable_lora": a.enable_lora, "max_lora_rank": a.max_lora_rank, "load_format": a.load_format,
                  "enable_memory_saver": a.enable_memory_saver, "enable_weights_cpu_backup": a.enable_weights_cpu_backup,
                  "lora_target_modules": sorted(a.lora_target_modules), "lora_paths": a.lora_paths}))
"""


def test_adapter_push_launch_flags_parse_with_sglangs_own_server_args(tmp_path):
    """``actor.lora.push: adapter`` on the 7B LoRA recipe: SGLang's own ``prepare_server_args`` reads
    LoRA on, the adapters' rank and targets (its adapter memory pool is sized from them) and the base
    loaded from the checkpoint (only adapters are pushed) and, colocated, kept in host memory while
    released (no push would restore it); merged pushes keep the dummy load."""
    from pathlib import Path

    from megarl.config import load_config
    from megarl.rollout.launch import LaunchSpec, sglang_args
    from tests.sglang_cpu.server import harness_env

    recipe = Path(ROOT) / "recipes" / "qwen2.5-7b-lora-grpo.yaml"
    cfg = load_config(recipe, ["actor.lora.push=adapter"])
    argv = sglang_args(cfg, Path("/models/x"), LaunchSpec(0, "10.0.0.1", 30000))
    # a batched /generate as the rollout manager sends it: one adapter name for every prompt
    body = {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True,
            "stream": False, "lora_path": "megarl-lora-step1"}
    run = subprocess.run([sglang_cpu_python(), "-c", _PARSE_LORA], input=json.dumps([argv, body]), capture_output=True,
                         text=True, env=harness_env(), cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    a = json.loads(run.stdout.strip().splitlines()[-1])
    assert a.pop("generate_lora_path") == ["megarl-lora-step1"] * 2   # SGLang applies it to each prompt
    assert a == {"enable_lora": True, "max_lora_rank": 64, "load_format": "auto", "lora_paths": None,
                 "enable_memory_saver": True, "enable_weights_cpu_backup": True,
                 "lora_target_modules": sorted(cfg.actor.lora.target_modules)}, a
    merged = sglang_args(load_config(recipe, []), Path("/models/x"), LaunchSpec(0, "10.0.0.1", 30000))
    assert "--enable-lora" not in merged and merged[merged.index("--load-format") + 1] == "dummy"
    assert "--enable-weights-cpu-backup" not in merged


def test_adapter_push_config_errors_name_the_field():
    import pytest

    from megarl.config import load_config
    from megarl.config.loader import ConfigError
    from tests.helpers.runs import DEFAULT

    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, ["actor.lora.rank=4", "actor.lora.push=adapter", "rollout.mode=async",
                              "placement.mode=disaggregated", "cluster.nodes=2"])
    lines = [ln.strip() for ln in str(e.value).splitlines() if ln.strip().startswith("actor.lora.push")]
    assert len(lines) == 2 and "cluster.nodes=2" in lines[0] and "sync.transport=disk" in lines[0], lines
    assert "needs rollout.mode=sync" in lines[1], lines
    cfg = load_config(DEFAULT, ["actor.lora.rank=4", "actor.lora.push=adapter", "cluster.nodes=2", "sync.transport=disk"])
    assert cfg.actor.lora.push == "adapter"
