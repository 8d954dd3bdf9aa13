"""Bring your own agent: agents written with the real ``openai`` package (2.8.0) call megarl's
gateway in front of the embedded server running SmolLM2-135M-Instruct, and megarl records their
trajectories token for token.

What is held to what:

* every call's prompt ids and sampled ids are the ones the server saw and returned (the
  session's log of server requests, not the recorder's own bookkeeping), each sampled token's
  logprob is the server's, and the loss mask is 1 exactly on them;
* a model turn whose re-rendering by the chat template differs from its sampled ids (SmolLM2's
  template cannot show ``tool_calls``, so the gateway writes them into the content; a sampled
  sequence that is not the tokenizer's own encoding of its text) stays as sampled: naive
  re-tokenization of the conversation would differ, the recorded sequence does not;
* a rewritten history starts a new segment; unknown keys get ``openai.AuthenticationError``; a
  cut call is an ``openai.APIError`` subclass within seconds; an agent's exception or deadline is a
  failed sample, never a 0.

Scripted managers (the server's answers given, everything else real) are used where the point is
an exact token sequence or a failure the real server would not produce on demand.
"""
from __future__ import annotations

import json
import time

import openai
import pytest

from megarl.data.records import PromptRecord
from megarl.rollout.byo_agent import ByoAgentRollout, ByoSettings
from megarl.rollout.call_session import CallLimits
from megarl.rollout.call_trajectory import ChatRender
from megarl.rollout.client import GenerateOutput, LoopThread
from tests.helpers import byo_agents

EOS = 2          # <|im_end|>
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [EOS]}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from megarl.checkpoint.smollm2 import smollm2_hf_dir

    return AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))


@pytest.fixture(scope="module")
def served():
    """The embedded server on SmolLM2-135M-Instruct and a rollout manager in front of it."""
    from megarl.checkpoint.smollm2 import smollm2_hf_dir
    from megarl.rollout.manager import RolloutManager
    from tests.helpers.servers import ServerProcess

    with ServerProcess(str(smollm2_hf_dir()), threads=2) as server:
        manager = RolloutManager([server.url], request_retries=0)
        try:
            yield manager
        finally:
            manager.close()


def make_rollout(manager, tok, entrypoint: str, parser: str = "hermes", timeout_s: float = 300.0,
                 score=None, segments: str = "all", limits: CallLimits = CallLimits(3, 200, 12, 512)):
    settings = ByoSettings(f"tests.helpers.byo_agents:{entrypoint}", parser, limits, timeout_s, 8, segments)
    return ByoAgentRollout(manager, SAMPLING, tok, settings, score)


def records(*questions: str, **metadata) -> list[PromptRecord]:
    return [PromptRecord(q, answer="19", index=i, metadata=dict(metadata)) for i, q in enumerate(questions)]


def assert_server_tokens(samples, sessions) -> None:
    """Each recorded call is in one segment as the server saw it: its input is the segment so far,
    its sampled ids and logprobs follow verbatim with mask 1; nothing else has mask 1."""
    by_traj = {}
    for s in samples:
        by_traj.setdefault(id(s.record), []).append(s)
    for session in sessions:
        segs = session.trajectory.trained("all")
        covered = {id(seg): 0 for seg in segs}
        for inp, out, lps in session.server_ids:
            seg = next(seg for seg in segs if (seg.prompt_ids + seg.ids)[:len(inp) + len(out)] == inp + out)
            pos = len(inp) - len(seg.prompt_ids)
            assert seg.ids[pos:pos + len(out)] == out
            assert seg.logprobs[pos:pos + len(out)] == lps
            assert seg.mask[pos:pos + len(out)] == [1] * len(out)
            covered[id(seg)] += len(out)
        for seg in segs:
            assert sum(seg.mask) == covered[id(seg)]
            assert all(lp == 0.0 for lp, m in zip(seg.logprobs, seg.mask) if not m)


