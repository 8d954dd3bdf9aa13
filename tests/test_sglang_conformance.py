"""megarl against SGLang 0.5.23's OWN server code: its launcher and argument parser, HTTP app and
API-key middleware, tokenizer manager, scheduler weight updater (sessions), TP worker and model-
runner weight updater, run on CPU with gloo (tests/sglang_cpu; only the model and batch scheduling
are replaced). Nothing here checks megarl against itself.

Servers: one TP1 and one TP2 SGLang server for the module (each started with the command line
megarl builds for a run), plus one that the trainer launches itself.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import torch

from megarl.rollout.client import SGLangClient, Unauthorized, sampling_params
from megarl.trainer import Trainer
from tests.helpers.runs import ROOT, tiny_model, tiny_run_config
from tests.sglang_cpu.server import SGLangCPUServer, harness_env, server_command, sglang_cpu_python

API_KEY = "conformance-" + secrets.token_urlsafe(8)


def _sglang_cfg(model: Path, out: Path, *overrides: str):
    command = "[" + ",".join(server_command()) + "]"
    return tiny_run_config(model, out, "rollout.engine=sglang", f"rollout.server_command={command}",
                           "rollout.n_per_prompt=2", "batch.prompts_per_step=2", "batch.global_batch_size=4",
                           "trainer.total_steps=2", "trainer.eval_before_after=false", "checkpoint.export_hf=false",
                           "rollout.logprob_diff_bound=1e-3", *overrides)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """A TP1 and a TP2 SGLang server (started together), each recording what its ranks loaded."""
    root = tmp_path_factory.mktemp("sglang")
    started = []
    try:
        for index, tp in enumerate((1, 2)):
            cfg = _sglang_cfg(model, root / f"cfg{tp}", f"rollout.tp={tp}")
            started.append(SGLangCPUServer(model, cfg, root / "logs", index, API_KEY, str(root / f"record_tp{tp}")))
        yield [s.wait_ready() for s in started]
    finally:
        for s in started:
            s.stop()


# --------------------------------------------------------------------------------------------
# launch command: megarl's flags for every multi-GPU recipe, parsed by SGLang's own parser
# --------------------------------------------------------------------------------------------

_PARSE = r"""
import json, sys
import tests.sglang_cpu  # noqa: F401
from sglang.srt.server_args import prepare_server_args
out = []
for argv in json.load(sys.stdin):
    a = prepare_server_args(argv)
    out.append({k: getattr(a, k) for k in ("tp_size", "nnodes", "node_rank", "dist_init_addr", "api_key",
                                           "load_format", "disable_radix_cache", "skip_tokenizer_init", "dtype",
                                           "enable_deterministic_inference", "enable_fp32_lm_head",
                                           "enable_memory_saver", "context_length", "host", "port",
                                           "enable_return_routed_experts", "quantization")})
