"""Partial rollouts against SGLang 0.5.23's own server code (tests/sglang_cpu: its HTTP app, tokenizer
manager pause/abort/weight locks, and the harness scheduler extended as SGLang's scheduler handles
AbortReq / pause / continue) and against megarl's embedded server, with the same assertions:

* ``/pause_generation`` mode ``abort`` answers the requests in flight with ``finish_reason`` abort and
  the tokens they have; ``generate_resumable`` continues from exactly those tokens: the ids concatenate,
  the versions switch at the update, every token's logprob is the one of the weights that sampled it
  (checked against transformers' forward of each model), the continuation equals a fresh seeded
  generation under the new weights from prompt + the old tokens, and requests sent while paused wait
  for the continue;
* mode ``retract`` keeps the request on the server: one answer whose ``weight_versions`` spans switch
  where the weights changed, with each span's logprobs from its own weights;
* mode ``in_place`` keeps the old KV: an update with ``flush_cache`` reports SGLang's flush failure;
* ``/abort_request`` by rid aborts that request only (a rid the server does not hold is ignored);
* without a pause, a weight-update session waits for the requests in flight (model_update_lock).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from megarl.rollout.client import SGLangClient, sampling_params
from megarl.rollout.partial import continuation_seed, generate_resumable
from tests.helpers.servers import ServerProcess
from tests.helpers.models import make_tiny_chat_model
from tests.helpers import inflight
from tests.helpers.inflight import HANG_S
from tests.helpers.runs import tiny_run_config
from tests.sglang_cpu.server import SGLangCPUServer, server_command

KEY = "partial-rollout-key"
# SGLang honours sampling_seed only with --enable-deterministic-inference, which its CPU backend
# refuses: the seed-reproduction checks run where seeds are honoured (megarl's engine always)
SEEDED = {"embedded": True, "sglang": False}
N = 300                      # tokens per request (ignore_eos): long enough to interrupt
# The servers' context: room for a request that outlasts any test (LONG tokens, ignore_eos) -- what
# holds a request in flight is the test's own pause or abort, never a machine too slow to finish
CONTEXT = 1 << 14
LONG = CONTEXT - 64
PROMPT = [1, 2, 3, 4]
SEED = 4242


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("weights")
    a, b = make_tiny_chat_model(root / "a", seed=0), make_tiny_chat_model(root / "b", seed=1)
    for d in (a, b):   # declare the servers' context (RoPE has no length limit; SGLang checks the config)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=CONTEXT)))
    return root, a, b


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """url by kind: megarl's embedded server and SGLang's own server code (CPU harness)."""
    root, a, _ = models
    logs = tmp_path_factory.mktemp("logs")
    command = "[" + ",".join(server_command()) + "]"
    cfg = tiny_run_config(a, logs / "cfg", "rollout.engine=sglang", f"rollout.server_command={command}",
                          "rollout.max_prompt_len=64", f"rollout.sampling.max_new_tokens={CONTEXT - 64}",
                          "rollout.max_running_requests=4")
    sglang = SGLangCPUServer(a, cfg, logs, 0, KEY)
    embedded = ServerProcess(str(a), extra=["--skip-tokenizer-init", "--weights-dir", str(root),
                                            "--context-length", str(CONTEXT), "--max-running-requests", "4"],
                             env={"MEGARL_API_KEY": KEY})
    try:
        embedded.wait_ready()
        sglang.wait_ready()
        yield {"embedded": embedded.url, "sglang": sglang.url}
    finally:
        embedded.stop()
        sglang.stop()


def greedy(max_new: int = N):
    return sampling_params(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)


def seeded(max_new: int = N, seed: int = SEED):
    return sampling_params(max_new_tokens=max_new, temperature=1.0, ignore_eos=True, sampling_seed=seed)


@pytest.fixture(scope="module")
def hf_logprobs(models):
    """logprobs of given response tokens under model a or b, by transformers' own fp32 forward."""
    import torch
    from transformers import AutoModelForCausalLM

    _, a, b = models
    hf = {k: AutoModelForCausalLM.from_pretrained(str(p), torch_dtype=torch.float32).eval() for k, p in (("a", a), ("b", b))}

    def lp(which: str, prompt: list[int], response: list[int]) -> list[float]:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = hf[which](ids).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist()
    return lp


