"""Routed experts (R3) on the wire: SGLang 0.5.23's format, produced by the embedded server.

* ``encode_routed_experts`` / ``decode_routed_experts`` against SGLang's own encoder
  (``DetokenizerManager._b64_encode_per_request``) and decoder
  (``extract_routed_experts_from_meta_info``), taken from the installed sglang source (run with the
  standard library's base64 in place of pybase64, whose functions they call with the same API).
* A real embedded server (TP1 and TP2, fp32 LM head on) with ``--enable-return-routed-experts``:
  ``meta_info.routed_experts`` covers positions ``[routed_experts_start_len, seqlen - 1)`` x
  ``num_hidden_layers`` x top-k, equals transformers' own router choices on the whole sequence,
  dense layers are rows of zeros, and requests that do not ask get nothing.
"""
from __future__ import annotations

import ast
import asyncio
import base64
import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.wire.routes import decode_routed_experts, encode_routed_experts


def _sglang_function(relpath: str, name: str):
    """One function from the installed sglang source, compiled alone (its module imports CUDA-only
    code), with ``np``/``torch``/``pybase64`` provided."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang (the wheel, --no-deps) is not installed"
    source = (Path(list(spec.submodule_search_locations)[0]) / relpath).read_text()
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    pybase64 = types.SimpleNamespace(b64encode=base64.b64encode, b64decode=base64.b64decode)
    scope = {"np": np, "torch": torch, "pybase64": pybase64, "Optional": __import__("typing").Optional,
             "List": list}
    exec(compile(module, relpath, "exec"), scope)
    return scope[name]


def test_codec_is_sglangs():
    encode = _sglang_function("srt/managers/detokenizer_manager.py", "_b64_encode_per_request")
    decode = _sglang_function("srt/state_capturer/routed_experts.py", "extract_routed_experts_from_meta_info")
    routes = torch.randint(0, 128, (7, 3, 4), dtype=torch.int32)
    ours = encode_routed_experts(routes)
    assert ours == encode([routes])[0]                       # byte-identical to SGLang's string
    flat = decode({"meta_info": {"routed_experts": ours}})
    assert flat.dtype == np.int32 and flat.tolist() == routes.flatten().tolist()
    assert torch.equal(decode_routed_experts(ours, 3, 4), routes)
    with pytest.raises(ValueError, match="not a whole number of rows"):
        decode_routed_experts(ours, 5, 4)


def _hf_choices(model, ids: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """transformers' own top-k per MoE layer for every position of ``ids`` (sets, sorted), and its
    log-softmax."""
    out = model(torch.tensor([ids]), output_router_logits=True)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    k = model.config.num_experts_per_tok
    assert len(out.router_logits) == len(moe_layers)
    return ({layer: torch.topk(torch.softmax(logits.float().reshape(len(ids), -1), -1), k, dim=-1).indices.sort(-1).values
             for layer, logits in zip(moe_layers, out.router_logits)}, torch.log_softmax(out.logits[0].float(), -1))


@pytest.mark.parametrize("tp", [1, 2])
def test_embedded_server_returns_sglang_routed_experts(tmp_path, tp):
    from megarl.rollout.client import RequestFailed, SGLangClient, sampling_params
    from tests.helpers.servers import ServerProcess, make_tiny_hf_model

    hf = make_tiny_hf_model(str(tmp_path), "qwen3_moe", std=0.3, num_hidden_layers=3, mlp_only_layers=[1],
                            num_experts=8, num_experts_per_tok=3)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    n_new = 6

    async def run(url):
        async with SGLangClient(url) as c:
            sp = sampling_params(max_new_tokens=n_new, temperature=1.0, sampling_seed=4, ignore_eos=True)
            full = (await c.generate(prompt, sp, return_routed_experts=True))[0]
            tail = (await c.generate_raw({"input_ids": prompt, "sampling_params": sp, "return_routed_experts": True,
                                          "routed_experts_start_len": 3}))
            plain = (await c.generate(prompt, sp))[0]
            with pytest.raises(RequestFailed, match="routed_experts_start_len"):
                await c.generate_raw({"input_ids": prompt, "sampling_params": sp, "return_routed_experts": True,
                                      "routed_experts_start_len": len(prompt) + 1})
            return full, tail, plain

    extra = ["--enable-return-routed-experts", "--enable-fp32-lm-head"] + (["--tp-size", str(tp)] if tp > 1 else [])
    with ServerProcess(str(tmp_path), extra=extra) as server:
        full, tail, plain = asyncio.run(run(server.url))
    seq = prompt + full.output_ids
    layers, k = hf.config.num_hidden_layers, hf.config.num_experts_per_tok
    routes = decode_routed_experts(full.routed_experts, layers, k)
    assert routes.shape == (len(seq) - 1, layers, k)          # [0, seqlen - 1): the last token never ran
    assert not routes[:, 1].any()                              # mlp_only layer 1: SGLang leaves zeros
    with torch.no_grad():
        hf_sets, hf_logp = _hf_choices(hf, seq)
    # the fp32 LM head (rank 0 of the TP group computes the logits) gives HF's logprobs
    want = torch.stack([hf_logp[len(prompt) - 1 + i, t] for i, t in enumerate(full.output_ids)])
    assert (want - torch.tensor(full.logprobs)).abs().max() < 1e-4
    for layer, sets in hf_sets.items():
        assert torch.equal(routes[:, layer].long().sort(-1).values, sets[:-1]), layer
    tail_routes = decode_routed_experts(tail["meta_info"]["routed_experts"], layers, k)
    assert tail["output_ids"] == full.output_ids and torch.equal(tail_routes, routes[3:])
    assert plain.routed_experts is None and "routed_experts" not in plain.meta_info


def test_routes_survive_a_checkpoint_of_the_rollout_buffer():
    """Buffered samples (off-policy sources) keep their routes through the JSON checkpoint, int16
    and int32 alike."""
    import json

    from megarl.rollout.routed_experts import routes_from_state, routes_state

    for high in (8, 40_000):
        routes = torch.randint(-1, high, (9, 2, 3), dtype=torch.int32)
        routes = routes.to(torch.int16) if high < 2 ** 15 else routes
        back = routes_from_state(json.loads(json.dumps(routes_state(routes))))
        assert back.dtype == routes.dtype and torch.equal(back, routes)
    assert routes_state(None) is None and routes_from_state(None) is None


def test_sample_routes_checks_presence_and_length():
    from megarl.rollout.routed_experts import sample_routes

    routes = torch.randint(0, 8, (9, 2, 3), dtype=torch.int32)
    data = encode_routed_experts(routes)
    got = sample_routes(data, 10, (2, 3), required=True)
    assert got.dtype == torch.int16 and torch.equal(got.int(), routes)
    assert sample_routes(None, 10, (2, 3), required=False) is None
    with pytest.raises(RuntimeError, match="--enable-return-routed-experts"):
        sample_routes(None, 10, (2, 3), required=True)
    with pytest.raises(RuntimeError, match="expected prompt \\+ response - 1 = 10"):
        sample_routes(data, 11, (2, 3), required=True)


# --------------------------------------------------------------------------------------------
# samples that take several requests: a continued (aborted) request, an agent's turns
# --------------------------------------------------------------------------------------------

class ThreeTurnEnv:
    """Answers the first two model turns with an observation, ends the trajectory on the third."""

    def __init__(self, ctx):
        self.turn = 0

    async def reset(self, record):
        return [{"role": "user", "content": "Count with me, one word per turn."}], []

    async def step(self, action):
        from megarl.envs.base import StepResult

        self.turn += 1
        if self.turn >= 3:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "tool", "content": f"observation number {self.turn}"}])

    async def close(self):
        pass


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    """A tiny Qwen3-MoE with SmolLM2's vocabulary (the agent renders its chat template) behind a
    real embedded server that records routed experts."""
    from tests.helpers.servers import ServerProcess, make_tiny_hf_model

    d = tmp_path_factory.mktemp("moe")
    hf = make_tiny_hf_model(str(d), "qwen3_moe", std=0.3, num_hidden_layers=3, mlp_only_layers=[1], num_experts=8,
                            num_experts_per_tok=3, vocab_size=49152)
    with ServerProcess(str(d), extra=["--enable-return-routed-experts", "--enable-fp32-lm-head"]) as server:
        yield hf, server


def _assert_hf_routing(hf, seq: list[int], routes: torch.Tensor, covered: int):
    """Rows [0, covered) are transformers' own top-k on the whole sequence (a causal model routes
    position i the same whatever follows), the rest -1 (never ran)."""
    layers, k = hf.config.num_hidden_layers, hf.config.num_experts_per_tok
    assert routes.shape == (len(seq) - 1, layers, k)
    assert (routes[covered:] == -1).all() and (routes[:covered] >= 0).all()
    with torch.no_grad():
        hf_sets, _ = _hf_choices(hf, seq)
    for layer, sets in hf_sets.items():
        assert torch.equal(routes[:covered, layer].long().sort(-1).values, sets[:covered]), layer


def test_a_continued_request_joins_its_answers_routes(moe_server):
    from megarl.rollout.manager import RolloutManager
    from megarl.rollout.partial import generate_resumable
    from megarl.rollout.routed_experts import joined_routes

    hf, server = moe_server
    mgr = RolloutManager([server.url], timeout_s=60)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    starts: list = []

    async def aborting_send(ids, params, routes_start=None):
        """The first two answers stop after 3 tokens and say abort (as a pause would)."""
        early = len(starts) < 2
        out = await mgr.generate_one(ids, dict(params, max_new_tokens=3) if early else params, 0, routes_start)
        starts.append(routes_start)
        out.meta_info = {k: v for k, v in out.meta_info.items() if k != "weight_versions"}
        out.meta_info["weight_version"] = "init"      # the server was never pushed to
        if early:
            out.finish_reason = "abort"
        return out

    try:
        sp = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
        t = mgr.io.run(generate_resumable(aborting_send, prompt, sp, seed=3, routes_from=0))
    finally:
        mgr.close()
    assert t.resumed == 2 and len(t.output_ids) == 10 and len(t.routes) == 3
    # each continuation asks from the previous answer's last token (sampled, never run) on
    assert starts == [0, len(prompt) + 3 - 1, len(prompt) + 6 - 1]
    seq = prompt + t.output_ids
    routes = joined_routes(t.routes, len(seq) - 1, len(seq), (3, 3), required=True)
    _assert_hf_routing(hf, seq, routes, len(seq) - 1)
    with pytest.raises(RuntimeError, match="cover 16 positions, expected 17"):
        joined_routes(t.routes, len(seq), len(seq) + 1, (3, 3), required=True)
    with pytest.raises(RuntimeError, match="1 of a sample's 3 requests returned no"):
        joined_routes(t.routes[:2] + [None], len(seq) - 1, len(seq), (3, 3), required=True)


def test_an_aborted_request_answers_with_the_routes_of_what_it_ran(moe_server):
    """A pause's abort finishes running requests with the tokens they have; SGLang finishes them
    through its decode path, routed experts included, and so must the embedded server (a continued
    request's routes would have a hole otherwise)."""
    from megarl.rollout.client import SGLangClient, sampling_params
    from tests.helpers.inflight import until_generating

    hf, server = moe_server
    prompt = [5, 17, 42, 99, 3, 250, 7]

    async def run():
        async with SGLangClient(server.url) as c:
            for attempt in range(6):
                sp = sampling_params(max_new_tokens=480, temperature=1.0, sampling_seed=attempt, ignore_eos=True)
                req = asyncio.ensure_future(c.generate(prompt, sp, rid=f"r{attempt}", return_routed_experts=True,
                                                       routed_experts_start_len=2))
                # abort once the server reports it generating (not after a guessed sleep); a retry only
                # if a machine made all 480 tokens in the round trip between that report and the abort
                await until_generating(server.url, f"r{attempt}", tasks=[req])
                await c.abort_request(f"r{attempt}")
                (out,) = await req
                if out.finish_reason == "abort" and out.output_ids:
                    return out
        pytest.fail("no abort landed mid-generation")

    out = asyncio.run(run())
    seq = prompt + out.output_ids
    routes = decode_routed_experts(out.routed_experts, 3, 3)
    assert routes.shape[0] == len(seq) - 1 - 2
    full = torch.cat([torch.zeros(2, 3, 3, dtype=routes.dtype), routes])   # rows from start_len 2
    with torch.no_grad():
        hf_sets, _ = _hf_choices(hf, seq)
    for layer, sets in hf_sets.items():
        assert torch.equal(full[2:, layer].long().sort(-1).values, sets[2:-1]), layer


@pytest.mark.parametrize("max_turns", [3, 2])
def test_agent_trajectory_routes_cover_every_turn(moe_server, max_turns):
    """Each turn asks for the positions the earlier turns did not run -- the observation it
    prefills and the tokens it samples -- so the joined routes are the whole trajectory's routing;
    a trajectory cut by the turn limit after an observation has -1 rows for that observation."""
    from transformers import AutoTokenizer

    from megarl.data.records import PromptRecord
    from megarl.checkpoint.smollm2 import smollm2_hf_dir
    from megarl.rollout.agent import AgentRollout, AgentSettings
    from megarl.rollout.manager import RolloutManager

    hf, server = moe_server
    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))
    mgr = RolloutManager([server.url], timeout_s=60)
    settings = AgentSettings("tests.test_routed_experts:ThreeTurnEnv", max_turns=max_turns, max_response_tokens=200,
                             routes=(3, 3), routes_required=True)
    sp = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    rollout = AgentRollout(mgr, sp, tok, settings)
    try:
        (sample,) = mgr.io.run(rollout._batch([PromptRecord("unused")], 1, 11, sp))
    finally:
        rollout.close()
        mgr.close()
    assert sample.info["turns"] == max_turns and sample.loss_mask.count(0) > 0
    seq = list(sample.prompt_ids) + list(sample.response_ids)
    trailing_env = len(sample.loss_mask) - (max(i for i, m in enumerate(sample.loss_mask) if m) + 1)
    assert (trailing_env > 0) == (max_turns == 2)
    _assert_hf_routing(hf, seq, sample.routed_experts.int(), len(seq) - 1 - trailing_env)