print(json.dumps(out))
"""


def test_sglang_parses_megarl_launch_commands_for_every_multi_gpu_recipe(tmp_path):
    from megarl.config import load_config
    from megarl.rollout.launch import LaunchSpec, sglang_args

    from megarl.rollout.launch import sglang_key_file_text

    # keys YAML would misread if written bare (number, boolean, null, comment, quotes), and a
    # generated one: each must reach SGLang's server_args verbatim through its own --config reader
    tricky = iter([API_KEY, "0x1e5", "true", "null", "1e10", "a:#b'c\"d\\e", secrets.token_hex(32)] * 3)
    cases, expect, keys, contexts = [], [], [], []
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        plain = load_config(recipe, [])
        if plain.rollout.tp <= 1 or plain.cluster.device != "cuda":
            continue
        cfg = load_config(recipe, ["rollout.engine=sglang", "rollout.deterministic=true", "rollout.fp32_lm_head=true"])
        per_node = cfg.cluster.gpus_per_node
        nnodes = -(-cfg.rollout.tp // per_node) if cfg.rollout.tp > per_node else 1
        key_file = tmp_path / f"{recipe.stem}.yaml"
        key = next(tricky)
        key_file.write_text(sglang_key_file_text(key))
        for node in range(nnodes):
            keys.append(key)
            spec = LaunchSpec(0, "10.0.0.1", 30000, str(key_file), node, nnodes, "10.0.0.1:29500" if nnodes > 1 else None)
            cases.append(sglang_args(cfg, Path("/models/x"), spec))
            expect.append((recipe.stem, cfg.rollout.tp, nnodes, node, cfg.placement.mode == "colocated",
                           bool(cfg.model.arch.num_experts), cfg.rollout.quantization == "fp8"))
            # the longest request: prompt + one response, or a whole agent trajectory (turns + observations)
            response = cfg.agent.max_response_tokens if cfg.agent.enabled else cfg.rollout.sampling.max_new_tokens
            contexts.append(cfg.rollout.max_prompt_len + response)
    assert len({e[0] for e in expect}) >= 5, "the GPU recipes with rollout.tp > 1"
    assert any(e[2] > 1 for e in expect), "a recipe whose servers span nodes (DeepSeek-V3: tp 16 on 8-GPU nodes)"
    done = subprocess.run([sglang_cpu_python(), "-c", _PARSE], input=json.dumps(cases), capture_output=True,
                          text=True, env=harness_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(e[5] for e in expect) and not all(e[5] for e in expect), "MoE and dense recipes"
    assert any(e[6] for e in expect), "a recipe serving block FP8 (DeepSeek-V3 colocated)"
    assert any(load_config(r, []).agent.enabled for r in (ROOT / "recipes").glob("*.yaml") if "retool" in r.stem)
    for (recipe, tp, nnodes, node, colocated, moe, fp8), a, key, context in zip(expect, parsed, keys, contexts):
        assert a["quantization"] == ("fp8" if fp8 else None), recipe
        assert a["context_length"] == context, recipe
        assert a["tp_size"] == tp and a["nnodes"] == nnodes and a["node_rank"] == node, recipe
        assert a["api_key"] == key, f"{recipe}: the key comes from the --config file, never argv"
        assert a["load_format"] == "dummy" and a["disable_radix_cache"] and a["skip_tokenizer_init"], recipe
        assert a["dtype"] == "bfloat16" and a["enable_deterministic_inference"] and a["enable_fp32_lm_head"], recipe
        assert a["enable_memory_saver"] == colocated, recipe
        assert a["enable_return_routed_experts"] == moe, recipe   # R3: MoE servers record routed experts
        assert (a["dist_init_addr"] == "10.0.0.1:29500") == (nnodes > 1), recipe
        assert "--api-key" not in cases[parsed.index(a)]


# --------------------------------------------------------------------------------------------
# weight pushes from a TP2 megatron trainer into a TP1 and a TP2 server
# --------------------------------------------------------------------------------------------

def _push_rank(rank, world, hf_dir, urls, tps, api_key, disk_dir):
    import hashlib

    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.models import build_model, iter_hf_weights, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.sync.push import WeightPusher, is_sender_rank, push_megatron, sender_group_name
    from megarl.sync.session import weight_update_session

    apply_cpu_shim()
    init_model_parallel(tp=2)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    g = torch.Generator().manual_seed(5)  # a "training step" (same on both ranks)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    expected = {name: [str(t.dtype).replace("torch.", ""),
                       hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
                for name, t in iter_hf_weights(chunks, cfg)}
    timings = {}
    for transport in ("distributed", "tensor", "disk"):
        pusher = None
        if is_sender_rank():
            pusher = WeightPusher(urls, transport=transport, bucket_mb=0.25, server_tp_sizes=tps, api_key=api_key,
                                  group_name=sender_group_name(f"conf_{transport}"), disk_dir=disk_dir, timeout_s=120)
            pusher.connect()
        t0 = time.time()
        with weight_update_session(urls, api_key=api_key) if rank == 0 else _nothing():
            dist.barrier()
            stats = push_megatron(chunks, cfg, pusher, weight_version=f"v_{transport}")
            dist.barrier()
        timings[transport] = {"seconds": time.time() - t0, **stats.as_dict()}
        if pusher:
            pusher.close()
    return {"expected": expected if rank == 0 else None, "timings": timings}


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_tp2_megatron_push_into_tp1_and_tp2_sglang_servers_is_bit_exact(model, servers, tmp_path):
    """Distributed (world 1 + 1 + 2, SGLang's rank numbering), tensor (one payload per TP rank,
    flattened_bucket with SGLang's FlattenedTensorMetadata) and disk: every TP rank of both servers
    loads exactly the trainer's tensors."""
    from megarl.parallel import spawn

    urls = [s.url for s in servers]
    record_dirs = [Path(s.log).parent.parent / f"record_tp{tp}" for s, tp in zip(servers, (1, 2))]
    out = spawn(_push_rank, 2, str(model), urls, [1, 2], API_KEY, str(tmp_path / "disk"), timeout_s=600)
    expected = out[0]["expected"]
    assert len(expected) > 10
    names = set(expected) - {"lm_head.weight"}  # tied: SGLang's models skip it
    for tp, rec in zip((1, 2), record_dirs):
        lines = {int(f.stem[4:]): [json.loads(x) for x in f.read_text().splitlines()] for f in rec.glob("rank*.jsonl")}
        assert sorted(lines) == list(range(tp)), f"TP{tp}: every rank loaded weights"
        for rank, loads in lines.items():
            # the three transports' loads, last one per tensor wins (all three pushed the same weights)
            got = {n: v for line in loads for n, v in line["tensors"].items()}
            assert set(got) == names, f"TP{tp} rank {rank}: {sorted(set(got) ^ names)[:5]}"
            bad = [n for n in names if got[n] != expected[n]]
            assert not bad, f"TP{tp} rank {rank}: bytes differ for {bad[:3]}"
            assert len(loads) >= 3, "distributed and tensor arrive bucket by bucket, disk in one load"
    # each server answered the version of the last push
    info = asyncio.run(_info(urls[1]))
    assert info["weight_version"] == "v_disk"
    print("\n[sglang conformance] push seconds:", {k: round(v["seconds"], 3) for k, v in out[0]["timings"].items()})


async def _info(url):
    async with SGLangClient(url, api_key=API_KEY) as c:
        return await c.get_model_info()


# --------------------------------------------------------------------------------------------
# refusals: fast, one line, naming server and tensor; sessions left closed; API key
# --------------------------------------------------------------------------------------------

def test_refused_pushes_fail_fast_with_the_servers_words(model, servers):
    from megarl.sync.push import SyncError, WeightPusher
    from megarl.sync.rank import checkpoint_names

    url = servers[1].url  # the TP2 server
    named = [("model.layers.0.self_attn.q_proj.weight", torch.ones(64, 64))]
    pusher = WeightPusher([url], transport="distributed", server_tp_sizes=[2], api_key=API_KEY, timeout_s=120,
                          group_name="conf_refusals")
    pusher.connect()
    t0 = time.time()
    with pytest.raises(SyncError, match="must run between begin_weight_update"):
        pusher.push(named)  # no session: SGLang answers 400 without joining the broadcast
    assert time.time() - t0 < 60, "no hang until the process-group timeout (120 s)"
    pusher.close()

    # inside a session, a name the model lacks: SGLang's own load error, naming server and tensor
    pusher = WeightPusher([url], transport="distributed", server_tp_sizes=[2], api_key=API_KEY, timeout_s=120,
                          group_name="conf_refusals2")
    t0 = time.time()
    with pytest.raises(SyncError, match=r"not_a_weight") as err, pusher.session():
        pusher.push([("model.layers.0.mlp.not_a_weight", torch.ones(3))])
    assert url in str(err.value) and "Failed to update parameter online" in str(err.value)
    assert time.time() - t0 < 60, "no hang until the process-group timeout (120 s)"
    # the failed push's session was ended: a new one opens, and a good push goes through
    with pusher.session():
        assert pusher.push(named, weight_version="after_refusal").tensors == 1
    pusher.close()

    # the tensor path: SGLang 0.5.23 does not catch a load error there (its scheduler would die),
    # so the pusher refuses names outside the served checkpoint before sending anything
    pusher = WeightPusher([url], transport="tensor", server_tp_sizes=[2], api_key=API_KEY,
                          known_names=checkpoint_names(str(model)))
    with pytest.raises(SyncError, match=r"'model.layers.0.mlp.not_a_weight' is not a weight of the served"), \
            pusher.session():
        pusher.push([("model.layers.0.mlp.not_a_weight", torch.ones(3))])
    with pusher.session():
        assert pusher.push(named).tensors == 1
    pusher.close()
    assert asyncio.run(_healthy(url))


async def _healthy(url):
    async with SGLangClient(url, api_key=API_KEY) as c:
        return await c.health()


def test_api_key_required_and_reported_in_one_line(servers):
    url = servers[0].url

    async def go(key):
        async with SGLangClient(url, api_key=key, retries=0) as c:
            healthy = await c.health()
            try:
                await c.generate([1, 2, 3], sampling_params(max_new_tokens=2, temperature=0))
                return healthy, None
            except Unauthorized as e:
                return healthy, str(e)

    for key in (None, "wrong-key"):
        healthy, error = asyncio.run(go(key))
        assert healthy, "/health stays open for probes"
        assert error is not None and "\n" not in error and "401" in error and url in error
    healthy, error = asyncio.run(go(API_KEY))
    assert healthy and error is None


# --------------------------------------------------------------------------------------------
# the RL loop: 2 GRPO steps with SGLang's server code as the rollout engine
# --------------------------------------------------------------------------------------------

def _check_run(results, out: Path):
    steps = results["steps"]
    assert len(steps) == 2
    # step 0's logprob check passed at a tight bound (1e-3): the pushed weights are what generated
    assert all(s["rollout/logprob_diff_mean"] < 1e-3 for s in steps)
    assert all(s["sync/bytes"] > 1e5 for s in steps)


@pytest.mark.e2e
def test_grpo_launching_an_sglang_server_distributed(model, tmp_path, monkeypatch):
    """The trainer starts SGLang itself (rollout.server_command), with a generated API key in a
    0600 --config file, and pushes over the distributed transport (TP2 servers: the push test above
    and the ipc run below)."""
    monkeypatch.delenv("MEGARL_API_KEY", raising=False)
    monkeypatch.setenv("PYTHONPATH", harness_env()["PYTHONPATH"])
    out = tmp_path / "run"
    cfg = _sglang_cfg(model, out, "rollout.tp=1", "sync.transport=gloo")
    results = Trainer(cfg).run()
    _check_run(results, out)
    key_files = list((out / "logs").glob("sglang_server_0_node0.yaml"))
    assert key_files and oct(key_files[0].stat().st_mode & 0o777) == "0o600"
    assert "api-key" not in (out / "logs" / "rollout_server_0.log").read_text().split("server_args=")[0]


@pytest.mark.parametrize("transport,tp", [("ipc", 2), ("disk", 1)])
@pytest.mark.e2e
def test_grpo_on_running_sglang_servers(model, servers, tmp_path, monkeypatch, transport, tp):
    monkeypatch.setenv("MEGARL_API_KEY", API_KEY)
    server = servers[0] if tp == 1 else servers[1]
    cfg = _sglang_cfg(model, tmp_path / "run", f"rollout.tp={tp}", f"rollout.server_urls=[{server.url}]",
                      f"sync.transport={transport}")
    _check_run(Trainer(cfg).run(), tmp_path / "run")