# ---------------------------------------------------------------------------------------------- real server
def test_openai_tool_agent_multi_turn_keeps_the_servers_tokens(served, tok):
    """An unchanged openai agent, three calls per trajectory with tool calls and tool results; the
    gateway's parser is ``mostly_call`` so that SmolLM2's turns are tool calls three times in four."""
    rollout = make_rollout(served, tok, "tool_agent", parser="tests.helpers.agent:mostly_call")
    try:
        samples = rollout.generate(records("Calculate 12 + 7.", max_tokens=8), 2, seed_base=3)
        sessions = list(rollout.sessions)
    finally:
        rollout.close()
    assert len(samples) == 2 and not any(s.failed for s in samples)
    assert_server_tokens(samples, sessions)
    render = ChatRender(tok)
    calls = 0
    for session in sessions:
        (seg,) = session.trajectory.segments
        assert len(session.server_ids) == 3 and seg.calls == 3                # one sequence of three calls
        assert session.joins[0] == "new" and set(session.joins[1:]) <= {"extends", "splice"}
        seen = byo_agents.SEEN[session.key]
        made = sum(len(r.get("tool_calls", [])) for r in seen["replies"])
        calls += made
        assert seg.tool_calls == made
        # the agent's conversation, rendered and tokenized whole (what a naive recorder trains on)
        msgs = seen["messages"]
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        naive = render.encode(render.render(msgs[:last], byo_agents.TOOLS))
        for t, reply in enumerate(seen["replies"][:-1]):
            # SmolLM2's template writes the calls into the content before <|im_end|>: a turn the model
            # ended itself is re-rendered as other ids than it sampled (a turn cut by length is extended:
            # the written calls follow its sampled ids as template tokens, as the server saw them next)
            out = session.server_ids[t][1]
            if reply.get("tool_calls") and out[-1:] == [EOS]:
                assert session.joins[t + 1] == "splice"
            body = out[:-1] if out[-1:] == [EOS] else out
            if tok.encode(tok.decode(body), add_special_tokens=False) != body:   # sampled ids the tokenizer
                assert session.joins[t + 1] == "splice"                          # would not produce: kept
        if "splice" in session.joins:
            assert naive != session.server_ids[-1][0]          # re-tokenized history != what the model sampled
        env = tok.decode([t for t, m in zip(seg.ids, seg.mask) if not m])
        if made:
            assert "<|im_start|>tool\n" in env                  # tool results went in as template tokens
    assert calls >= 1
    assert sorted(s.reward for s in samples) == sorted(float(sum(len(r.get("tool_calls", [])) for r in
                                                                 byo_agents.SEEN[x.key]["replies"])) for x in sessions)


def test_rewritten_history_starts_a_new_segment(served, tok):
    got = []
    rollout = make_rollout(served, tok, "rewriting_agent",
                           score=lambda texts, recs: got.extend(texts) or [0.25] * len(texts))
    try:
        samples = rollout.generate(records("Calculate 2 + 2."), 1, seed_base=9)
        session = rollout.sessions[0]
    finally:
        rollout.close()
    assert session.joins[0] == "new" and session.joins[1] in ("extends", "splice") and session.joins[2] == "new"
    assert [seg.calls for seg in session.trajectory.segments] == [2, 1]
    assert len(samples) == 2 and [s.info["segment"] for s in samples] == [0, 1]
    assert all(s.reward == 0.25 and not s.failed for s in samples)     # None: the reward function scored it once
    assert got == [samples[-1].text]
    assert_server_tokens(samples, [session])


def test_unknown_key_is_401_and_closed_key_408(served, tok):
    rollout = make_rollout(served, tok, "tool_agent")
    try:
        url = served.io.run(rollout.gateway.start())
        assert url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url, api_key="megarl-not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        key = rollout.gateway.open(_Ended())      # a key, then its trajectory ends
        rollout.gateway.close(key, "the agent returned")
        late = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        t = time.time()
        with pytest.raises(openai.APIStatusError) as err:
            late.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 408 and time.time() - t < 5
    finally:
        rollout.close()


class _Ended:
    def close(self, why: str) -> None:
        pass


