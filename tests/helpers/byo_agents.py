"""Agents written against the plain ``openai`` package, as users write them, for the gateway tests.

Each is called by megarl as ``fn(base_url=..., api_key=..., record=...)``. They keep what they
saw (the replies, the errors the package raised) in ``SEEN`` under their api_key, so a test
can compare the agent's view with what megarl recorded.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any

from openai import OpenAI

SEEN: dict[str, dict[str, Any]] = {}     # by api_key: one entry per trajectory
_lock = threading.Lock()

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SYSTEM = 'Tool: calculator. Call it as <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>.'
EXAMPLE = [
    {"role": "user", "content": "Calculate 48 + 27."},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "48 + 27"})}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "75"},
    {"role": "assistant", "content": "75"},
]


def _note(api_key: str, **kw: Any) -> None:
    with _lock:
        SEEN.setdefault(api_key, {}).update(kw)


def _calc(arguments: str) -> str:
    try:
        expr = json.loads(arguments).get("expression", "")
        allowed = set("0123456789+-*/(). ")
        return str(eval(expr, {"__builtins__": {}})) if expr and set(expr) <= allowed else "Error: bad expression"
    except Exception as e:  # noqa: BLE001 - the tool's error is text for the model
        return f"Error: {e}"


def tool_agent(base_url: str, api_key: str, record: dict, turns: int = 3) -> float:
    """Multi-turn with tools: tool calls are run and answered; a turn without one gets a user nudge.
    Returns a reward of its own (the number of tool calls the model made)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}] + EXAMPLE + [{"role": "user", "content": record["prompt"]}]
    replies, calls = [], 0
    for _ in range(turns):
        try:
            msg = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                 max_tokens=record.get("metadata", {}).get("max_tokens", 12)
                                                 ).choices[0].message
        except Exception as e:   # noqa: BLE001 - kept for the test, then raised as any agent would
            _note(api_key, error=e)
            raise
        replies.append(msg.model_dump(exclude_none=True))
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            for call in msg.tool_calls:
                calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": _calc(call.function.arguments)})
        else:
            messages.append({"role": "user", "content": "Check it with the calculator."})
    _note(api_key, replies=replies, messages=messages)
    return float(calls)


def rewriting_agent(base_url: str, api_key: str, record: dict) -> None:
    """Two calls, then a third whose history is summarised (the earlier turns dropped): a new segment."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": record["prompt"]}]
    for _ in range(2):
        msg = client.chat.completions.create(model="policy", messages=messages, max_tokens=6).choices[0].message
        messages += [msg.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    summary = [{"role": "system", "content": "Summary of the talk so far: the user asked a question."},
               {"role": "user", "content": record["prompt"]}]
    client.chat.completions.create(model="policy", messages=summary, max_tokens=6)
    return None


def raising_agent(base_url: str, api_key: str, record: dict) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    raise KeyError("the agent's own bug")


def slow_agent(base_url: str, api_key: str, record: dict) -> float:
    """One call, then longer than any deadline the tests set; a call after the deadline is refused."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    time.sleep(6.0)
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    except Exception as e:  # noqa: BLE001 - what the package raised is what the test checks
        _note(api_key, late_error=e)
    return 1.0


async def async_agent(base_url: str, api_key: str, record: dict) -> float:
    """An ``async def`` agent with ``AsyncOpenAI``: one call; reward = 0.5."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": record["prompt"]}],
                                         max_tokens=3)
    await client.close()
    return 0.5


def text_agent(base_url: str, api_key: str, record: dict) -> float:
    """``/v1/completions``: a prompt, then the prompt + the completion + an observation; also the
    refusals (streaming, n > 1) the package raises as ``BadRequestError``."""
    import openai

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = f"Q: {record['prompt']}\nA:"
    first = client.completions.create(model="policy", prompt=prompt, max_tokens=12).choices[0].text
    client.completions.create(model="policy", prompt=prompt + first + "\nObservation: ok\nA:", max_tokens=8)
    refused = []
    for kw in ({"stream": True}, {"n": 2}):
        try:
            client.completions.create(model="policy", prompt=prompt, max_tokens=2, **kw)
        except openai.BadRequestError as e:
            refused.append(e.param)
    _note(api_key, first=first, refused=refused, models=[m.id for m in client.models.list().data])
    return 1.0