async def load(c: SGLangClient, path: Path, version: str) -> dict:
    return await c.update_weights_from_disk(str(path), load_format="auto", weight_version=version)


async def one(c: SGLangClient, ids, params):
    return (await c.generate(ids, params))[0]


async def held(url: str) -> dict:
    return await inflight.held(url, KEY)


async def until_generating(url: str, *rids: str, **kw) -> dict:
    return await inflight.until_generating(url, *rids, api_key=KEY, **kw)


async def interrupted(attempt_once, tries: int = 4):
    """Run a pause scenario until the pause landed mid-generation. Each attempt pauses as soon as
    the server reports the request generating (``until_generating``), so the pause lands after its
    first token; it lands before its last unless the machine produced all N tokens within the
    one round trip between that report and the pause, which a retry covers."""
    for _ in range(tries):
        result, produced_before = await attempt_once()
        if 0 < produced_before < N:
            return result, produced_before
    pytest.fail(f"no pause landed mid-generation in {tries} tries (last: {produced_before} of {N} tokens)")


@pytest.mark.parametrize("kind", ["embedded", "sglang"])
def test_abort_pause_resumes_from_the_tokens_already_produced(kind, servers, models, hf_logprobs):
    _, a, b = models

    async def go():
        async with SGLangClient(servers[kind], api_key=KEY) as c:
            async def attempt():
                await load(c, a, "init")
                ref = await one(c, PROMPT, seeded())
                chunks = []

                async def send(ids, params):
                    out = (await c.generate(ids, params, rid=f"resumable-{len(chunks)}"))[0]
                    chunks.append((list(ids), out))
                    return out
                task = asyncio.ensure_future(generate_resumable(send, PROMPT, seeded(), SEED))
                await until_generating(servers[kind], "resumable-0", tasks=[task])
                assert (await c.pause_generation("abort"))   # every request answered: aborted with its tokens
                waiting = asyncio.ensure_future(one(c, [9, 9, 9], greedy(4)))   # sent while paused: held
                await c.begin_weight_update()
                await load(c, b, "step1")
                await c.end_weight_update()
                await asyncio.sleep(0.3)
                kept_waiting = not waiting.done()
                await c.continue_generation()
                traj = await task
                late = await waiting
                return (ref, traj, kept_waiting, late, chunks), traj.versions.count(0)

            (ref, traj, kept_waiting, late, chunks), m = await interrupted(attempt)
            assert kept_waiting and late.weight_version == "step1", "a request sent during the pause waits for the continue"
            assert len(traj.output_ids) == N and traj.finish_reason == "length" and traj.resumed == 1
            assert traj.versions == [0] * m + [1] * (N - m), "versions switch once, at the update"
            (sent0, first), (sent1, second) = chunks
            assert sent0 == PROMPT and first.finish_reason == "abort" and len(first.output_ids) == m
            assert first.meta_info["finish_reason"]["message"] == "Aborted" and first.weight_version == "init"
            assert sent1 == PROMPT + first.output_ids, "the continuation starts from exactly the tokens produced"
            assert traj.output_ids == first.output_ids + second.output_ids, "token ids concatenate"
            assert traj.logprobs == first.logprobs + second.logprobs and second.weight_version == "step1"
            under_a, under_b = hf_logprobs("a", PROMPT, traj.output_ids), hf_logprobs("b", PROMPT, traj.output_ids)
            assert traj.logprobs[:m] == pytest.approx(under_a[:m], abs=1e-4)
            assert traj.logprobs[m:] == pytest.approx(under_b[m:], abs=1e-4)
            assert max(abs(x - y) for x, y in zip(under_a, under_b)) > 1e-2, "the two models differ"
            if SEEDED[kind]:   # and the tokens are the seeded ones of each weights
                assert traj.output_ids[:m] == ref.output_ids[:m]
                cont = await one(c, PROMPT + traj.output_ids[:m], seeded(N - m, continuation_seed(SEED, m)))
                assert cont.output_ids == traj.output_ids[m:]
                assert cont.logprobs == pytest.approx(traj.logprobs[m:], abs=1e-5)
    asyncio.run(go())