# ---------------------------------------------------------------------------------------------- scripted server
class ScriptedManager:
    """Stands in for ``RolloutManager``: answers trajectory ``job_index``'s calls from its script
    (ids, finish reason) or raises the scripted error; logs every request."""

    def __init__(self, scripts: dict[int, list]):
        self.io = LoopThread()
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.log: list[tuple[list[int], list[int]]] = []

    async def generate_one(self, input_ids, params, job_index=0, **kw):
        turn = self.scripts[job_index].pop(0)
        if isinstance(turn, BaseException):
            raise turn
        ids, finish = turn
        ids = ids[: params["max_new_tokens"]]
        self.log.append((list(input_ids), list(ids)))
        return GenerateOutput(ids, [-0.5 - 0.01 * i for i in range(len(ids))], finish,
                              meta_info={"weight_version": "init"})

    def close(self):
        self.io.close()


def char_split(tok, text: str) -> list[int]:
    """Ids that decode to ``text`` but are not the tokenizer's encoding of it."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


@pytest.mark.parametrize("agent", ["tool_agent", "stream_tool_agent"])
def test_non_canonical_tool_call_keeps_the_sampled_ids(tok, agent):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 7"}}</tool_call>'
    turn1, turn2 = char_split(tok, call) + [EOS], char_split(tok, "The answer is 19.") + [EOS]
    for ids in (turn1, turn2):   # the drift: decode -> encode is not these ids
        assert tok.encode(tok.decode(ids, skip_special_tokens=True), add_special_tokens=False) != ids[:-1]
    manager = ScriptedManager({0: [(turn1, "stop"), (turn2, "stop"), (turn2, "stop")]})
    limits = CallLimits(3, 400, 400, 1024)
    rollout = ByoAgentRollout(manager, dict(SAMPLING, max_new_tokens=400), tok,
                              ByoSettings(f"tests.helpers.byo_agents:{agent}", "hermes", limits, 60.0, 4), None)
    try:
        samples = rollout.generate(records("Calculate 12 + 7.", max_tokens=400), 1, seed_base=1)
        session = rollout.sessions[0]
    finally:
        rollout.close()
        manager.close()
    seen = byo_agents.SEEN[session.key]
    first = seen["replies"][0]
    assert first["tool_calls"][0]["function"]["name"] == "calculator"         # OpenAI tool_calls, via the package
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == {"expression": "12 + 7"}
    assert first.get("content") in (None, "")
    if agent == "stream_tool_agent":
        assert seen["usage"] == [len(turn1), len(turn2), len(turn2)]      # stream_options.include_usage
    (smp,) = samples
    assert smp.reward == 1.0 and session.joins == ["new", "splice", "splice"]
    (p1, o1), (p2, o2), (p3, o3) = manager.log
    assert o1 == turn1 and p2[:len(p1) + len(o1)] == p1 + turn1            # the sampled ids, not re-encoded
    tail = tok.decode(p2[len(p1) + len(o1):])
    assert tail == "\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n"   # ChatML by hand
    assert smp.prompt_ids == p1 and smp.response_ids == (p3 + o3)[len(p1):]
    assert [i for i, m in zip(smp.response_ids, smp.loss_mask) if m] == turn1 + turn2 + turn2
    assert_server_tokens(samples, [session])


def test_text_completions_join_by_text_and_refusals(tok):
    turn1 = char_split(tok, " 19 is it")      # non-canonical: a text splice keeps it
    turn2 = tok.encode(" yes", add_special_tokens=False)
    manager = ScriptedManager({0: [(turn1, "length"), (turn2, "length")]})
    rollout = ByoAgentRollout(manager, SAMPLING, tok, ByoSettings("tests.helpers.byo_agents:text_agent", "hermes",
                                                                   CallLimits(4, 200, 12, 512), 30.0, 4), None)
    try:
        (smp,) = rollout.generate(records("12 + 7?"), 1)
        session = rollout.sessions[0]
    finally:
        rollout.close()
        manager.close()
    seen = byo_agents.SEEN[session.key]
    assert seen["first"] == " 19 is it" and seen["refused"] == ["n", "max_tokens"] and seen["models"] == ["megarl-policy"]
    assert seen["streamed"] == " yes"
    assert session.joins == ["new", "splice"] and not smp.failed and smp.reward == 1.0
    (p1, o1), (p2, o2) = manager.log
    assert p2[:len(p1) + len(o1)] == p1 + turn1
    assert tok.decode(p2[len(p1) + len(o1):]) == "\nObservation: ok\nA:"
    assert [i for i, m in zip(smp.response_ids, smp.loss_mask) if m] == turn1 + turn2


def test_cut_calls_raise_openai_errors_and_fail_the_sample(tok):
    """A rollout server that is gone (a real manager in front of a closed port) and an abort a sync
    run cannot continue: the agent's call raises ``openai.InternalServerError`` (503) at once."""
    from megarl.rollout.manager import RolloutManager
    from megarl.wire.addresses import free_port

    samples, errors = [], []
    for manager in (RolloutManager([f"http://127.0.0.1:{free_port()}"], request_retries=0, health_timeout_s=2.0),
                    ScriptedManager({0: [([5, 6, EOS], "abort")]})):
        rollout = ByoAgentRollout(manager, SAMPLING, tok, ByoSettings("tests.helpers.byo_agents:tool_agent", "hermes",
                                                                       CallLimits(3, 200, 12, 512), 60.0, 4), None)
        t = time.time()
        try:
            samples += rollout.generate(records("a"), 1)
            errors.append(byo_agents.SEEN[rollout.sessions[0].key]["error"])
        finally:
            rollout.close()
            manager.close()
        assert time.time() - t < 30      # no hang: the agent got its error and gave up
    for s, err in zip(samples, errors):
        assert s.failed and s.failure.reason == "agent_error" and s.reward != s.reward   # nan, never 0
        assert isinstance(err, openai.InternalServerError) and isinstance(err, openai.APIError)
        assert err.status_code == 503 and err.code == "rollout_unavailable" and err.type == "server_error"
    assert "NoServerLeft" in errors[0].message and "abort" in errors[1].message


