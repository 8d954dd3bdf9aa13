"""`megarl serve --tp-size 2`: real rank processes, HF parity, SGLang's per-rank weight-update
contract (rank_offset + tp_rank, one tensor payload per rank, all-or-none), no orphans."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors import safe_open

from megarl.wire.addresses import free_port
from tests.helpers.servers import ServerProcess, make_tiny_hf_model
from tests.helpers.weights_http import (DistributedSender, call, flattened_payload, generate, list_payload, ok)

torch.set_num_threads(1)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [200, 100, 50, 25, 12, 6, 3, 1, 0, 9, 8]]
N = 10


def hf_logprobs(model, prompt, out_ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + out_ids])).logits[0].float(), -1)
    return torch.stack([lp[len(prompt) - 1 + i, t] for i, t in enumerate(out_ids)])


def hf_greedy(model, prompt, n=N):
    return model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def assert_serves(url, hf, prompts=PROMPTS):
    """The server's greedy tokens are HF's and its logprobs HF's forward (fp32)."""
    for p in prompts:
        out = generate(url, p, N)
        ids = out["output_ids"]
        assert ids == hf_greedy(hf, p), p
        lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        assert (hf_logprobs(hf, p, ids) - lps).abs().max().item() < 1e-4


def checkpoint_tensors(d):
    """(name, tensor) exactly as the HF checkpoint names them (per-expert names for MoE)."""
    out = []
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), framework="pt") as fh:
                out += [(k, fh.get_tensor(k)) for k in fh.keys()]
    return out


def buckets(named, n=4):
    step = (len(named) + n - 1) // n
    return [named[i:i + step] for i in range(0, len(named), step)]