@pytest.mark.parametrize("kind", ["embedded", "sglang"])
def test_retract_pause_continues_on_the_server_under_the_new_weights(kind, servers, models, hf_logprobs):
    _, a, b = models

    async def go():
        async with SGLangClient(servers[kind], api_key=KEY) as c:
            async def attempt():
                await load(c, a, "init")
                task = asyncio.ensure_future(c.generate(PROMPT, seeded(), rid="retracted"))
                await until_generating(servers[kind], "retracted", tasks=[task])
                await c.pause_generation("retract")
                await c.begin_weight_update()
                await load(c, b, "step1")   # retracted requests wait in the queue: the flush succeeds
                await c.end_weight_update()
                await c.continue_generation()
                out = (await task)[0]
                spans = out.meta_info["weight_versions"]
                return out, (spans[0]["end"] if spans[0]["version"] == "init" else 0)

            out, m = await interrupted(attempt)
            assert out.finish_reason == "length" and len(out.output_ids) == N
            assert out.meta_info["weight_versions"] == [{"version": "init", "start": 0, "end": m},
                                                        {"version": "step1", "start": m, "end": N}]
            assert out.weight_version == "step1"
            if SEEDED[kind]:
                await load(c, a, "check")
                ref = await one(c, PROMPT, seeded(m))
                assert out.output_ids[:m] == ref.output_ids
            # each span's logprobs come from its own weights: the KV was recomputed under the new ones
            assert out.logprobs[:m] == pytest.approx(hf_logprobs("a", PROMPT, out.output_ids)[:m], abs=1e-4)
            assert out.logprobs[m:] == pytest.approx(hf_logprobs("b", PROMPT, out.output_ids)[m:], abs=1e-4)
    asyncio.run(go())


@pytest.mark.parametrize("kind", ["embedded", "sglang"])
def test_in_place_pause_keeps_requests_and_an_update_reports_the_unflushed_cache(kind, servers, models):
    _, a, b = models

    async def go():
        async with SGLangClient(servers[kind], api_key=KEY) as c:
            async def attempt():
                await load(c, a, "init")
                task = asyncio.ensure_future(c.generate(PROMPT, greedy(), rid="in-place"))
                await until_generating(servers[kind], "in-place", tasks=[task])
                await c.pause_generation("in_place")
                try:
                    await load(c, b, "step1")
                    refused = None
                except Exception as e:  # noqa: BLE001 - the answer under test
                    refused = str(e)
                await c.continue_generation()
                out = (await task)[0]
                spans = out.meta_info["weight_versions"]
                m = spans[0]["end"] if len(spans) == 2 else (N if spans[0]["version"] == "init" else 0)
                return (out, refused), m

            (out, refused), m = await interrupted(attempt)
            assert refused is not None and "cache was not flushed because requests are still running" in refused
            assert out.meta_info["weight_versions"][-1] == {"version": "step1", "start": m, "end": N}
    asyncio.run(go())


