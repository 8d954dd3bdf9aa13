"""The client's request/response fields vs sglang's own dataclasses.

Importing `sglang.srt.managers.io_struct` from the wheel installed with --no-deps fails (it needs
psutil, msgspec, zmq and sglang's runtime); so this test parses the wheel's *source* with `ast`
when the wheel is installed, and always checks the client against the field list pinned in
megarl/wire/protocol.py (copied from sglang 0.5.23).
"""
import ast
import asyncio
import importlib.util
import os

import pytest
from aiohttp import web

from megarl.wire import protocol
from megarl.rollout.client import GenerateOutput, SGLangClient, sampling_params
from tests.helpers.http import serve

# Pinned from sglang 0.5.23 (io_struct.py / sampling_params.py): the full field sets of the
# classes megarl talks to, so a client field that sglang does not have is caught even without
# the wheel.
PINNED_0_5_23 = {
    "InitWeightsUpdateGroupReqInput": {"rid", "http_worker_ipc", "master_address", "master_port", "rank_offset",
                                       "world_size", "group_name", "backend"},
    "UpdateWeightsFromDistributedReqInput": {"rid", "http_worker_ipc", "names", "dtypes", "shapes", "group_name",
                                             "flush_cache", "abort_all_requests", "weight_version", "load_format",
                                             "selector", "torch_empty_cache"},
    "UpdateWeightsFromTensorReqInput": {"rid", "http_worker_ipc", "serialized_named_tensors", "load_format",
                                        "flush_cache", "abort_all_requests", "weight_version", "selector",
                                        "torch_empty_cache"},
    "UpdateWeightFromDiskReqInput": {"rid", "http_worker_ipc", "model_path", "load_format", "abort_all_requests",
                                     "weight_version", "is_async", "torch_empty_cache", "keep_pause",
                                     "recapture_cuda_graph", "token_step", "flush_cache", "manifest"},
    "ReleaseMemoryOccupationReqInput": {"rid", "http_worker_ipc", "tags"},
    "ResumeMemoryOccupationReqInput": {"rid", "http_worker_ipc", "tags"},
}


def _sglang_root():
    spec = importlib.util.find_spec("sglang")  # does not import sglang
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _class_fields(path, names):
    tree = ast.parse(open(path).read())
    out = {}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(cls):
        f = set()
        for b in cls.bases:
            if isinstance(b, ast.Name) and b.id in classes:
                f |= fields(classes[b.id])
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                f.add(st.target.id)
        return f
    for n in names:
        if n in classes:
            out[n] = fields(classes[n])
    return out


def _sglang_version(root):
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:
        return None


def test_parsed_fields_are_sglangs_own_request_classes():
    """The field sets read from io_struct.py's source (what the other tests compare against)
    equal the fields of SGLang's own request classes, imported by SGLang's runtime in the CPU
    harness environment (msgspec Structs and dataclasses alike)."""
    import json
    import subprocess

    from tests.sglang_cpu.server import sglang_cpu_python

    root = _sglang_root()
    assert root is not None, "sglang wheel not installed (launch/install.sh installs it)"
    names = sorted(set(protocol.SGLANG_CLASSES) | set(PINNED_0_5_23))
    code = ("import dataclasses, json, sys\n"
            "import tests.sglang_cpu.stubs as stubs; stubs.install()\n"
            "import sglang.srt.managers.io_struct as io\n"
            "from sglang.srt.sampling import sampling_params as sp\n"
            "out = {}\n"
            "for n in sys.argv[1:]:\n"
            "    c = getattr(io, n, None) or getattr(sp, n)\n"
            "    out[n] = sorted(c.__struct_fields__ if hasattr(c, '__struct_fields__') else\n"
            "                    [f.name for f in dataclasses.fields(c)])\n"
            "print(json.dumps(out))\n")
    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sglang_cpu_python(), "-c", code, *names], capture_output=True, text=True, timeout=300,
                         cwd=root_dir, env=dict(os.environ, PYTHONPATH=root_dir))
    assert run.returncode == 0, run.stderr[-2000:]
    real = json.loads(run.stdout.strip().splitlines()[-1])
    parsed = _class_fields(os.path.join(root, "srt/managers/io_struct.py"), names)
    parsed.update(_class_fields(os.path.join(root, "srt/sampling/sampling_params.py"), ["SamplingParams"]))
    for n in names:
        if n == "SamplingParams":
            continue   # a plain class with __init__ parameters, read from its signature elsewhere
        assert sorted(parsed[n]) == real[n], n


def test_protocol_fields_exist_in_installed_sglang():
    root = _sglang_root()
    if root is None:
        pytest.skip("sglang wheel not installed (pip install --no-deps sglang==0.5.23)")
    io = _class_fields(os.path.join(root, "srt/managers/io_struct.py"), list(protocol.SGLANG_CLASSES))
    sp = _class_fields(os.path.join(root, "srt/sampling/sampling_params.py"), ["SamplingParams"])
    io.update(sp)
    # GenerateReqInput is a dataclass (annotated fields too)
    for cls, ours in protocol.SGLANG_CLASSES.items():
        assert cls in io, f"{cls} not found in sglang {_sglang_version(root)}"
        missing = set(ours) - io[cls]
        assert not missing, f"{cls}: megarl uses {missing} which sglang {_sglang_version(root)} lacks"
    for cls, full in PINNED_0_5_23.items():
        if _sglang_version(root) == protocol.SGLANG_VERSION:
            assert io[cls] == full, f"pinned {cls} drifted from the wheel"
    # sglang ignores unknown request fields (our checksum extension relies on it)
    src = open(os.path.join(root, "srt/utils/msgspec_utils.py")).read()
    assert 'extra_behavior="ignore"' in src
    # flattened_bucket receive path exists for update_weights_from_distributed
    wu = open(os.path.join(root, "srt/model_executor/model_runner_components/weight_updater.py")).read()
    assert 'load_format == "flattened_bucket"' in wu and "_receive_bucketed_weights_from_distributed" in wu


