"""Environments and tools: the bubblewrap sandbox's isolation and limits, tool deadlines in the
agent loop, BM25 search, the exact calculator, and the tool-call parsers."""
from __future__ import annotations

import asyncio
import json
import dataclasses
import random
import time
from fractions import Fraction

import pytest

from megarl.data.records import PromptRecord
from megarl.envs.base import Action, EnvContext, ToolCall
from megarl.envs.calculator import evaluate
from megarl.envs.parsers import get_parser, hermes, llama3_json
from megarl.envs.sandbox import SandboxLimits, run_python
from megarl.envs.tools import ToolPool

# wall_s far above cpu_s: on a loaded box 1 s of CPU takes several seconds of wall clock, and the
# CPU-time case must hit the CPU limit, not the wall clock
LIMITS = SandboxLimits(cpu_s=1, wall_s=20.0, memory_mb=512, output_bytes=4096, nproc=16, tmp_mb=8)


# ------------------------------------------------------------------------------ sandbox
def test_sandbox_runs_code_and_writes_only_its_tmp():
    r = run_python("open('/tmp/a.txt', 'w').write('hi'); print(open('/tmp/a.txt').read(), 2**70)", LIMITS)
    assert r.exit_code == 0 and r.stdout.strip() == f"hi {2**70}" and r.killed is None
    for path in ("/etc/megarl_pwned", "/root/megarl_pwned", "/work/megarl_pwned"):
        r = run_python(f"open({path!r}, 'w').write('x')", LIMITS)
        assert r.exit_code != 0 and any(why in r.stderr for why in (
            "Read-only file system", "Permission denied", "No such file or directory")), r.stderr  # or not there at all
    import os

    assert not any(os.path.exists(p) for p in ("/etc/megarl_pwned", "/root/megarl_pwned", "/work/megarl_pwned"))
    # its /tmp is private: nothing it wrote is on the host
    run_python("open('/tmp/megarl_sandbox_marker', 'w').write('x')", LIMITS)
    assert not os.path.exists("/tmp/megarl_sandbox_marker")


def test_sandbox_has_no_network():
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = []
    threading.Thread(target=lambda: got.append(srv.accept()), daemon=True).start()
    code = (f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
            f"    try:\n        socket.create_connection(addr, timeout=1); print('CONNECTED', addr)\n"
            f"    except OSError as e:\n        print('refused', e.errno)\n")
    r = run_python(code, LIMITS)
    srv.close()
    assert "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2, r.observation()
    assert not got   # the host's loopback server never saw a connection


@pytest.mark.parametrize("code,limit", [
    ("import os\nwhile True:\n    os.fork()", "process limit"),
    ("x = bytearray(2 << 30)", "memory limit"),
    ("while True: pass", "CPU-time limit"),
    ("import time; time.sleep(600)", "wall-clock limit"),
    ("while True: print('y' * 1000)", "output limit"),
])
def test_sandbox_limits_stop_code_with_a_clear_observation(code, limit):
    # code that only sleeps spends no CPU, so a short wall-clock limit cannot be beaten by the CPU one
    limits = dataclasses.replace(LIMITS, wall_s=3.0) if limit == "wall-clock limit" else LIMITS
    t = time.perf_counter()
    r = run_python(code, limits)
    assert time.perf_counter() - t < limits.wall_s + 120   # a hang guard: the kill does not wait for the code
    assert r.killed is not None and limit in r.killed, r.observation()
    assert f"[sandbox: {r.killed}]" in r.observation()