def test_agent_exception_deadline_and_async_agents(tok):
    scripts = {0: [([5, EOS], "stop")], 1: [([5, EOS], "stop")], 2: [([7, 8, EOS], "stop")]}
    out = {}
    for job, name, timeout in ((0, "raising_agent", 30.0), (1, "slow_agent", 1.5), (2, "async_agent", 30.0)):
        manager = ScriptedManager({0: scripts[job]})
        rollout = ByoAgentRollout(manager, SAMPLING, tok, ByoSettings(f"tests.helpers.byo_agents:{name}", "hermes",
                                                                       CallLimits(3, 200, 12, 512), timeout, 4), None)
        t = time.time()
        try:
            out[name] = (rollout.generate(records(f"q{job}"), 1)[0], time.time() - t)
            if name == "slow_agent":   # the abandoned agent's late call: refused with 408 (trajectory over)
                rollout.pool.shutdown(wait=True)
        finally:
            rollout.close()
            manager.close()
    raised, _ = out["raising_agent"]
    assert raised.failed and raised.failure.reason == "agent_error" and "KeyError" in raised.failure.message
    slow, took = out["slow_agent"]
    assert slow.failed and slow.failure.reason == "agent_timeout" and took < 5.0   # not waiting for the agent (6 s)
    late = next(v["late_error"] for v in byo_agents.SEEN.values() if "late_error" in v)
    assert isinstance(late, openai.APIStatusError) and late.status_code == 408
    done, _ = out["async_agent"]
    assert not done.failed and done.reward == 0.5 and done.response_ids == [7, 8, EOS]