@pytest.mark.parametrize("kind", ["embedded", "sglang"])
def test_abort_request_by_rid_aborts_that_request_only(kind, servers, models, hf_logprobs):
    """Both requests ask for LONG tokens (more than any machine makes while the test runs) and are
    held still by an ``in_place`` pause once the server reports them generating, so what ends each
    one is the test's abort, and what the server holds is read from it, not inferred from timing."""
    _, a, _ = models
    url = servers[kind]

    async def go():
        async with SGLangClient(url, api_key=KEY) as c:
            await load(c, a, "init")
            first = asyncio.ensure_future(c.generate(PROMPT, greedy(LONG), rid="victim-1"))
            second = asyncio.ensure_future(c.generate([7, 8, 9], greedy(LONG), rid="bystander-1"))
            await until_generating(url, "victim-1", "bystander-1", tasks=[first, second])
            await c.pause_generation("in_place")       # both stay on the server, still
            await c.abort_request(rid="victim")        # not a rid the server holds: ignored
            await c.abort_request()                    # empty rid, no abort_all: ignored
            state = await held(url)
            assert set(state["running"]) == {"victim-1", "bystander-1"}, state
            assert not first.done() and not second.done()
            await c.abort_request(rid="victim-1")
            hit = (await asyncio.wait_for(first, HANG_S))[0]
            state = await held(url)
            assert list(state["running"]) == ["bystander-1"] and not second.done(), state
            stopped_at = state["running"]["bystander-1"]
            await c.continue_generation()              # the bystander generates on
            await until_generating(url, "bystander-1", tasks=[second], past=stopped_at)
            await c.abort_request(rid="bystander-1")
            kept = (await asyncio.wait_for(second, HANG_S))[0]
            assert hit.finish_reason == "abort" and 0 < len(hit.output_ids) < LONG
            assert len(hit.logprobs) == len(hit.output_ids)
            assert hit.meta_info["finish_reason"]["message"] == "Aborted"
            assert kept.finish_reason == "abort" and stopped_at < len(kept.output_ids) < LONG
            # every token's logprob is model a's (transformers' fp32 forward): the bystander's KV came
            # through the victim's removal intact
            assert hit.logprobs == pytest.approx(hf_logprobs("a", PROMPT, hit.output_ids), abs=1e-4)
            assert kept.logprobs == pytest.approx(hf_logprobs("a", [7, 8, 9], kept.output_ids), abs=1e-4)
    asyncio.run(go())


@pytest.mark.parametrize("kind", ["embedded", "sglang"])
def test_an_update_without_a_pause_waits_for_the_requests_in_flight(kind, servers, models):
    _, a, _ = models

    async def go():
        async with SGLangClient(servers[kind], api_key=KEY) as c:
            await load(c, a, "init")
            gen = asyncio.ensure_future(c.generate(PROMPT, greedy(), rid="in-flight"))
            await until_generating(servers[kind], "in-flight", tasks=[gen])
            await c.begin_weight_update()               # the writer lock: after every request in flight
            assert gen.done(), "begin_weight_update answered while a request was still generating"
            out = (await gen)[0]
            await c.end_weight_update()
            assert out.finish_reason == "length" and len(out.output_ids) == N
    asyncio.run(go())


@pytest.mark.parametrize("kind", ["embedded", "sglang"])
def test_a_pause_does_not_queue_behind_the_clients_own_generations(kind, servers, models):
    """A client at its generation limit (``max_concurrency``: every slot held by a running request)
    still pauses at once: control calls never wait for a generation slot, or the pause would wait
    for the requests it is meant to interrupt (an off-policy source keeps the slots full)."""
    _, a, _ = models

    async def go():
        async with SGLangClient(servers[kind], api_key=KEY, max_concurrency=1) as c:
            async def attempt():
                await load(c, a, "init")
                task = asyncio.ensure_future(c.generate(PROMPT, greedy(), rid="slot-holder"))
                await until_generating(servers[kind], "slot-holder", tasks=[task])
                await asyncio.wait_for(c.pause_generation("abort"), HANG_S)   # a hang guard: it answers at once
                out = (await task)[0]
                await c.continue_generation()
                return out, len(out.output_ids)

            out, m = await interrupted(attempt)
            assert out.finish_reason == "abort" and len(out.logprobs) == m
    asyncio.run(go())
