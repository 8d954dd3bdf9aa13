"""Security of the embedded server: the exact unpickler allowlist (vs SGLang's own list and real
payloads; exploit payloads refused without side effect, over HTTP too), the API key (SGLang's
decision function, 401s, never on argv, never inherited by the TP ranks), `--weights-dir`."""
import ast
import importlib.util
import inspect
import io
import os
import pickle
import subprocess
import sys

import psutil
import pytest
import torch

from megarl.wire.addresses import free_port
from megarl.engine import auth, unpickle
from tests.helpers.servers import ServerProcess, make_tiny_hf_model
from megarl.wire import flattened as wire
from tests.helpers.weights_http import call, generate, list_payload, ok, shm_flat
from tests.test_server_sessions import _sglang_file
from tests.test_server_tp import assert_serves, checkpoint_tensors

KEY = "test-key-6f1c2a9e"


# ---------------------------------------------------------------------- unpickler
def _sglang_allowed_globals():
    tree = ast.parse(open(_sglang_file("srt/utils/common.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SafeUnpickler")
    assign = next(n for n in cls.body if isinstance(n, ast.Assign) and n.targets[0].id == "ALLOWED_GLOBALS")
    return ast.literal_eval(assign.value)


def test_allowlist_is_an_exact_subset_of_sglangs():
    theirs = _sglang_allowed_globals()
    assert ("torch", "Tensor") in theirs and len(theirs) > 100      # parsed the real list
    assert unpickle.ALLOWED_GLOBALS <= theirs, sorted(unpickle.ALLOWED_GLOBALS - theirs)
    # exact names only: nothing that resolves attributes, evaluates, imports or runs commands
    assert all("." not in name for _, name in unpickle.ALLOWED_GLOBALS)
    for m, n in [("builtins", "getattr"), ("builtins", "eval"), ("builtins", "exec"), ("builtins", "__import__"),
                 ("functools", "partial"), ("torch", "load"), ("os", "system"), ("posix", "system")]:
        assert (m, n) not in unpickle.ALLOWED_GLOBALS


class _Recorder(pickle.Unpickler):
    """Lists the globals a payload names (and resolves them like the real unpickler would)."""

    def __init__(self, data):
        super().__init__(io.BytesIO(data))
        self.seen = set()

    def find_class(self, module, name):
        self.seen.add((module, name))
        if (module, name) == wire.SGLANG_FLAT_META_GLOBAL:
            return wire.FlattenedTensorMetadata
        return super().find_class(module, name)


def test_real_payloads_use_only_allowed_globals_and_roundtrip():
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp
    # torch's default on Linux shares CPU tensors as file descriptors: useless towards a server
    # process (an fd cannot be passed to an unrelated process), so refused with a hint
    tmp.set_sharing_strategy("file_descriptor")
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("x", torch.ones(3).share_memory_())])
    with pytest.raises(unpickle.UnsafePayload, match="rebuild_storage_fd.*set_sharing_strategy\\('file_system'\\)"):
        unpickle.loads(buf.getvalue())
    tmp.set_sharing_strategy("file_system")   # what megarl's tensor transport uses on CPU
    g = torch.Generator().manual_seed(0)
    tensors = {"fp32": torch.randn(3, 5, generator=g), "bf16": torch.randn(4, generator=g).bfloat16(),
               "fp16_t": torch.randn(4, 4, generator=g).half().t(), "empty": torch.empty(0),
               "param": torch.nn.Parameter(torch.randn(2, generator=g)), "int64": torch.arange(6)}
    payloads = []
    for name, t in tensors.items():      # SGLang's default format, pickled by torch's ForkingPickler
        shared = t.detach().clone().share_memory_() if not isinstance(t, torch.nn.Parameter) else t.share_memory_()
        buf = io.BytesIO()
        ForkingPickler(buf).dump([(name, shared)])
        payloads.append((buf.getvalue(), [(name, t)]))
    named = [("a", torch.randn(2, 3, generator=g)), ("b", torch.randn(5, generator=g))]
    b = shm_flat(named)   # the flattened format, pickled by megarl's wire (SGLang's metadata global)
    payloads.append((wire.dumps({"flattened_tensor": b.flat, "metadata": wire.flat_metadata(b.meta.entries, b.meta.dtype)}),
                     None))
    seen = set()
    for data, expect in payloads:
        r = _Recorder(data)
        r.load()
        seen |= r.seen
        got = unpickle.loads(data)
        if expect is not None:
            (n1, t1), = got
            (n0, t0), = expect
            assert n1 == n0 and t1.dtype == t0.dtype and torch.equal(t1.detach(), t0.detach())
            assert type(t1) is type(t0)
        else:
            metas = got["metadata"]
            assert all(isinstance(m, wire.FlattenedTensorMetadata) for m in metas)
            for m, (n, t) in zip(metas, named):
                assert m.name == n and torch.equal(got["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).view(m.shape), t)
    assert seen <= unpickle.ALLOWED_GLOBALS, sorted(seen - unpickle.ALLOWED_GLOBALS)
    assert ("torch.multiprocessing.reductions", "rebuild_storage_filename") in seen   # file_system sharing seen


def test_cuda_ipc_payload_globals_are_allowed():
    """No GPU here: read what torch's reduce_tensor puts in a CUDA tensor's pickle -- the rebuild
    function, type(tensor), type(tensor._typed_storage()), torch.Size, the dtype -- and check
    those globals (the only globals in it; the rest are ints, bytes and bools)."""
    from torch.multiprocessing import reductions as R
    src = inspect.getsource(R.reduce_tensor)
    assert "storage = tensor._typed_storage()" in src and "rebuild_cuda_tensor," in src and "type(storage)," in src
    t = torch.zeros(2, dtype=torch.bfloat16)
    for obj in (R.rebuild_cuda_tensor, type(t), type(t._typed_storage()), torch.nn.Parameter):
        assert (obj.__module__, obj.__qualname__) in unpickle.ALLOWED_GLOBALS, obj
    assert ("torch", "Size") in unpickle.ALLOWED_GLOBALS and ("torch", "bfloat16") in unpickle.ALLOWED_GLOBALS


def _exploits(marker):
    cmd = f"touch {marker}"
    return {
        # protocol 4 resolves dotted names: ("torch", "os.system") is os.system
        "torch.os.system": b"\x80\x04" + pickle.dumps("torch", 4)[2:-1] + pickle.dumps("os.system", 4)[2:-1]
        + b"\x93" + pickle.dumps((cmd,), 4)[2:-1] + b"R.",
        "builtins.getattr": f"cbuiltins\ngetattr\n(ctorch\nos\nVsystem\ntR(V{cmd}\ntR.".encode(),
        "builtins.eval": f"cbuiltins\neval\n(V__import__('os').system('{cmd}')\ntR.".encode(),
        "posix.system": f"cposix\nsystem\n(V{cmd}\ntR.".encode(),
        "reductions os.system": f"ctorch.multiprocessing.reductions\nos.system\n(V{cmd}\ntR.".encode(),
    }


_LIVE = """
import os, pickle, sys, torch
for i, line in enumerate(sys.stdin.read().split()):
    try:
        pickle.loads(bytes.fromhex(line))
    except Exception:
        pass
    print(os.path.exists(sys.argv[1] + str(i)))
"""


def test_exploit_payloads_are_live_and_refused(tmp_path):
    names = list(_exploits("x"))
    live = [_exploits(tmp_path / f"live{i}")[n] for i, n in enumerate(names)]
    # live: a plain unpickler runs them (so this test would catch a permissive allowlist); one
    # interpreter for all (plain pickle refuses a dotted GLOBAL name under protocol 0: the last)
    r = subprocess.run([sys.executable, "-c", _LIVE, str(tmp_path / "live")], capture_output=True, text=True,
                       input=" ".join(d.hex() for d in live), timeout=120)
    assert r.stdout.split() == ["True", "True", "True", "True", "False"], r.stderr
    marker = tmp_path / "pwned"
    for name, data in _exploits(marker).items():
        with pytest.raises(unpickle.UnsafePayload, match="refusing to unpickle global"):
            unpickle.loads(data)
        assert not marker.exists(), name


# ---------------------------------------------------------------------- API key: the decision
def _sglang_auth():
    spec = importlib.util.spec_from_file_location("sglang_auth_ref", _sglang_file("srt/utils/auth.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod     # (its dataclasses look their module up)
    spec.loader.exec_module(mod)     # stdlib-only module: runs without sglang's runtime
    return mod


def test_auth_decision_is_sglangs():
    ref = _sglang_auth()
    headers = [None, "", f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"Bearer {KEY}x", f"Bearer  {KEY}",
               f"Basic {KEY}", KEY, "Bearer", f"Bearer {KEY} ", f"Bearer {KEY[:-1]}", "Bearer "]
    paths = ["/generate", "/health", "/health_generate", "/healthz", "/ready", "/metrics", "/metricsfoo",
             "/update_weights_from_tensor", "/begin_weight_update", "/get_model_info", "/", "/unknown", "/Health",
             "/v1/health"]
    n = 0
    for key in (KEY, None):
        for method in ("GET", "POST", "OPTIONS"):
            for path in paths:
                for h in headers:
                    for level in (ref.AuthLevel.NORMAL, ref.AuthLevel.ADMIN_OPTIONAL):
                        want = ref.decide_request_auth(method=method, path=path, authorization_header=h, api_key=key,
                                                       admin_api_key=None, auth_level=level).allowed
                        assert auth.allowed(method, path, h, key) == want, (key, method, path, h, level)
                        n += 1
    assert n > 2000


# ---------------------------------------------------------------------- API key: the server
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sec")
    a = make_tiny_hf_model(str(d / "a"), "qwen2", seed=0, std=0.3)
    return d, a


@pytest.fixture(scope="module")
def keyed_tp2(model):
    """A TP2 server with an API key and no --weights-dir."""
    d, _ = model
    s = ServerProcess(str(d / "a"), extra=["--tp-size", "2"], env={"MEGARL_API_KEY": KEY})
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_api_key_required_everywhere_but_probes(keyed_tp2):
    url = keyed_tp2.url
    assert call(url, "/health")[0] == 200 and call(url, "/health_generate")[0] == 200
    for path, body in [("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
                       ("/get_model_info", None), ("/begin_weight_update", {}), ("/flush_cache", {}),
                       ("/update_weights_from_disk", {"model_path": "/"}), ("/nonexistent", None)]:
        assert call(url, path, body) == (401, {"error": "Unauthorized"}), path
        assert call(url, path, body, key=KEY + "x") == (401, {"error": "Unauthorized"}), path
    out = generate(url, [1, 2, 3], 3, key=KEY)
    assert len(out["output_ids"]) == 3


def test_key_is_not_on_argv_or_in_the_ranks_environment(keyed_tp2):
    rank0 = psutil.Process(keyed_tp2.proc.pid)
    ranks = rank0.children(recursive=True)
    assert len(ranks) == 1
    for p in [rank0] + ranks:
        assert KEY not in " ".join(p.cmdline())
    # rank 0 got the key in its environment from its launcher (/proc/PID/environ: owner-only);
    # it removes it there, so the TP ranks (and anything else it starts) never inherit it
    for p in ranks:
        assert KEY not in open(f"/proc/{p.pid}/environ", "rb").read().decode(errors="replace")


def test_exploit_payloads_over_http_are_400_without_side_effect(keyed_tp2, model, tmp_path):
    d, a = model
    url = keyed_tp2.url
    before = generate(url, [4, 5, 6], key=KEY)
    tensors = checkpoint_tensors(str(d / "a"))[:4]
    ok(url, "/begin_weight_update", {}, key=KEY)
    import base64
    for name, data in _exploits(tmp_path / "pwned").items():
        evil = base64.b64encode(data).decode()
        # evil on every rank / on rank 1 only: rank r reads payload r and nothing else
        # a fresh good payload each time: rank 0 opening a shared-memory handle consumes it
        good = list_payload(tensors)     # (load_format None: SGLang's default)
        for payloads, ranks in (([evil, evil], "tp ranks 0,1"), ([good, evil], "tp rank 1")):
            status, body = call(url, "/update_weights_from_tensor", {"serialized_named_tensors": payloads}, key=KEY)
            assert status == 400, (name, body)
            assert body["message"].startswith(f"refused, old weights kept: {ranks}: UnsafePayload: refusing to "
                                              f"unpickle global"), (name, body)
            assert not (tmp_path / "pwned").exists(), name
    ok(url, "/end_weight_update", {}, key=KEY)
    after = generate(url, [4, 5, 6], key=KEY)
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "default"


def test_disk_updates_off_without_weights_dir(keyed_tp2, model):
    d, _ = model
    status, body = call(keyed_tp2.url, "/update_weights_from_disk", {"model_path": str(d / "a")}, key=KEY)
    assert status == 400 and "start it with --weights-dir" in body["message"] and body["num_paused_requests"] == 0


def test_key_from_another_variable_and_never_from_argv(model):
    d, _ = model
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "megarl.engine", str(d / "a"), "--port", str(port),
                        "--api-key", KEY], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("megarl serve: error: --api-key is not accepted")
    assert len(r.stderr.strip().splitlines()) == 1
    with ServerProcess(str(d / "a"), extra=["--api-key-env", "MY_KEY"], env={"MY_KEY": "other"}) as s:
        assert call(s.url, "/get_model_info")[0] == 401
        assert call(s.url, "/get_model_info", key="other")[0] == 200
    with ServerProcess(str(d / "a"), env={"MEGARL_API_KEY": ""}) as s:   # no key: open, with a warning
        assert call(s.url, "/get_model_info")[0] == 200
        assert "no API key" in s.host.log_tail(20000)


def test_weights_dir_confines_disk_updates(model, tmp_path):
    d, a = model
    wd, outside = tmp_path / "w", tmp_path / "outside"
    import shutil
    shutil.copytree(d / "a", outside / "m")
    (wd / "sub").mkdir(parents=True)
    os.symlink(outside / "m", wd / "link")                         # a dir symlink leading out
    (wd / "filelink").mkdir()
    shutil.copy(d / "a" / "config.json", wd / "filelink")
    os.symlink(outside / "m" / "model.safetensors", wd / "filelink" / "model.safetensors")  # a file symlink out
    shutil.copytree(d / "a", wd / "sub" / "m")
    with ServerProcess(str(d / "a"), extra=["--weights-dir", str(wd)]) as s:
        for p in [outside / "m", wd / "link", wd / ".." / "outside" / "m"]:
            status, body = call(s.url, "/update_weights_from_disk", {"model_path": str(p)})
            assert status == 400, p
            assert f"model_path {str(p)!r}" in body["message"] and f"allowed weights dir {wd}" in body["message"], body
        status, body = call(s.url, "/update_weights_from_disk", {"model_path": str(wd / "filelink")})
        assert status == 400 and "outside the allowed weights dir" in body["message"], body
        ok(s.url, "/update_weights_from_disk", {"model_path": str(wd / "sub" / "m")})
        assert_serves(s.url, a)


@pytest.mark.parametrize("bad", ["-starts-like-an-option", "has space", "tab\there"])
def test_a_key_sglang_cannot_take_is_refused_before_the_run_starts(bad, tmp_path):
    """SGLang turns its --config file into argv: a key starting with '-' makes its parser exit
    ("argument --api-key: expected one argument"), so megarl refuses it up front, naming the variable."""
    env = dict(os.environ, MY_KEY=bad)
    r = subprocess.run([sys.executable, "-m", "megarl", "train", "recipes/smollm2-135m-grpo-cpu.yaml",
                        "rollout.api_key_env=MY_KEY", f"output_dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2 and "rollout.api_key_env: $MY_KEY: an API key must" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not list(tmp_path.iterdir())