def test_entrypoint_validation_is_one_line_naming_the_field(tmp_path):
    from megarl.config import ConfigError, load_config
    from tests.helpers.runs import ROOT

    recipe = ROOT / "recipes" / "smollm2-135m-grpo-byo-agent-cpu.yaml"
    load_config(recipe, [])      # the recipe's own entrypoint (a file path) is valid
    cases = (("nosuch.module:run", "cannot import 'nosuch.module'"),
             ("tests.helpers.byo_agents:nothing", "has no attribute 'nothing'"),
             ("tests.helpers.byo_agents:SEEN", "not a callable"),
             ("no_colon", "must be package.module:function"),
             (str(tmp_path / "missing.py") + ":run", "cannot import"),
             ("tests.helpers.byo_agents:tool_agent agent.enabled=false", "agent.enabled is false"),
             ("tests.helpers.byo_agents:scaled_agent", "cannot take base_url, api_key, record"))
    for value, words in cases:
        with pytest.raises(ConfigError) as err:
            load_config(recipe, [f"agent.entrypoint={v}" if i == 0 else v for i, v in enumerate(value.split(" "))])
        problems = [p for p in err.value.problems if p.startswith("agent.entrypoint:")]
        assert len(problems) == 1 and words in problems[0] and "\n" not in problems[0], err.value.problems
    # agent.entrypoint_args: bound against the function's signature before any worker starts
    load_config(recipe, ["agent.entrypoint=tests.helpers.byo_agents:scaled_agent", "agent.entrypoint_args.scale=0.5"])
    args_cases = ((["agent.entrypoint=tests.helpers.byo_agents:tool_agent", "agent.entrypoint_args.scale=0.5"],
                   "cannot take base_url, api_key, record, scale"),
                  (["agent.entrypoint=tests.helpers.byo_agents:scaled_agent", "agent.entrypoint_args.scale=1",
                    "agent.entrypoint_args.record=x"], "given by megarl on every call"),
                  (["agent.entrypoint=null", "agent.entrypoint_args.scale=1"], "set without agent.entrypoint"))
    for overrides, words in args_cases:
        with pytest.raises(ConfigError) as err:
            load_config(recipe, overrides)
        problems = [p for p in err.value.problems if p.startswith("agent.entrypoint_args")]
        assert len(problems) == 1 and words in problems[0] and "\n" not in problems[0], err.value.problems


def test_entrypoint_args_reach_every_call(tok):
    """``agent.entrypoint_args`` from the config is what the agent function receives, per trajectory."""
    manager = ScriptedManager({0: [([5, EOS], "stop")], 1: [([6, EOS], "stop")]})
    settings = ByoSettings("tests.helpers.byo_agents:scaled_agent", "hermes", CallLimits(3, 200, 12, 512), 30.0, 4,
                           entrypoint_args={"scale": 0.25, "tag": "from-config"})
    rollout = ByoAgentRollout(manager, SAMPLING, tok, settings, None)
    try:
        samples = rollout.generate(records("a", "b"), 1)
        keys = [s.key for s in rollout.sessions]
    finally:
        rollout.close()
        manager.close()
    assert [s.reward for s in samples] == [0.25, 0.25] and not any(s.failed for s in samples)
    assert [byo_agents.SEEN[k]["tag"] for k in keys] == ["from-config"] * 2


def test_off_policy_calls_continue_after_an_abort(tok):
    """Off-policy runs (keep_versions): a call a weight update aborted is continued from its own
    tokens (partial rollouts), one recorded call with every token's weight version."""
    manager = ScriptedManager({0: [([5], "abort"), ([7, EOS], "stop")]})     # the agent asks for 3 tokens
    settings = ByoSettings("tests.helpers.byo_agents:async_agent", "hermes", CallLimits(3, 200, 12, 512), 30.0, 4,
                           keep_versions=True)
    rollout = ByoAgentRollout(manager, SAMPLING, tok, settings, None)
    try:
        (smp,) = rollout.generate(records("q"), 1)
    finally:
        rollout.close()
        manager.close()
    (p1, o1), (p2, o2) = manager.log
    assert p2 == p1 + [5] and smp.response_ids == [5, 7, EOS] and smp.loss_mask == [1, 1, 1]
    assert smp.versions == [0, 0, 0] and smp.reward == 0.5 and not smp.failed and rollout.resumed == 1