FAMILIES = {
    # llama with every bias: q/k/v biases are split with their heads, o_proj/down biases added once
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_equals_tp1_and_hf(tmp_path, family, capsys):
    d = str(tmp_path / family)
    hf = make_tiny_hf_model(d, family, std=0.3, **FAMILIES[family])
    outs = {}
    for tp in (1, 2):
        t0 = time.time()
        with ServerProcess(d, extra=["--tp-size", str(tp)]) as s:
            ready_s = time.time() - t0
            info = call(s.url, "/get_server_info")[1]
            assert info["tp_size"] == tp
            outs[tp] = [generate(s.url, p, N) for p in PROMPTS]
            if tp == 2:
                assert_serves(s.url, hf)
                with capsys.disabled():
                    print(f"\n[tp] {family}: TP2 server ready in {ready_s:.1f}s")
    for a, b in zip(outs[1], outs[2]):
        assert a["output_ids"] == b["output_ids"]            # token for token
        la = torch.tensor([x[0] for x in a["meta_info"]["output_token_logprobs"]])
        lb = torch.tensor([x[0] for x in b["meta_info"]["output_token_logprobs"]])
        assert (la - lb).abs().max().item() < 1e-5           # fp32 rounding of the all-reduce


@pytest.mark.parametrize("kernels", ["triton", "triton-proj"])
def test_tp2_triton_decode_step_serves_hfs_tokens(tmp_path, kernels):
    """The Triton decode step on each of 2 ranks (its heads and MLP columns; o/down summed by the
    all-reduce -- with triton-proj, from the rank's split-K partial sums) serves HF's greedy tokens
    and logprobs. (Compiled on a GPU, interpreted here: the server inherits TRITON_INTERPRET.)"""
    d = str(tmp_path / "m")
    hf = make_tiny_hf_model(d, "qwen2", std=0.3, head_dim=32)
    with ServerProcess(d, extra=["--tp-size", "2"], env={"MEGARL_DECODE_KERNELS": kernels}) as s:
        assert_serves(s.url, hf)


def test_tp_size_that_does_not_divide_is_refused_before_loading(tmp_path):
    d = str(tmp_path / "m")
    make_tiny_hf_model(d, "qwen3_moe", moe_intermediate_size=30)
    r = subprocess.run([sys.executable, "-m", "megarl.engine", d, "--tp-size", "4", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("megarl serve: error:")]
    assert len(lines) == 1, r.stderr
    # names each field that 4 does not divide (heads 4 do divide; kv heads 2 and 30 do not)
    assert "num_key_value_heads=2" in lines[0] and "moe_intermediate_size=30" in lines[0]
    assert "num_attention_heads" not in lines[0]
    assert "listening" not in r.stdout                        # nothing was started (no time bound: a
    # loaded box starts python slowly, and the exit code and the missing "listening" already say it)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_moe")
    models = {k: make_tiny_hf_model(str(d / k), "qwen3_moe", seed=i, std=0.3) for i, k in enumerate("abc")}
    return d, models


@pytest.fixture(scope="module")
def tp2(moe):
    d, _ = moe
    s = ServerProcess(str(d / "a"), extra=["--tp-size", "2", "--weights-dir", str(d / "weights")])
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_distributed_update_joins_as_rank_offset_plus_tp_rank(moe, tp2):
    d, m = moe
    assert_serves(tp2.url, m["a"], PROMPTS[:1])
    snd = DistributedSender([tp2.url], [2], free_port(), group="g_dist")
    status, body = snd.init_answers[0]
    assert status == 200 and "ranks 1..2 of 3" in body["message"], body
    ok(tp2.url, "/begin_weight_update")
    for b in buckets(checkpoint_tensors(str(d / "b"))):
        (status, body), = snd.push(b, weight_version="b")
        assert status == 200, body
    ok(tp2.url, "/end_weight_update")
    snd.close()
    assert_serves(tp2.url, m["b"])
    assert generate(tp2.url, PROMPTS[0])["meta_info"]["weight_version"] == "b"


def test_a_world_without_room_for_every_tp_rank_is_refused_and_the_server_lives(moe, tp2):
    """A sender that counts this TP2 server as one rank (world 2, offset 1) would put TP rank 1 at
    rank 2 of 2: refused on every rank before any rendezvous, and the server keeps serving."""
    d, m = moe
    status, body = call(tp2.url, "/init_weights_update_group",
                        {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                         "world_size": 2, "group_name": "g_small", "backend": "gloo"})
    assert status == 400 and "do not fit world_size 2" in body["message"], body
    assert_serves(tp2.url, m["b"])


def test_tensor_update_reads_one_payload_per_rank_all_or_none(moe, tp2):
    d, m = moe
    named = checkpoint_tensors(str(d / "a"))
    ok(tp2.url, "/begin_weight_update")
    # SGLang's deserialize_own_rank: payload r is rank r's; fewer payloads than ranks is a 400
    status, body = call(tp2.url, "/update_weights_from_tensor",
                        {"serialized_named_tensors": [flattened_payload(named[:3])], "load_format": "flattened_bucket"})
    assert status == 400 and "1 payload(s) but this server has 2 TP ranks" in body["message"], body
    for i, b in enumerate(buckets(named)):
        fmt, make = (("flattened_bucket", flattened_payload) if i % 2 else (None, list_payload))
        ok(tp2.url, "/update_weights_from_tensor",
           {"serialized_named_tensors": [make(b), make(b)], "load_format": fmt, "weight_version": "a2"})
    assert_serves(tp2.url, m["a"])
    # rank 1's payload holds a NaN, rank 0's is good: refused on BOTH ranks (rank 0 applies nothing)
    other = dict(checkpoint_tensors(str(d / "c")))
    victim = "model.layers.1.mlp.experts.2.down_proj.weight"
    good = [(k, other[k]) for k in other if "layers.1." in k]
    bad = [(k, torch.full_like(v, float("nan")) if k == victim else v) for k, v in good]
    status, body = call(tp2.url, "/update_weights_from_tensor",
                        {"serialized_named_tensors": [flattened_payload(good), flattened_payload(bad)],
                         "load_format": "flattened_bucket"})
    assert status == 400, body
    assert body["message"] == f"refused, old weights kept: tp rank 1: non-finite values in {victim}"
    ok(tp2.url, "/end_weight_update")
    assert_serves(tp2.url, m["a"])                      # still all of model a, on every rank
    assert generate(tp2.url, PROMPTS[0])["meta_info"]["weight_version"] == "a2"


def test_disk_update_on_every_rank(moe, tp2):
    d, m = moe
    import shutil
    shutil.copytree(d / "c", d / "weights" / "c")
    body = ok(tp2.url, "/update_weights_from_disk", {"model_path": str(d / "weights" / "c"), "weight_version": "c"})
    assert body["num_paused_requests"] == 0
    assert_serves(tp2.url, m["c"])


def test_release_and_resume_on_every_rank(moe, tp2):
    d, m = moe
    before = generate(tp2.url, PROMPTS[0])
    assert call(tp2.url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    status, body = call(tp2.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert status == 400 and "memory released" in body["error"]["message"]
    assert call(tp2.url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    after = generate(tp2.url, PROMPTS[0])
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


def test_released_weights_are_dropped_on_every_rank_until_pushed(moe, tp2):
    """SGLang drops released weights without --enable-weights-cpu-backup (the fixture has none):
    after the resume both ranks refuse to generate, and a push brings every rank's slice back."""
    import shutil
    d, m = moe
    assert call(tp2.url, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})[0] == 200
    assert call(tp2.url, "/resume_memory_occupation", {})[0] == 200
    status, body = call(tp2.url, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert status == 400 and "--enable-weights-cpu-backup" in body["error"]["message"], body
    shutil.copytree(d / "c", d / "weights" / "c", dirs_exist_ok=True)
    ok(tp2.url, "/update_weights_from_disk", {"model_path": str(d / "weights" / "c"), "weight_version": "c"})
    assert_serves(tp2.url, m["c"])


def _children(pid):
    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _gone(pids, timeout=120.0):   # a hang guard: returns as soon as they are gone
    t_end = time.time() + timeout
    while time.time() < t_end:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_ranks_die_with_the_server(tmp_path):
    d = str(tmp_path / "m")
    make_tiny_hf_model(d, "llama")
    # a killed rank 0 (no chance to clean up) takes its ranks with it
    s = ServerProcess(d, extra=["--tp-size", "2"]).wait_ready()
    kids = _children(s.proc.pid)
    assert len(kids) == 1
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(120)
    assert _gone(kids), "tp rank 1 outlived a SIGKILLed rank 0"
    # a dead rank takes the server down (it cannot serve with half a model)
    s = ServerProcess(d, extra=["--tp-size", "2"]).wait_ready()
    kid, = _children(s.proc.pid)
    os.kill(kid, signal.SIGKILL)
    assert s.proc.wait(120) == 1
    assert "tp rank 1 exited" in s.host.log_tail(20000)
    # (a normal stop leaving nothing behind: test_megarl_pusher_drives_tp1_and_tp2_servers_with_a_key)


def test_megarl_pusher_drives_tp1_and_tp2_servers_with_a_key(tmp_path):
    """The trainer's own WeightPusher (sessions, SGLang rank numbering, one payload per TP rank,
    the API key) into a TP1 and a TP2 embedded server at once, over all three transports."""
    from megarl.sync.push import WeightPusher
    key = "k-" + os.urandom(8).hex()
    d = str(tmp_path)
    m = {k: make_tiny_hf_model(f"{d}/{k}", "qwen2", seed=i, std=0.3) for i, k in enumerate("ab")}
    env = {"MEGARL_API_KEY": key}
    s1 = ServerProcess(f"{d}/a", extra=["--weights-dir", f"{d}/w"], env=env)
    s2 = ServerProcess(f"{d}/a", extra=["--tp-size", "2", "--weights-dir", f"{d}/w"], env=env)
    try:
        urls = [s1.wait_ready().url, s2.wait_ready().url]
        for transport, src in [("distributed", "b"), ("tensor", "a"), ("disk", "b")]:
            p = WeightPusher(urls, transport=transport, bucket_mb=0.03, server_tp_sizes=[1, 2], api_key=key,
                             disk_dir=f"{d}/w/push", hf_config_dir=f"{d}/{src}", group_name=f"g_{transport}")
            with p.session():
                st = p.push(checkpoint_tensors(f"{d}/{src}"), weight_version=transport)
            p.close()
            assert st.buckets > 1 or transport == "disk"
            for u in urls:
                status, info = call(u, "/get_model_info", key=key)
                assert status == 200 and info["weight_version"] == transport
                for prompt in PROMPTS[:2]:
                    out = generate(u, prompt, N, key=key)
                    assert out["output_ids"] == hf_greedy(m[src], prompt), (transport, u)
        kids = _children(s2.proc.pid)
        assert len(kids) == 1
    finally:
        s1.stop()
        s2.stop()
    assert _gone(kids)                 # a normal stop leaves no rank behind