def test_python_env_runs_code_through_the_pool():
    from megarl.envs.python_env import PythonEnv

    async def go():
        pool = ToolPool(2)
        # a wall-clock limit far above the CPU limit: on a loaded machine the loop still reaches 1 CPU-second first
        env = PythonEnv(EnvContext(pool, {"cpu_s": 1, "wall_s": 60.0}, tool_timeout_s=120.0))
        await env.reset(PromptRecord("What is 2**20?", answer="1048576"))
        res = await env.step(Action("", [ToolCall("python", {"code": "print(2**20)"}),
                                          ToolCall("python", {"code": "while True: pass"})]))
        final = await env.step(Action("The answer is 1048576."))
        pool.close()
        return res, final
    res, final = asyncio.run(go())
    assert res.observations[0]["content"].strip() == "1048576"
    assert "[sandbox: killed at the CPU-time limit of 1s]" in res.observations[1]["content"]
    assert not res.done and final.done and final.reward == 1.0


# ------------------------------------------------------------------------------ deadlines
def test_a_tool_past_its_deadline_truncates_only_its_trajectory():
    from transformers import AutoTokenizer

    from megarl.checkpoint.smollm2 import smollm2_hf_dir
    from megarl.rollout.agent import AgentRollout, AgentSettings, agent_metrics
    from tests.helpers.agent import ScriptedServer

    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_dir()))
    enc = lambda s: tok.encode(s, add_special_tokens=False) + [2]  # noqa: E731
    call = lambda name, args: enc(f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>')  # noqa: E731
    scripts = {j: [(call("calculator", {"expression": "6*7"}), "stop"), (enc("The answer is 42."), "stop")]
               for j in range(6)}
    scripts[3] = [(call("sleep", {"seconds": 30}), "stop"), (enc("The answer is 42."), "stop")]
    server = ScriptedServer(scripts, delay_s=0.05)
    sampling = {"max_new_tokens": 100, "temperature": 1.0, "stop_token_ids": [2]}
    # the deadline is far above a calculator call and far below the 30 s sleep
    rollout = AgentRollout(server, sampling, tok, AgentSettings("tests.helpers.agent:SleepyEnv", tool_timeout_s=3.0))
    t = time.perf_counter()
    samples = asyncio.run(rollout._batch([PromptRecord("6*7?", answer="42", index=j) for j in range(6)], 1, 1,
                                         sampling))
    elapsed = time.perf_counter() - t
    rollout.close()
    assert elapsed < 20.0                             # the batch did not wait for the 30 s tool
    for j, s in enumerate(samples):
        if j == 3:
            assert s.info["truncated"] == "tool_timeout" and s.finish_reason == "length" and s.reward == 0.0
            assert s.info["turns"] == 1
        else:
            assert not s.info["truncated"] and s.reward == 1.0 and s.info["turns"] == 2
    m = agent_metrics(samples)
    assert m["agent/tool_timeouts"] == 1 and m["agent/truncated"] == 1 and m["agent/truncated_tool_timeout"] == 1


# ------------------------------------------------------------------------------ search
def test_search_env_bm25_retrieval_and_exact_match(tmp_path):
    from megarl.envs.search import SearchEnv, exact_match

    passages = ["Paris is the capital and largest city of France.",
                "Berlin is the capital of Germany and its most populous city.",
                "The Nile is a major north-flowing river in northeastern Africa.",
                "Mount Kilimanjaro is a dormant volcano in Tanzania."] + [f"Filler passage number {i} about nothing." for i in range(20)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": i, "text": p}) for i, p in enumerate(passages)))

    async def go():
        pool = ToolPool(2)
        env = SearchEnv(EnvContext(pool, {"corpus": str(corpus), "top_k": 2}))
        await env.reset(PromptRecord("Which country is Kilimanjaro in?", answer="Tanzania"))
        res = await env.step(Action("", [ToolCall("search", {"query": "Kilimanjaro volcano"}),
                                          ToolCall("search", {"query": "capital of Germany", "k": 1})]))
        final = await env.step(Action("It is in <answer>the Tanzania</answer>"))
        pool.close()
        return res, final
    res, final = asyncio.run(go())
    assert res.observations[0]["content"].startswith("[1] Mount Kilimanjaro")
    assert res.observations[1]["content"] == "[1] " + passages[1]
    assert final.done and final.reward == 1.0
    assert exact_match("<answer>Tanzania.</answer>", ["Kenya", "tanzania"]) == 1.0
    assert exact_match("<answer>Kenya</answer>", "Tanzania") == 0.0


# ------------------------------------------------------------------------------ calculator
def test_calculator_is_exact_and_refuses_code():
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = (rng.randint(-10**9, 10**9) for _ in range(3))
        d = rng.randint(1, 999)
        assert evaluate(f"({a} + {b}) * {c} - {a} / {d}") == (Fraction(a) + b) * c - Fraction(a, d)
        assert evaluate(f"{a} // {d} + {b} % {d} + {d} ** 3") == a // d + b % d + d ** 3
    for bad in ("__import__('os').system('id')", "[1] * 10", "2 ** 100000", "1 / 0", "x + 1", "'a' * 3"):
        with pytest.raises(ValueError):
            evaluate(bad)


# ------------------------------------------------------------------------------ parsers
def test_parsers():
    calls, errors = hermes('think <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and '
                           '<tool_call>\n{"name": "g", "arguments": "{\\"y\\": 2}"}\n</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {"y": 2})] and not errors
    assert hermes("The answer is 4.") == ([], [])
    for bad in ('<tool_call>{"name": 1}</tool_call>', "<tool_call>{oops}</tool_call>", '<tool_call>{"name": "f"',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        calls, errors = hermes(bad)
        assert not calls and len(errors) == 1, bad
    calls, errors = llama3_json('<|python_tag|>{"name": "calc", "parameters": {"expression": "1;2"}}<|eom_id|>')
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"expression": "1;2"})] and not errors
    calls, errors = llama3_json('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}')
    assert [c.name for c in calls] == ["a", "b"] and not errors
    assert llama3_json("Paris.") == ([], [])
    assert llama3_json('{"name": "a", "parameters": ')[1]
    assert get_parser("tests.helpers.agent:mostly_call").__name__ == "mostly_call"
    with pytest.raises(ValueError, match="agent.tool_parser"):
        get_parser("nope")


def test_agent_config_errors_name_the_field():
    from megarl.config import load_config
    from megarl.config.loader import ConfigError
    from tests.helpers.runs import ROOT

    recipe = ROOT / "recipes" / "smollm2-135m-calculator-cpu.yaml"
    for override, field in [("agent.env=nonsense", "agent.env"), ("agent.tool_parser=xml", "agent.tool_parser"),
                            ("agent.max_turns=0", "agent.max_turns"), ("data.chat_template=false", "data.chat_template"),
                            ("agent.env=search", "agent.env_args.corpus")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(recipe, [override])
    with pytest.raises(ConfigError, match=r"agent\.env_args\.wall_s"):
        load_config(recipe, ["agent.env=python", "agent.tool_timeout_s=5", "agent.env_args={wall_s: 8}"])


def test_calculator_opening_has_one_worked_example_unless_turned_off():
    from megarl.envs.calculator import CalculatorEnv
    from megarl.envs.tools import ToolPool

    pool = ToolPool(1)
    try:
        rec = PromptRecord("Calculate 3 + 4.", answer="7")
        with_example, _ = asyncio.run(CalculatorEnv(EnvContext(pool)).reset(rec))
        plain, _ = asyncio.run(CalculatorEnv(EnvContext(pool, {"example": False})).reset(rec))
    finally:
        pool.close()
    assert [m["role"] for m in plain] == ["system", "user"]
    assert [m["role"] for m in with_example] == ["system", "user", "assistant", "tool", "assistant", "user"]
    call = get_parser("hermes")(with_example[2]["content"])[0][0]   # the example's call is one the parser reads...
    assert str(evaluate(call.arguments["expression"])) == with_example[3]["content"]   # ...and its result is exact
    assert with_example[-1] == plain[-1] == {"role": "user", "content": "Calculate 3 + 4."}