def test_limits_truncate_and_the_reward_function_scores_what_was_recorded(tok):
    """``agent.max_turns`` reached: the next call is a 400 the package raises; the agent lets it
    propagate, yet the sample is not failed -- the limit is the model's doing -- and the reward
    function scores the last recorded call (truncated, finish ``length``)."""
    manager = ScriptedManager({0: [(tok.encode("Maybe 20", add_special_tokens=False) + [EOS], "stop")]})
    scored = []
    rollout = ByoAgentRollout(manager, SAMPLING, tok,
                              ByoSettings("tests.helpers.byo_agents:tool_agent", "hermes", CallLimits(1, 200, 12, 512),
                                          30.0, 4),
                              lambda texts, recs: scored.extend(texts) or [0.75] * len(texts))
    try:
        (smp,) = rollout.generate(records("q"), 1)
        session = rollout.sessions[0]
    finally:
        rollout.close()
        manager.close()
    err = byo_agents.SEEN[session.key]["error"]
    assert isinstance(err, openai.BadRequestError) and err.code == "context_length_exceeded"
    assert not smp.failed and smp.reward == 0.75 and scored == ["Maybe 20"]
    assert smp.info["truncated"] == "max_turns" and smp.finish_reason == "length"


def test_concurrent_calls_of_one_trajectory_are_separate_segments(tok):
    manager = ScriptedManager({0: [([5, EOS], "stop"), ([6, EOS], "stop")]})
    rollout = ByoAgentRollout(manager, SAMPLING, tok, ByoSettings("tests.helpers.byo_agents:parallel_agent", "hermes",
                                                                   CallLimits(3, 200, 12, 512), 30.0, 4), None)
    try:
        samples = rollout.generate(records("q"), 1)
        session = rollout.sessions[0]
    finally:
        rollout.close()
        manager.close()
    assert session.joins == ["new", "new"] and len(samples) == 2 and all(s.reward == 1.0 for s in samples)
    assert sorted(s.response_ids for s in samples) == [[5, EOS], [6, EOS]]
    assert_server_tokens(samples, [session])


# A ChatML template in the style of Qwen's (written here): it shows ``tools`` in the system turn,
# renders an assistant message's ``tool_calls`` itself and wraps tool results in <tool_response>.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("canonical", [True, False])
def test_template_that_renders_tool_calls(tok, canonical):
    """Templates that render ``tool_calls`` and ``tools`` themselves: the returned calls go back as
    objects (arguments parsed for ``tojson``); the model's own call text is kept whether or not its
    ids are the tokenizer's encoding (extends or splice), and the tool result is the template's."""
    import copy

    qtok = copy.deepcopy(tok)
    qtok.chat_template = TOOL_TEMPLATE
    assert ChatRender(qtok).renders_tool_calls and not ChatRender(tok).renders_tool_calls
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>'
    turn1 = (qtok.encode(call, add_special_tokens=False) if canonical else char_split(qtok, call)) + [EOS]
    answer = qtok.encode("19", add_special_tokens=False) + [EOS]
    manager = ScriptedManager({0: [(turn1, "stop"), (answer, "stop"), (answer, "stop")]})
    rollout = ByoAgentRollout(manager, dict(SAMPLING, max_new_tokens=400), qtok,
                              ByoSettings("tests.helpers.byo_agents:tool_agent", "hermes", CallLimits(3, 600, 400, 1024),
                                          60.0, 4), None)
    try:
        (smp,) = rollout.generate(records("Calculate 12 + 7.", max_tokens=400), 1)
        session = rollout.sessions[0]
    finally:
        rollout.close()
        manager.close()
    (p1, o1), (p2, o2), _ = manager.log
    assert "<tools>" in qtok.decode(p1) and '"name": "calculator"' in qtok.decode(p1)    # tools= rendered
    assert session.joins[1] == ("extends" if canonical else "splice")
    assert p2[:len(p1) + len(o1)] == p1 + turn1
    assert qtok.decode(p2[len(p1) + len(o1):]) == ("\n<|im_start|>user\n<tool_response>\n19\n</tool_response>"
                                                    "<|im_end|>\n<|im_start|>assistant\n")
    assert [i for i, m in zip(smp.response_ids, smp.loss_mask) if m] == turn1 + answer + answer
    assert smp.reward == 1.0