def test_pinned_lists_cover_client_protocol():
    for cls, ours in protocol.SGLANG_CLASSES.items():
        if cls in PINNED_0_5_23:
            assert set(ours) <= PINNED_0_5_23[cls], cls


def test_client_sends_only_sglang_fields():
    """Every JSON body the client sends uses sglang field names (+ documented megarl extensions)."""
    seen = {}

    async def handler(request):
        body = await request.json() if request.can_read_body else {}
        seen[request.path] = body or {}
        if request.path == "/generate":
            return web.json_response([{"output_ids": [3, 4], "meta_info": {
                "id": "x", "finish_reason": {"type": "stop", "matched": 4}, "prompt_tokens": 2,
                "completion_tokens": 2, "output_token_logprobs": [[-0.5, 3, None], [-0.25, 4, None]]}}] * 2)
        if request.path == "/flush_cache":
            return web.Response(text="Cache flushed.\n")
        if request.path in ("/release_memory_occupation", "/resume_memory_occupation"):
            return web.Response()
        return web.json_response({"success": True, "message": "ok"})

    path_cls = {"/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
                "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
                "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
                "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
                "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
                "/resume_memory_occupation": "ResumeMemoryOccupationReqInput"}

    async def main():
        runner, port = await serve(handler)
        async with SGLangClient(f"http://127.0.0.1:{port}") as c:
            outs = await c.generate([1, 2], sampling_params(max_new_tokens=2, temperature=0.5, top_p=0.9, top_k=5,
                                                            stop_token_ids=[4], n=2, sampling_seed=1))
            await c.generate([1, 2], lora_path="megarl-lora-step1")   # adapter-only pushes name the adapter
            await c.update_weight_version("step1")
            await c.init_weights_update_group("127.0.0.1", 1234, 1, 2, "g", "gloo")
            await c.update_weights_from_distributed(["a"], ["float32"], [[2]], group_name="g",
                                                    load_format="flattened_bucket", weight_version="v1",
                                                    checksums=["x"])
            await c.update_weights_from_tensor(["AAAA"], weight_version="v1", checksums=["x"])
            await c.update_weights_from_disk("/tmp/x", weight_version="v1")
            await c.flush_cache()
            await c.release_memory_occupation(["kv_cache"])
            await c.resume_memory_occupation(["kv_cache"])
        await runner.cleanup()
        return outs

    outs = asyncio.run(main())
    g = seen["/generate"]
    assert set(g) <= set(protocol.GENERATE_REQ_FIELDS) | set(protocol.GENERATE_LORA_FIELDS)
    assert g["lora_path"] == "megarl-lora-step1"
    assert seen["/update_weight_version"] == {"new_version": "step1", "abort_all_requests": False}
    assert set(g["sampling_params"]) <= set(protocol.SAMPLING_PARAMS_FIELDS)
    for path, cls in path_cls.items():
        allowed = set(PINNED_0_5_23[cls]) | set(protocol.EXTENSION_FIELDS.get(cls, ()))
        assert set(seen[path]) <= allowed, (path, set(seen[path]) - allowed)
    assert seen["/update_weights_from_distributed"][protocol.CHECKSUM_FIELD] == ["x"]
    assert len(outs) == 2 and outs[0].output_ids == [3, 4] and outs[0].logprobs == [-0.5, -0.25]
    assert outs[0].finish_reason == "stop" and outs[0].matched == 4


def test_parse_sglang_shaped_response():
    o = GenerateOutput.from_json({"text": "hi", "output_ids": [7], "meta_info": {
        "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3, "weight_version": "w",
        "output_token_logprobs": [[-1.0, 7, None]]}})
    assert (o.output_ids, o.logprobs, o.finish_reason, o.prompt_tokens, o.text, o.weight_version) == \
        ([7], [-1.0], "length", 3, "hi", "w")


def test_documented_sglang_launch_flags_exist():
    """The launch flags in ARCHITECTURE.md ("Real SGLang") are sglang server-arg fields
    (sglang derives `--a-b` from field `a_b` in srt/arg_groups/fields/*.py)."""
    import glob
    import re
    root = _sglang_root()
    if root is None:
        pytest.skip("sglang wheel not installed")
    src = "".join(open(f).read() for f in glob.glob(os.path.join(root, "srt/arg_groups/fields/*.py")))
    # `--config FILE` is not a field: sglang's server_args.py adds it to the parser itself and
    # merges the file's keys (utils/server_args_config_parser.py)
    server_args = open(os.path.join(root, "srt/server_args.py")).read()
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ARCHITECTURE.md")).read()
    sg = doc.split("## Real SGLang")[1].split("## Embedded")[0]
    flags = set(re.findall(r"--([a-z][a-z0-9-]+)", sg))
    assert {"skip-tokenizer-init", "disable-radix-cache", "enable-memory-saver", "model-path"} <= flags
    for f in flags:
        if f in ("host", "port"):
            continue
        if f == "config":
            assert '"--config"' in server_args
            continue
        assert re.search(rf"^\s+{f.replace('-', '_')}\s*:", src, re.M), f
