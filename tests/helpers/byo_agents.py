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


def stream_tool_agent(base_url: str, api_key: str, record: dict, turns: int = 3) -> float:
    """``tool_agent`` with ``stream=True``: the reply is put together from the chunks' deltas, as
    streaming agents do."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}] + EXAMPLE + [{"role": "user", "content": record["prompt"]}]
    replies, calls, usage = [], 0, []
    for _ in range(turns):
        content, tool_calls = "", {}
        for chunk in client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                                    stream_options={"include_usage": True}, max_tokens=400):
            if chunk.usage is not None:
                usage.append(chunk.usage.completion_tokens)
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    call = tool_calls.setdefault(d.index, {"id": d.id, "type": "function",
                                                           "function": {"name": "", "arguments": ""}})
                    call["function"]["name"] += d.function.name or ""
                    call["function"]["arguments"] += d.function.arguments or ""
        msg = {"role": "assistant", "content": content or None}
        if tool_calls:
            msg["tool_calls"] = [tool_calls[i] for i in sorted(tool_calls)]
        replies.append(msg)
        messages.append(msg)
        for call in msg.get("tool_calls", []):
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": _calc(call["function"]["arguments"])})
        if not tool_calls:
            messages.append({"role": "user", "content": "Check it with the calculator."})
    _note(api_key, replies=replies, messages=messages, usage=usage)
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
    """``/v1/completions``: a prompt, then (streamed) the prompt + the completion + an observation;
    also refusals (n > 1, max_tokens 0) the package raises as ``BadRequestError``."""
    import openai

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = f"Q: {record['prompt']}\nA:"
    first = client.completions.create(model="policy", prompt=prompt, max_tokens=12).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="policy", prompt=prompt + first + "\nObservation: ok\nA:", max_tokens=8, stream=True) if c.choices)
    refused = []
    for kw in ({"n": 2, "max_tokens": 2}, {"max_tokens": 0}):
        try:
            client.completions.create(model="policy", prompt=prompt, **kw)
        except openai.BadRequestError as e:
            refused.append(e.param)
    _note(api_key, first=first, streamed=streamed, refused=refused, models=[m.id for m in client.models.list().data])
    return 1.0


def parallel_agent(base_url: str, api_key: str, record: dict) -> float:
    """Two sub-agents with one key, calling at the same time: each conversation is its own segment."""
    from concurrent.futures import ThreadPoolExecutor

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)

    def sub(topic: str) -> str:
        return client.chat.completions.create(model="policy", messages=[{"role": "user", "content": topic}],
                                              max_tokens=4).choices[0].message.content
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(sub, ["first topic", "second topic"]))
    return 1.0


def scaled_agent(base_url: str, api_key: str, record: dict, *, scale: float, tag: str = "") -> float:
    """One call; returns ``scale`` -- ``agent.entrypoint_args`` arrive as keyword arguments."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": record["prompt"]}],
                                   max_tokens=3)
    _note(api_key, tag=tag)
    return scale
